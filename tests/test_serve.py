"""`grpolab serve` and `grpolab generate`: the real server on 127.0.0.1, the real `openai` client.

The batcher's outputs are checked against the rollout engine (`rollout.engine.generate`, a separate
decode path) and its log-probs against a plain full forward; batched and one-at-a-time runs must agree.
"""

import asyncio
import json
import signal
import time
import urllib.request

import httpx
import openai
import pytest
import torch
from conftest import run_cli, running_server, staggered

from grpolab.data.tasks import arithmetic
from grpolab.models import GPT, CharTokenizer, GPTConfig
from grpolab.models.checkpoint import load_model, save_checkpoint
from grpolab.rollout import kv_cache
from grpolab.rollout.engine import generate
from grpolab.serve.batcher import Batcher, Job, SamplingParams, held_back

QUESTIONS = [r["prompt"] for r in arithmetic.generate("test", 64, seed=3)]


def _builtin(block_size=512, n_embd=128, n_layer=4, seed=0) -> GPT:
    tok = CharTokenizer()
    torch.manual_seed(seed)
    m = GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=n_layer, n_head=4, n_embd=n_embd, block_size=block_size))
    with torch.no_grad():   # peaked next-token distributions: greedy choices far from ties
        m.lm_head.weight.mul_(30)
    return m.eval()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_checkpoint(tmp_path_factory.mktemp("serve") / "checkpoints", 0, _builtin(), tokenizer=CharTokenizer())


@pytest.fixture(scope="module")
def server(ckpt):
    with running_server(ckpt, "--name", "tiny", "--max-batch", "16") as (url, proc):
        yield url
    assert proc.returncode == 0, proc.stdout.read()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


def _chat(client, q, **kw):
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": q}], **kw)


def _engine_greedy(model, tok, ids, max_new_tokens):
    g = generate(model, [ids], max_new_tokens=max_new_tokens, temperature=0.0, stop_ids=tok.stop_ids,
                 pad_id=tok.pad_id)
    return g.completion_ids[0][g.completion_mask[0]].tolist()


def test_models_and_completions_match_the_engine_and_a_plain_forward(client, ckpt):
    model, tok = load_model(ckpt)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    prompt = "Mia has 7 shells"
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, logprobs=3)
    ids = tok.encode(prompt)
    want = _engine_greedy(model, tok, ids, 12)
    c = r.choices[0]
    assert c.text == tok.decode(want) and c.finish_reason == ("stop" if want[-1] in tok.stop_ids else "length")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(want))
    # log-probs: log softmax of one forward over prompt + completion, position by position
    with torch.no_grad():
        logp = model(torch.tensor([ids + want]))[0].log_softmax(-1)
    expect = [logp[len(ids) - 1 + i, t].item() for i, t in enumerate(want)]
    assert c.logprobs.token_logprobs == pytest.approx(expect, abs=1e-4)
    top = logp[len(ids) - 1].topk(3)
    assert c.logprobs.top_logprobs[0] == pytest.approx(
        {tok.decode([i], skip_special=False): v for i, v in zip(top.indices.tolist(), top.values.tolist())}, abs=1e-4)
    assert c.logprobs.tokens[0] == tok.decode([want[0]], skip_special=False)


def test_chat_uses_the_prompt_format_and_streams_the_same_text(client, ckpt):
    model, tok = load_model(ckpt)
    q = QUESTIONS[0]
    r = _chat(client, q, max_tokens=40, temperature=0)
    want = _engine_greedy(model, tok, tok.render_prompt([{"role": "user", "content": q}]), 40)
    assert r.choices[0].message.content == tok.decode(want) and r.choices[0].message.role == "assistant"
    chunks = list(_chat(client, q, max_tokens=40, temperature=0, stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == r.choices[0].message.content
    assert len([ch for ch in chunks if ch.choices and ch.choices[0].delta.content]) > 1   # streamed, not one piece
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == \
        [r.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens and not chunks[-1].choices


def test_n_seed_and_stop(client):
    q = QUESTIONS[1]
    a = _chat(client, q, n=4, temperature=1.0, seed=11, max_tokens=30)
    b = _chat(client, q, n=4, temperature=1.0, seed=11, max_tokens=30)
    c = _chat(client, q, n=4, temperature=1.0, seed=12, max_tokens=30)
    texts = [x.message.content for x in a.choices]
    assert [x.index for x in a.choices] == [0, 1, 2, 3] and len(set(texts)) > 1
    assert texts == [x.message.content for x in b.choices]
    assert texts != [x.message.content for x in c.choices]
    # stop strings: the text ends where the first one starts, streamed or not
    full = _chat(client, q, temperature=0, max_tokens=40).choices[0].message.content
    stop = full[5:7]
    cut = full[:full.index(stop)]
    r = _chat(client, q, temperature=0, max_tokens=40, stop=[stop, "\u00a7never"])
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (cut, "stop")
    streamed = "".join(ch.choices[0].delta.content or "" for ch in _chat(client, q, temperature=0, max_tokens=40,
                                                                            stop=stop, stream=True) if ch.choices)
    assert streamed == cut


def test_bad_requests_get_openai_errors(client, server):
    cases = {"max_tokens": dict(max_tokens=0), "temperature": dict(temperature=-0.5),
             "model": dict(model="other"), "messages": dict(messages=[{"role": "user", "content": "x" * 600}])}
    for param, kw in cases.items():
        args = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, **kw}
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**args)
        assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body
        assert e.value.body["type"] == "invalid_request_error" and e.value.body["message"]
    more = {"top_p": dict(top_p=0.0), "n": dict(n=17), "stop": dict(stop=["", "x"]),
            "tools[0].function.name": dict(tools=[{"type": "function", "function": {"parameters": {}}}]),
            "messages[0].content": dict(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
            "messages[0].role": dict(messages=[{"role": "robot", "content": "hi"}])}
    for param, kw in more.items():
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**{"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                              "max_tokens": 5, **kw})
        assert e.value.body["param"] == param, e.value.body
    for param, kw in {"prompt": dict(prompt="x" * 600), "logprobs": dict(logprobs=21)}.items():
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="tiny", max_tokens=5, **{"prompt": "hi", **kw})
        assert e.value.body["param"] == param, e.value.body
    # fields the server does not use are accepted
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                       presence_penalty=0.0, user="someone")
    assert r.choices[0].finish_reason in ("stop", "length")
    r = httpx.post(server + "/v1/chat/completions", content=b'{"model": "tiny", "messages": [',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(server + "/v1/completions", json={"model": "tiny"})   # no prompt
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_a_client_that_leaves_mid_stream_frees_its_rows(server):
    def health():
        return json.loads(urllib.request.urlopen(server + "/health").read())
    before = health()["steps"]
    body = {"model": "tiny", "prompt": "a", "max_tokens": 500, "n": 8, "temperature": 1.0, "stream": True}
    with httpx.stream("POST", server + "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break   # one chunk, then hang up
    for _ in range(100):
        h = health()
        if h["running"] == 0:
            break
        time.sleep(0.05)
    assert h["running"] == 0 and h["waiting"] == 0
    assert health()["steps"] - before < 400   # the rows left long before their 500 tokens


def test_a_client_that_gives_up_on_a_plain_request_frees_its_rows(server):
    def health():
        return json.loads(urllib.request.urlopen(server + "/health").read())
    before = health()["steps"]
    body = {"model": "tiny", "prompt": "a", "max_tokens": 500, "n": 16, "temperature": 1.0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server + "/v1/completions", json=body, timeout=0.2)
    for _ in range(100):
        h = health()
        if h["running"] == 0:
            break
        time.sleep(0.05)
    assert h["running"] == 0 and health()["steps"] - before < 400


@pytest.mark.slow
def test_64_concurrent_requests_equal_one_at_a_time(client, server):
    """Rows join and leave a running batch (max batch 16, so most requests wait their turn too)."""
    one = [_chat(client, q, temperature=0, max_tokens=48).choices[0].message.content for q in QUESTIONS]

    async def together():
        ac = openai.AsyncOpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
        rs = await asyncio.gather(*(ac.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": q}], temperature=0, max_tokens=48) for q in QUESTIONS))
        await ac.close()
        return [r.choices[0].message.content for r in rs]
    assert asyncio.run(together()) == one
    assert len(set(one)) > 32


@pytest.mark.slow
def test_ctrl_c_drains_in_flight_requests(ckpt):
    with running_server(ckpt, "--name", "tiny") as (url, proc):
        ac = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)

        async def run():
            tasks = [asyncio.create_task(ac.completions.create(model="tiny", prompt=q, max_tokens=400,
                                                               temperature=1.0, seed=i))
                     for i, q in enumerate(QUESTIONS[:8])]
            for _ in range(200):   # until the batch is decoding
                if json.loads(urllib.request.urlopen(url + "/health").read())["running"]:
                    break
                await asyncio.sleep(0.01)
            proc.send_signal(signal.SIGINT)
            return await asyncio.gather(*tasks)
        rs = asyncio.run(run())
        assert proc.wait(timeout=60) == 0
    assert all(r.choices[0].finish_reason in ("stop", "length") for r in rs)
    assert sum(r.usage.completion_tokens for r in rs) > 8 * 100


# ---- the batcher itself, in-process, on all three cache kinds ----------------------------------------

def _hf_models(tmp_path):
    from grpolab.models.hf import load_hf
    from grpolab.models.lean_decode import LeanDecoder
    from grpolab.models.tiny_hf import save_tiny_model
    d = save_tiny_model(tmp_path / "llama", [q + "\n#### 3" for q in QUESTIONS], vocab_size=300,
                        hidden=32, layers=2, heads=4, intermediate=64)
    model, tok = load_hf(str(d))
    with torch.no_grad():
        model.hf.lm_head.weight.mul_(3)   # tied to the embeddings: a mild scale
        decoder = LeanDecoder(model.hf, 256)
    return model, tok, decoder


@pytest.mark.parametrize("kind", ["builtin", "hf-lean", "hf-dynamic-cache"])
def test_batcher_rows_joining_a_running_batch_decode_as_alone(kind, tmp_path, monkeypatch):
    import grpolab.serve.batcher as batcher_module
    monkeypatch.setattr(batcher_module, "GROW", 8)   # frames start small and grow several times per request
    if kind == "builtin":
        model, tok, decoder = _builtin(block_size=256, n_embd=64, n_layer=2), CharTokenizer(), None
        prompts = [tok.render_prompt(q) for q in QUESTIONS[:9]]
    else:
        model, tok, decoder = _hf_models(tmp_path)
        if kind == "hf-dynamic-cache":   # HF's forward and DynamicCache (what unsupported architectures use)
            model.lean_decode, decoder = False, None
        prompts = [tok.render_prompt(q) for q in QUESTIONS[:9]]
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    batched = staggered(model, tok, prompts, greedy, max_batch=4, decoder=decoder)
    for p, got in zip(prompts, batched):
        assert got[0] == _engine_greedy(model, tok, p, 24)
    # seeded sampling, n = 3: the same tokens whatever shares the batch
    sampled = SamplingParams(max_tokens=16, temperature=1.0, top_k=20, n=3, seed=5)
    together = staggered(model, tok, prompts[:4], sampled, max_batch=8, decoder=decoder)
    alone = [staggered(model, tok, [p], sampled, max_batch=3, decoder=decoder)[0] for p in prompts[:4]]
    assert together != [[r[0]] * 3 for r in together]   # the 3 samples differ
    # each job alone was draw 0; in the batch job i is draw i: compare job 0, and rerun others at their draw
    assert together[0] == alone[0]
    b = Batcher(model, tok, max_batch=8, context=512, decoder=decoder)
    j = Job(prompts[2], sampled, draw=2)
    b.submit(j)
    b.step()
    # /health's kv_cache_bytes: at least the keys and values of the prompt's 3 rows, then nothing once idle
    layers, width = (2, 64) if kind == "builtin" else (2, 32)
    assert kv_cache.nbytes(b.cache) >= layers * 2 * 3 * len(prompts[2]) * width * 4
    while not b.idle():
        b.step()
    assert [c.tokens for c in j.choices] == together[2]
    assert b.cache is None and kv_cache.nbytes(b.cache) == 0


def test_held_back_text_waits_for_possible_stop_strings():
    assert held_back("abc##", ("###",)) == 2 and held_back("abc#", ("###", "#!")) == 1
    assert held_back("abc", ("###",)) == 0 and held_back("ab\ufffd", ()) == 1


# ---- other model directories ---------------------------------------------------------------------------

@pytest.mark.slow
def test_an_export_is_served_as_the_checkpoint_is(ckpt, client, tmp_path):
    """`grpolab export` of the built-in checkpoint (an HF Arcee model: HF's own cache path) answers as the
    checkpoint does, also with requests joining each other."""
    from grpolab.jobs.export import run_export as export
    out = tmp_path / "export"
    export(str(ckpt), str(out))
    want = [_chat(client, q, temperature=0, max_tokens=20).choices[0].message.content for q in QUESTIONS[:6]]
    with running_server(out, "--name", "exp", "--max-batch", "4") as (url, proc):
        ac = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)

        async def together():
            rs = await asyncio.gather(*(ac.chat.completions.create(
                model="exp", messages=[{"role": "user", "content": q}], temperature=0, max_tokens=20)
                for q in QUESTIONS[:6]))
            return [r.choices[0].message.content for r in rs]
        assert asyncio.run(together()) == want


def serve_and_compare(model_dir, prompts, max_tokens=8):
    """Serve an HF model directory and check greedy completions (plain-text prompts) against the engine."""
    model, tok = load_model(str(model_dir))
    with running_server(model_dir, "--name", "m") as (url, proc):
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        for p in prompts:
            r = c.completions.create(model="m", prompt=p, temperature=0, max_tokens=max_tokens)
            assert r.choices[0].text == tok.decode(_engine_greedy(model, tok, tok.render_prompt(p), max_tokens))


def test_a_lora_checkpoint_is_served_merged_and_sliding_windows_are_refused(tmp_path):
    from peft import LoraConfig, get_peft_model

    from grpolab.errors import ConfigError
    from grpolab.serve.model_loader import load_engine
    model, tok, _ = _hf_models(tmp_path)
    peft_model = get_peft_model(model.hf, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    peft_model.save_pretrained(str(tmp_path / "adapter"))
    tok.save(tmp_path / "adapter")
    batcher, _, _ = load_engine(str(tmp_path / "adapter"))
    assert batcher.decoder is not None   # merged: the lean path
    adapter_model, adapter_tok = load_model(str(tmp_path / "adapter"))   # with its (unmerged) adapters
    prompts = [adapter_tok.render_prompt(q) for q in QUESTIONS[:3]]
    got = staggered(batcher.model, adapter_tok, prompts, SamplingParams(max_tokens=12, temperature=0.0), 4,
                     decoder=batcher.decoder)
    assert [g[0] for g in got] == [_engine_greedy(adapter_model, adapter_tok, p, 12) for p in prompts]

    from transformers import MistralConfig, MistralForCausalLM
    cfg = MistralConfig(vocab_size=len(tok.tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=64, sliding_window=16, max_position_embeddings=64)
    MistralForCausalLM(cfg).save_pretrained(str(tmp_path / "mistral"))
    tok.save(tmp_path / "mistral")
    with pytest.raises(ConfigError, match="sliding-window"):
        load_engine(str(tmp_path / "mistral"))


# ---- grpolab generate --------------------------------------------------------------------------------

@pytest.mark.slow
def test_generate_writes_resumes_and_scores(ckpt, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = [{"prompt": q, "id": f"q{i}"} for i, q in enumerate(QUESTIONS[:6])]
    rows[1]["prompt"] = [{"role": "user", "content": QUESTIONS[1]}]
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reward = tmp_path / "rw.py"
    reward.write_text("def length(completions, id, **kw):\n"   # chat prompts: completions are messages (TRL's way)
                      "    texts = [c if isinstance(c, str) else c[0]['content'] for c in completions]\n"
                      "    return [len(c) + int(i[1:]) for c, i in zip(texts, id)]\n")
    args = ["generate", str(ckpt), "--in", str(inp), "--out", str(out), "--n", "2", "--max-batch", "4",
            "temperature=1.0", "max_tokens=30", "seed=3", "--score", "--config", str(tmp_path / "none.yaml"),
            f"reward.functions=[{reward}:length]"]
    (tmp_path / "none.yaml").write_text("{}\n")
    r = run_cli(*args)
    assert r.returncode == 0, r.stderr
    assert "rows/s" in r.stdout and "ETA" in r.stdout
    full = out.read_text()
    got = [json.loads(line) for line in full.splitlines()]
    assert [g["index"] for g in got] == list(range(6)) and [g["id"] for g in got] == [x["id"] for x in rows]
    assert all(len(g["completions"]) == 2 and g["rewards"] == [len(c) + i for c in g["completions"]]
               for i, g in enumerate(got))
    assert got[1]["prompt"] == rows[1]["prompt"]
    # an interrupted job: two rows missing and a line cut short; the rerun completes it to the same file
    lines = full.splitlines()
    out.write_text("\n".join(lines[:2] + lines[4:]) + "\n" + lines[2][:25])
    r = run_cli(*args)
    assert r.returncode == 0, r.stderr
    assert "2 rows to do (4 already" in r.stdout
    assert out.read_text() == full


@pytest.mark.slow
def test_generate_errors_name_the_row(ckpt, tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"prompt": "hi"}) + "\n" + json.dumps({"question": "no prompt"}) + "\n")
    r = run_cli("generate", str(ckpt), "--in", str(inp), "--out", str(tmp_path / "o.jsonl"))
    assert r.returncode == 2 and "line 2 has no 'prompt'" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    inp.write_text(json.dumps({"prompt": "hi"}) + "\n")
    r = run_cli("generate", str(ckpt), "--in", str(inp), "--out", str(tmp_path / "o.jsonl"), "temprature=0")
    assert r.returncode == 2 and "'temprature' is not a sampling setting" in r.stderr
    inp.write_text(json.dumps({"prompt": "hi"}) + "\n" + json.dumps({"prompt": "x" * 600}) + "\n")
    r = run_cli("generate", str(ckpt), "--in", str(inp), "--out", str(tmp_path / "o.jsonl"))
    assert r.returncode == 2 and "row index 1: the prompt is" in r.stderr and not (tmp_path / "o.jsonl").exists()
    inp.write_text(json.dumps({"prompt": "hi", "rewards": 1}) + "\n")
    r = run_cli("generate", str(ckpt), "--in", str(inp), "--out", str(tmp_path / "o.jsonl"))
    assert r.returncode == 2 and "column 'rewards'" in r.stderr
