"""`grpolab serve`'s vLLM-style endpoints on a real server (a tiny Hugging Face Llama in a subprocess):
/tokenize, /detokenize, /tokenizer_info, /version, /metrics, and /v1/completions with `echo` and
prompt log-probs, each checked against the tokenizer and a plain forward of the model, computed here."""

import httpx
import pytest
import torch
from conftest import running_server
from prometheus_client.parser import text_string_to_metric_families

import grpolab
from grpolab.models import GPT, CharTokenizer, GPTConfig
from grpolab.models.tiny_hf import save_tiny_model
from grpolab.serve import prompt_logprobs
from grpolab.serve.batcher import Batcher, Job, SamplingParams
from grpolab.serve.metrics import Metrics

TEXTS = ["Mia has 7 shells and finds 5 more. How many now?\n12", "Tom reads 3 pages a day for 4 days.\n12"] * 50
PROMPT = "Mia has 7 shells and finds"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("endpoints") / "llama", TEXTS, vocab_size=300, max_positions=256)


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    return AutoModelForCausalLM.from_pretrained(model_dir).eval(), AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def url(model_dir):
    with running_server(model_dir, "--name", "tiny", "--max-batch", "8") as (u, proc):
        yield u
    assert proc.returncode == 0, proc.stdout.read()


def _post(url, path, body, status=200):
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code == status, r.text
    return r.json()


def _complete(url, status=200, **body):
    return _post(url, "/v1/completions", {"model": "tiny", "temperature": 0, **body}, status)


def _logp(model, ids):
    """log_softmax of one plain forward over `ids`: row i scores token i + 1."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


@pytest.mark.slow
def test_tokenize_and_detokenize_round_trip_as_the_tokenizer_does(url, hf):
    _, tok = hf
    for text in [PROMPT, "héllo 😀 <|im_start|>user\nhi<|im_end|>", " leading  spaces\n\n"]:
        for special in (True, False):
            r = _post(url, "/tokenize", {"prompt": text, "add_special_tokens": special, "return_token_strs": True})
            ids = tok(text, add_special_tokens=special)["input_ids"]
            assert r["tokens"] == ids and r["count"] == len(ids) and r["max_model_len"] == 256
            assert r["token_strs"] == tok.convert_ids_to_tokens(ids)
            assert _post(url, "/detokenize", {"tokens": ids})["prompt"] == tok.decode(ids) == text
    messages = [{"role": "user", "content": "2+2?"}]
    r = _post(url, "/tokenize", {"model": "tiny", "messages": messages})
    want = tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), add_special_tokens=False)
    assert r["tokens"] == want["input_ids"] and r["token_strs"] is None
    assert _post(url, "/detokenize", {"tokens": [len(tok)]}, 400)["error"]["param"] == "tokens"
    assert _post(url, "/tokenize", {"prompt": "a", "model": "other"}, 400)["error"]["param"] == "model"
    info = httpx.get(url + "/tokenizer_info").json()
    assert (info["eos_token"], info["bos_token"], info["pad_token"]) == ("<|im_end|>", None, "<|pad|>")
    assert info["chat_template"] == tok.chat_template and info["model_max_length"] == 256
    assert httpx.get(url + "/version").json() == {"version": grpolab.__version__}


@pytest.mark.slow
def test_echo_returns_the_prompt_scored_by_a_plain_forward(url, hf):
    model, tok = hf
    plain = _complete(url, prompt=PROMPT, max_tokens=6, logprobs=2)["choices"][0]
    r = _complete(url, prompt=PROMPT, max_tokens=6, logprobs=2, echo=True, prompt_logprobs=3)
    c = r["choices"][0]
    ids = tok(PROMPT)["input_ids"]
    out = tok(plain["text"], add_special_tokens=False)["input_ids"]
    assert c["text"] == PROMPT + plain["text"] and c["finish_reason"] == plain["finish_reason"]
    assert r["usage"]["prompt_tokens"] == len(ids) and r["usage"]["completion_tokens"] == 6
    lp = c["logprobs"]
    n = len(ids)
    assert lp["tokens"] == [tok.decode([t]) for t in ids] + plain["logprobs"]["tokens"]
    assert lp["tokens"][n:] == [tok.decode([t]) for t in out]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][n:] == plain["logprobs"]["token_logprobs"]
    assert lp["top_logprobs"][n:] == plain["logprobs"]["top_logprobs"]
    # the prompt's and the completion's tokens against one forward over both
    logp = _logp(model, ids + out)
    want = [logp[i - 1, t].item() for i, t in enumerate(ids + out) if i]
    assert lp["token_logprobs"][1:] == pytest.approx(want, abs=1e-4)
    for i in range(1, n):   # each top entry: the token itself, then the 2 most likely there
        top = logp[i - 1].topk(2)
        expect = {tok.decode([ids[i]]): logp[i - 1, ids[i]].item(),
                  **{tok.decode([t]): v for t, v in zip(top.indices.tolist(), top.values.tolist())}}
        assert lp["top_logprobs"][i] == pytest.approx(expect, abs=1e-4)
    # text_offset: where each token's text starts in `text`, from decoding the ids before it
    assert lp["text_offset"] == [len(tok.decode((ids + out)[:i])) for i in range(n + 6)]
    assert all(c["text"][o:].startswith(t) for o, t in zip(lp["text_offset"], lp["tokens"]))
    # vLLM's prompt_logprobs: rank counts the tokens more likely than the prompt's own
    pl = c["prompt_logprobs"]
    assert len(pl) == n and pl[0] is None
    for i in range(1, n):
        entry = pl[i][str(ids[i])]
        assert entry["logprob"] == pytest.approx(logp[i - 1, ids[i]].item(), abs=1e-4)
        assert entry["rank"] == int((logp[i - 1] > logp[i - 1, ids[i]]).sum()) + 1
        assert entry["decoded_token"] == tok.decode([ids[i]])
        top = logp[i - 1].topk(3).indices.tolist()
        assert set(pl[i]) == {str(ids[i]), *map(str, top)}
        assert [pl[i][str(t)]["rank"] for t in top if t != ids[i]] == [r for r, t in enumerate(top, 1) if t != ids[i]]


@pytest.mark.slow
def test_echo_of_token_batches_and_max_tokens_zero(url, hf):
    """lm-evaluation-harness's request: token-id prompts of different lengths in one batch (left-padded
    together in the prefill), echo, logprobs 1; and max_tokens 0: the prompt alone."""
    model, tok = hf
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in ("Tom reads 3 pages", "7 shells\n12 more", "a")]
    r = _complete(url, prompt=prompts, max_tokens=1, logprobs=1, echo=True)
    for ids, c in zip(prompts, r["choices"]):
        logp = _logp(model, ids)
        lps = c["logprobs"]["token_logprobs"]
        assert len(lps) == len(ids) + 1 and lps[0] is None and c["text"].startswith(tok.decode(ids))
        assert lps[1:len(ids)] == pytest.approx([logp[i - 1, t].item() for i, t in enumerate(ids) if i], abs=1e-4)
        assert lps[-1] == pytest.approx(logp[-1].max().item(), abs=1e-4)   # greedy: the best token
    zero = _complete(url, prompt=PROMPT, max_tokens=0, logprobs=0, echo=True)
    c, ids = zero["choices"][0], tok(PROMPT)["input_ids"]
    assert c["text"] == PROMPT and c["logprobs"]["tokens"] == [tok.decode([t]) for t in ids]
    assert c["finish_reason"] == "length" and zero["usage"]["completion_tokens"] == 0
    assert c["logprobs"]["top_logprobs"][1] == {tok.decode([ids[1]]): c["logprobs"]["token_logprobs"][1]}
    no_lp = _complete(url, prompt=PROMPT, max_tokens=3, echo=True)["choices"][0]
    assert no_lp["logprobs"] is None and no_lp["text"].startswith(PROMPT) and "prompt_logprobs" not in no_lp
    for body, param in [({"prompt_logprobs": 21}, "prompt_logprobs"), ({"max_tokens": 0}, "max_tokens"),
                        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs")]:
        assert _complete(url, 400, **{"prompt": "a", "max_tokens": 2, **body})["error"]["param"] == param


def _stream(url, **body) -> list[dict]:
    """The choices of a streamed completion's chunks, in order."""
    import json
    out = []
    with httpx.stream("POST", url + "/v1/completions", json={"model": "tiny", "temperature": 0, "stream": True, **body},
                      timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out += json.loads(line[6:]).get("choices", [])
    return out


@pytest.mark.slow
def test_echo_streams_what_it_answers_whole(url):
    for max_tokens in (8, 0):
        whole = _complete(url, prompt=PROMPT, max_tokens=max_tokens, logprobs=2, echo=True)["choices"][0]
        chunks = _stream(url, prompt=PROMPT, max_tokens=max_tokens, logprobs=2, echo=True)
        assert "".join(c["text"] for c in chunks) == whole["text"]
        assert chunks[0]["text"].startswith(PROMPT) and chunks[-1]["finish_reason"] == whole["finish_reason"]
        for key in ("tokens", "token_logprobs", "text_offset"):
            assert sum((c["logprobs"][key] for c in chunks if c["logprobs"]), []) == whole["logprobs"][key], key
        assert sum((c["logprobs"]["top_logprobs"] for c in chunks), []) == whole["logprobs"]["top_logprobs"]


def _scrape(url) -> dict:
    """{(sample name, labels as a sorted tuple): value} of /metrics, parsed by prometheus_client."""
    text = httpx.get(url + "/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


@pytest.mark.slow
def test_metrics_count_requests_and_tokens_exactly(url):
    ok = ("grpolab:http_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))
    bad = ("grpolab:http_requests_total", (("endpoint", "/v1/completions"), ("status", "400")))
    other = ("grpolab:http_requests_total", (("endpoint", "other"), ("status", "404")))
    before = _scrape(url)
    r = _complete(url, prompt=["Tom reads", PROMPT], max_tokens=5, n=2)
    streamed = _stream(url, prompt="a", max_tokens=3, stream_options={"include_usage": True})
    _complete(url, 400, prompt="a", max_tokens=2, temperature=-1)
    assert httpx.get(url + "/no/such/path").status_code == 404
    after = _scrape(url)

    def moved(key):
        return after.get(key, 0) - before.get(key, 0)
    assert (moved(ok), moved(bad), moved(other)) == (2, 1, 1)
    assert len([c for c in streamed if c["text"]]) == 3   # one token a chunk: the stream is counted at its end
    assert moved(("grpolab:prompt_tokens_total", ())) == r["usage"]["prompt_tokens"] + 1
    assert moved(("grpolab:generation_tokens_total", ())) == r["usage"]["completion_tokens"] + 3 == 23
    latency = moved(("grpolab:e2e_request_latency_seconds_sum", ()))
    assert moved(("grpolab:e2e_request_latency_seconds_count", ())) == 2 and 0 < latency < 60
    assert moved(("grpolab:time_to_first_token_seconds_count", ())) == 3   # one prefill per prompt
    assert after[("grpolab:num_requests_running", ())] == 0 and after[("grpolab:num_requests_waiting", ())] == 0


def test_metrics_registries_are_per_server():
    tok = CharTokenizer()
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_embd=16, block_size=32))
    a, b = (Metrics(Batcher(model, tok, context=32)) for _ in range(2))   # the global registry would refuse b
    a.prompt_tokens.inc(3)
    assert b"grpolab:prompt_tokens_total 3.0" in a.render() and b"grpolab:prompt_tokens_total 0.0" in b.render()


def test_prompt_scoring_jobs_prefill_apart_and_score_as_a_plain_forward(monkeypatch):
    """A batch of jobs that ask for prompt log-probs and one that does not: the one that does not is
    prefilled on its own (its tokens never depend on who asked), the others' scores equal a plain forward's
    (scored 3 positions at a time here, so the chunks' seams are crossed)."""
    monkeypatch.setattr(prompt_logprobs, "CHUNK", 3)
    tok = CharTokenizer()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=2, n_head=2, n_embd=32, block_size=96)).eval()
    prompts = ["12+7=", "Mia has 7", "a", "3*4=1"]
    params = SamplingParams(max_tokens=3, temperature=0)
    jobs = [Job(tok.encode(p), params, prompt_logprobs=None if i == 1 else 2) for i, p in enumerate(prompts)]
    batcher = Batcher(model, tok, max_batch=8, context=96)
    for j in jobs:
        batcher.submit(j)
    batcher.step()
    assert [j.prefilled_at is not None for j in jobs] == [True, False, False, False]   # job 1 waits its turn
    while not batcher.idle():
        batcher.step()
    alone = Job(tok.encode(prompts[1]), params)
    solo = Batcher(model, tok, max_batch=8, context=96)
    solo.submit(alone)
    while not solo.idle():
        solo.step()
    assert jobs[1].prompt_scores is None and jobs[1].choices[0].tokens == alone.choices[0].tokens
    for j in (jobs[0], jobs[2], jobs[3]):
        with torch.no_grad():
            logp = model(torch.tensor([j.prompt_ids]))[0].log_softmax(-1)
        assert j.prompt_scores[0] is None and len(j.prompt_scores) == len(j.prompt_ids)
        for i, s in enumerate(j.prompt_scores[1:], 1):
            t = j.prompt_ids[i]
            assert s.logprob == pytest.approx(logp[i - 1, t].item(), abs=1e-5)
            assert s.rank == int((logp[i - 1] > logp[i - 1, t]).sum()) + 1
            assert [x for x, _ in s.top] == logp[i - 1].topk(2).indices.tolist()


def test_text_offsets_are_where_each_token_starts(model_dir):
    """Offsets from windowed decodes equal the exact rule (the length of the text decoded before each token),
    across split UTF-8 characters; a BOS the tokenizer adds, absent from the echoed text, starts at 0."""
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    from grpolab.models.hf import HFTokenizer
    from grpolab.serve.echo import WINDOW, prefix_lengths, prompt_offsets
    tok = AutoTokenizer.from_pretrained(model_dir)
    text = "Mia has 7 shells 😀😀 and é finds 5 more 🐚 " * 3
    ids = tok(text)["input_ids"]
    assert len(ids) > 4 * WINDOW and "\ufffd" in tok.decode(ids[:ids.index(tok.encode("😀")[0]) + 1])
    assert prefix_lengths(HFTokenizer(tok), ids) == [len(tok.decode(ids[:i])) for i in range(len(ids) + 1)]
    bos = tok.convert_tokens_to_ids("<|endoftext|>")
    tok._tokenizer.post_processor = TemplateProcessing(single="<|endoftext|> $A",
                                                       special_tokens=[("<|endoftext|>", bos)])
    with_bos = tok(text)["input_ids"]
    assert with_bos == [bos] + ids
    offsets = prompt_offsets(HFTokenizer(tok), with_bos, text)
    assert offsets == [0] + [len(tok.decode(ids[:i])) for i in range(len(ids))]


def test_chat_logprob_bytes_are_each_tokens_own_bytes(model_dir, hf, url):
    """A byte-level token holding part of a UTF-8 character had the replacement character's bytes (239, 191,
    189); its own bytes are what OpenAI's `bytes` field is for. Joined, the tokens' bytes are the text's."""
    from grpolab.models.hf import HFTokenizer
    from grpolab.serve.requests import Server
    _, tok = hf
    server = Server(None, HFTokenizer(tok), "tiny", 256)
    for text in ("héllo 😀 日本", "Mia has 7 shells", "€5 — ok"):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        raw = server.token_bytes(ids)
        assert b"".join(bytes(b) for b in raw) == text.encode()
    partial = [i for i in tok("😀", add_special_tokens=False)["input_ids"] if "\ufffd" in tok.decode([i])]
    assert partial and all(server.token_bytes([i])[0] != [239, 191, 189] for i in partial)
    r = _post(url, "/v1/chat/completions", {"model": "tiny", "temperature": 0, "max_tokens": 12, "logprobs": True,
                                            "top_logprobs": 3, "messages": [{"role": "user", "content": PROMPT}]})
    entries = r["choices"][0]["logprobs"]["content"]
    assert b"".join(bytes(e["bytes"]) for e in entries).decode() == r["choices"][0]["message"]["content"]
    for e in entries:
        for t in e["top_logprobs"]:
            assert bytes(t["bytes"]).decode("utf-8", "replace") == t["token"] or "\ufffd" in t["token"]
