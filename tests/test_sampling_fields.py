"""The server's sampling fields beyond temperature/top-k/top-p: logit_bias, stop_token_ids, min_tokens,
presence/frequency/repetition penalties, structured output (response_format, structured_outputs), best_of,
and the 400 for any field the server does not implement.

The real app (create_app over a real Batcher and a tiny built-in GPT) in-process, driven by the real
`openai` client over Starlette's TestClient. Every processed output is checked against a plain re-computation
here: a greedy decode over full forwards of the same model, with the field's formula written out in Python.
"""

import json
import math
import re

import jsonschema
import openai
import pytest
import torch
from conftest import penalized
from fastapi.testclient import TestClient

from grpolab.errors import ConfigError
from grpolab.models import GPT, CharTokenizer, GPTConfig
from grpolab.rollout import logits_processors as lp
from grpolab.serve.api import create_app
from grpolab.serve.batcher import Batcher, Job, SamplingParams
from grpolab.serve.generate import sampling_params, sampling_settings
from grpolab.serve.requests import Server

TOK = CharTokenizer()
PROMPT = "Tom has 3 apples and buys 4 more. "


def _model(head_scale: float, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    m = GPT(GPTConfig(vocab_size=TOK.vocab_size, n_layer=2, n_head=2, n_embd=64, block_size=512))
    with torch.no_grad():   # x3: greedy far enough from ties, penalties able to change it; small: near uniform
        m.lm_head.weight.mul_(head_scale)
    return m.eval()


@pytest.fixture(scope="module")
def peaked():
    return _model(3.0)


def _client(model):
    server = Server(Batcher(model, TOK, max_batch=64, context=512), TOK, "tiny", 512)
    http = TestClient(create_app(server))
    http.__enter__()   # runs the lifespan: the batcher's thread
    return http, openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)


@pytest.fixture(scope="module")
def client(peaked):
    http, c = _client(peaked)
    yield c
    http.__exit__(None, None, None)


@pytest.fixture(scope="module")
def flat_client():
    http, c = _client(_model(0.2, seed=1))
    yield c
    http.__exit__(None, None, None)


def _complete(client, **kw):
    args = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, **kw}
    extra = {k: args.pop(k) for k in ("min_tokens", "stop_token_ids", "repetition_penalty", "structured_outputs",
                                      "top_k") if k in args}
    return client.completions.create(**args, extra_body=extra or None).choices[0]


def _logits(model, ids: list[int]) -> list[float]:
    with torch.no_grad():
        return model(torch.tensor([ids]))[0, -1].tolist()


def _greedy(model, ids: list[int], steps: int, process) -> list[int]:
    """A plain greedy decode: full forward each step, `process(logits list, out so far)` in Python, argmax;
    ends at a stop token (kept, as the server counts it)."""
    out: list[int] = []
    for _ in range(steps):
        logits = process(_logits(model, ids + out), out)
        out.append(max(range(len(logits)), key=logits.__getitem__))
        if out[-1] in TOK.stop_ids:
            break
    return out


def test_logit_bias_adds_to_the_logits_and_log_probs_stay_the_models(client, peaked):
    ids = TOK.encode(PROMPT)
    plain = _greedy(peaked, ids, 12, lambda x, out: x)
    x = TOK.stoi["Q"]
    c = _complete(client, logit_bias={str(x): 100}, logprobs=1, max_tokens=5)
    assert c.text == "Q" * 5
    # the returned log-probs are the model's own (vLLM's default raw_logprobs), not after the bias
    raw = torch.tensor(_logits(peaked, ids)).log_softmax(-1)[x].item()
    assert c.logprobs.token_logprobs[0] == pytest.approx(raw, abs=1e-4) and raw < -1
    # -100 on the model's greedy first token: the decode goes where the biased logits say
    ban = {plain[0]: -100.0}
    want = _greedy(peaked, ids, 12, lambda x, out: [v + ban.get(i, 0.0) for i, v in enumerate(x)])
    c = _complete(client, logit_bias={str(plain[0]): -100})
    assert c.text == TOK.decode(want) and want[0] != plain[0]


def test_stop_token_ids_end_the_choice_at_that_id(client, peaked):
    plain = _greedy(peaked, TOK.encode(PROMPT), 12, lambda x, out: x)
    k = 3
    stop = plain[k]
    first = plain.index(stop)
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0,
                                  extra_body={"stop_token_ids": [stop]})
    assert (r.choices[0].text, r.choices[0].finish_reason) == (TOK.decode(plain[:first]), "stop")
    assert r.usage.completion_tokens == first + 1   # the stop token counts, its text is left out (as vLLM)


def test_min_tokens_bans_stop_tokens_until_reached(client, peaked):
    eos, x = TOK.eos_id, TOK.stoi["Z"]
    ids = TOK.encode(PROMPT)
    # +100 on the end token: without min_tokens the choice ends at once
    c = _complete(client, logit_bias={str(eos): 100})
    assert (c.text, c.finish_reason) == ("", "stop")
    c = _complete(client, logit_bias={str(eos): 100}, min_tokens=4)
    want = _greedy(peaked, ids, 12, lambda v, out: [(-math.inf if i == eos and len(out) < 4 else s + 100 * (i == eos))
                                                    for i, s in enumerate(v)])
    assert len(want) == 5 and want[-1] == eos and c.finish_reason == "stop" and c.text == TOK.decode(want)
    # stop_token_ids are stop tokens too: banned until min_tokens
    c = _complete(client, logit_bias={str(x): 100}, stop_token_ids=[x], min_tokens=3)
    want = _greedy(peaked, ids, 12, lambda v, out: [-math.inf if i in (x, eos) and len(out) < 3
                                                    else s + 100 * (i == x) for i, s in enumerate(v)])
    assert c.finish_reason == "stop" and c.text == TOK.decode(want[:3]) and "Z" not in c.text


def _penalized(prompt: list[int], presence: float, frequency: float, repetition: float):
    """conftest.penalized as a `_greedy` step: (logits, output so far) -> processed logits."""
    return lambda logits, out: penalized(prompt, out, logits, presence, frequency, repetition)


def _no_stop(process):
    """`process`, then the stop tokens banned (min_tokens = max_tokens: the decode runs its full length)."""
    return lambda x, out: [-math.inf if i in TOK.stop_ids else v for i, v in enumerate(process(x, out))]


@pytest.mark.parametrize("presence,frequency,repetition", [(1.5, 0.0, 1.0), (0.0, 0.9, 1.0), (0.0, 0.0, 1.8),
                                                           (-0.5, 0.4, 1.3)])
def test_penalties_match_a_plain_reimplementation(client, peaked, presence, frequency, repetition):
    ids = TOK.encode(PROMPT)
    want = _greedy(peaked, ids, 40, _no_stop(_penalized(ids, presence, frequency, repetition)))
    assert want != _greedy(peaked, ids, 40, _no_stop(lambda x, out: x))   # the penalties change this decode
    c = _complete(client, max_tokens=40, min_tokens=40, presence_penalty=presence, frequency_penalty=frequency,
                  repetition_penalty=repetition)
    assert c.text == TOK.decode(want)


def test_penalize_is_the_formula_on_a_models_logits(peaked):
    ids = TOK.encode(PROMPT)
    out = TOK.encode("apples apples 7")
    logits = torch.tensor([_logits(peaked, ids + out), _logits(peaked, ids)])
    got = lp.penalize(logits, lp.token_counts([ids, []], TOK.vocab_size) > 0,
                      lp.token_counts([out, []], TOK.vocab_size), torch.tensor([0.5, 0.5]),
                      torch.tensor([0.25, 0.25]), torch.tensor([1.7, 1.7]))
    assert got[0].tolist() == pytest.approx(_penalized(ids, 0.5, 0.25, 1.7)(logits[0].tolist(), out), abs=1e-5)
    assert got[1].tolist() == pytest.approx(_penalized([], 0.5, 0.25, 1.7)(logits[1].tolist(), []), abs=1e-5)


def _run(batcher: Batcher, jobs_at: dict[int, list[Job]]) -> None:
    """Step the batcher in this thread, submitting each job at its step, until all are done."""
    step = 0
    while step <= max(jobs_at) or not batcher.idle():
        for job in jobs_at.get(step, []):
            batcher.submit(job)
        batcher.step()
        step += 1


def test_seeded_sampling_with_processors_does_not_depend_on_the_batch(peaked):
    ids = TOK.encode(PROMPT)
    proc = SamplingParams(max_tokens=20, temperature=1.0, n=3, seed=5, presence_penalty=0.8, frequency_penalty=0.3,
                          repetition_penalty=1.4, logit_bias={TOK.stoi["e"]: 3.0}, min_tokens=5, logprobs=0)
    plain = SamplingParams(max_tokens=20, temperature=1.0, n=2, seed=9, logprobs=0)

    def alone(params, prompt=ids):
        job = Job(prompt, params)
        _run(Batcher(peaked, TOK, max_batch=16, context=512), {0: [job]})
        return [(c.tokens, c.logprobs) for c in job.choices]

    other = TOK.encode("Other prompt, longer than the first one: ")
    a, b = Job(ids, proc), Job(other, plain)
    others = [Job(ids, SamplingParams(max_tokens=20, temperature=0.7, top_k=5, n=2, seed=1, presence_penalty=-1.0)),
              Job(ids, SamplingParams(max_tokens=20, temperature=1.0, n=2, seed=2, repetition_penalty=0.5))]
    _run(Batcher(peaked, TOK, max_batch=16, context=512), {0: [others[0], b], 3: [a, others[1]]})
    _same(a, alone(proc))
    assert len({tuple(c.tokens) for c in a.choices}) > 1
    _same(b, alone(plain, other))   # a row without processors beside processed rows: as alone


def _same(job: Job, alone: list) -> None:
    """The same tokens as alone; the log-probs to float rounding (the model's batched forward may round
    differently in another batch; the sampled tokens do not depend on it here)."""
    assert [c.tokens for c in job.choices] == [t for t, _ in alone]
    for c, (_, lps) in zip(job.choices, alone):
        assert c.logprobs == pytest.approx(lps, abs=1e-5)


SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": -5, "maximum": 99},
        "tag": {"enum": ["red", "green", "blue"]},
        "s": {"type": "string", "maxLength": 4},
        "xs": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
    },
    "required": ["ok", "n", "tag", "s", "xs"],
    "additionalProperties": False,
}


@pytest.mark.slow
def test_json_schema_outputs_all_validate(flat_client):
    texts = []
    for n, extra in ((64, {"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}}),
                     (64, {"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}}),
                     (64, {"extra_body": {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}}),
                     (64, {"extra_body": {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}})):
        r = flat_client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "json please"}],
                                                n=n, temperature=1.0, max_tokens=300, **extra)
        assert {c.finish_reason for c in r.choices} == {"stop"}
        texts += [c.message.content for c in r.choices]
    assert len(texts) == 256 and len(set(texts)) > 100   # sampled, not one answer repeated
    for t in texts:
        jsonschema.validate(json.loads(t), SCHEMA)
    # disable_any_whitespace: none between JSON's tokens (inside strings is content)
    assert not any(ch.isspace() for t in texts[128:] for ch in _outside_strings(t))
    assert any(any(ch.isspace() for ch in _outside_strings(t)) for t in texts[:128])   # default: allowed


def _outside_strings(text: str) -> str:
    """The characters of JSON text outside its string literals."""
    out, inside, escaped = [], False, False
    for ch in text:
        if inside:
            inside = escaped or ch != '"'
            escaped = not escaped and ch == "\\"
        elif ch == '"':
            inside = True
        else:
            out.append(ch)
    return "".join(out)


def test_json_object_regex_and_choice(flat_client):
    chat = dict(model="tiny", messages=[{"role": "user", "content": "go"}], temperature=1.0, max_tokens=200, n=16)
    # any JSON object; strings and objects end sooner with a bias on '"' and '}' (a bias and a grammar together)
    r = flat_client.chat.completions.create(**chat, response_format={"type": "json_object"},
                                            logit_bias={str(TOK.stoi['"']): 4, str(TOK.stoi["}"]): 4})
    assert {c.finish_reason for c in r.choices} == {"stop"}
    assert all(isinstance(json.loads(c.message.content), dict) for c in r.choices)
    r = flat_client.chat.completions.create(**chat, extra_body={"structured_outputs": {"regex": "[a-c]{2,5}x"}})
    texts = [c.message.content for c in r.choices]
    assert all(re.fullmatch("[a-c]{2,5}x", t) for t in texts) and len(set(texts)) > 1, texts
    choices = ["yes", "no", "maybe"]
    r = flat_client.chat.completions.create(**chat, extra_body={"structured_outputs": {"choice": choices}})
    got = {c.message.content for c in r.choices}
    assert got <= {"yes", "no", "maybe"} and len(got) > 1


def test_unimplemented_and_bad_fields_get_a_400_naming_them(client):
    base = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    cases = {"suffix": {"suffix": "x"}, "functions": {"functions": []}, "reasoning_effort": {"reasoning_effort": "low"},
             "best_of": {"best_of": 3}, "logit_bias": {"logit_bias": {"abc": 1}},
             "presence_penalty": {"presence_penalty": 2.5}, "frequency_penalty": {"frequency_penalty": -3},
             "repetition_penalty": {"repetition_penalty": 0}, "min_tokens": {"min_tokens": 6},
             "stop_token_ids": {"stop_token_ids": [10 ** 6]},
             "response_format": {"response_format": {"type": "yaml"}},
             "structured_outputs": {"structured_outputs": {"regex": "(("}},
             "structured_outputs.structural_tag": {"structured_outputs": {"structural_tag": "{}"}},
             "prompt_logprobs": {"prompt_logprobs": 1}}   # completions only (the chat API would ignore it)
    for param, kw in cases.items():
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**base, extra_body=kw)
        assert e.value.status_code == 400 and e.value.body["param"] == param, (param, e.value.body)
        assert param.split(".")[-1] in e.value.body["message"], e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**base, extra_body={"suffix": "x"})
    assert e.value.body["message"].startswith("suffix: not supported by this server")
    with pytest.raises(openai.BadRequestError) as e:   # outside [-100, 100], as OpenAI (vLLM clamps instead)
        client.chat.completions.create(**base, logit_bias={"5": 101})
    assert e.value.body["param"] == "logit_bias"
    # the harmless fields pass, and best_of = n is no change
    r = client.chat.completions.create(**base, user="u", metadata={"a": "b"}, store=False, n=2,
                                       extra_body={"best_of": 2, "service_tier": "auto"})
    assert len(r.choices) == 2


def test_generate_takes_min_tokens_and_the_penalties():
    got = sampling_settings(["min_tokens=3", "presence_penalty=0.5", "frequency_penalty=-1", "repetition_penalty=1.2"])
    p = sampling_params(got, max_tokens=10, n=1)
    assert (p.min_tokens, p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (3, 0.5, -1, 1.2)
    for bad, field in (("presence_penalty=3", "presence_penalty"), ("min_tokens=1.5", "min_tokens"),
                       ("repetition_penalty=0", "repetition_penalty")):
        with pytest.raises(ConfigError, match=field):
            sampling_settings([bad])


def test_unpack_bitmask_reads_bit_v_mod_32_of_word_v_div_32():
    g = torch.Generator().manual_seed(0)
    for vocab in (33, 105, 1000):
        bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (3, (vocab + 31) // 32), dtype=torch.int32, generator=g)
        want = [[(int(bits[b, v // 32]) >> (v % 32)) & 1 == 1 for v in range(vocab)] for b in range(3)]
        assert lp.unpack_bitmask(bits, vocab).tolist() == want


def test_a_schema_no_value_satisfies_and_a_bad_tool_schema_are_400s(client):
    """A $ref that refers only to itself admits no JSON value: it answered 200 with empty content (issue 48).
    A recursive schema that values do satisfy still works; a tool's `parameters` schema is checked as
    response_format's is."""
    base = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40}
    for schema in ({"$ref": "#"}, {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**base, response_format={"type": "json_schema", "json_schema": {
                "name": "t", "schema": schema}})
        assert e.value.body["param"] == "response_format" and "admits no JSON value" in e.value.body["message"]
    tree = {"type": "object", "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "maxItems": 1,
                                                                               "items": {"$ref": "#"}}},
            "required": ["v"], "additionalProperties": False}
    r = client.chat.completions.create(**{**base, "max_tokens": 200}, n=4, temperature=1.0, seed=3,
                                       response_format={"type": "json_schema", "json_schema": {"name": "t",
                                                                                               "schema": tree}})
    done = [c.message.content for c in r.choices if c.finish_reason == "stop"]
    assert done and all(isinstance(json.loads(x)["v"], int) for x in done)
    tool = {"type": "function", "function": {"name": "calc", "parameters": {
        "type": "object", "properties": {"x": {"type": "no-such-type"}}}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**base, tools=[tool])
    assert e.value.body["param"] == "tools[0].function.parameters", e.value.body
    assert "'calc'" in e.value.body["message"] and "not a usable JSON schema" in e.value.body["message"]
