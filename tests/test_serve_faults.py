"""Faults of `grpolab serve` (issue 66): a grammar that admits no string, /health held while a large
/tokenize response is built, and `--device cuda` on a machine without CUDA.

Everything runs for real: a `grpolab serve` subprocess over a tiny Hugging Face Llama (its tokenizer, its
llguidance vocabulary), httpx, and the CLI in a subprocess.
"""

import threading

import httpx
import pytest
import torch
from conftest import run_cli, running_server
from test_serve import _builtin

from grpolab.models import CharTokenizer
from grpolab.models.checkpoint import save_checkpoint
from grpolab.models.tiny_hf import save_tiny_model

TEXTS = ["Mia has 7 shells and finds 5 more. How many now?\n12", "Tom reads 3 pages a day for 4 days.\n12"] * 50


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("faults") / "llama", TEXTS, vocab_size=300, max_positions=256)


@pytest.fixture(scope="module")
def url(model_dir):
    with running_server(model_dir, "--name", "tiny", "--max-batch", "4") as (u, proc):
        yield u
    assert proc.returncode == 0, proc.stdout.read()


# ---- a grammar that admits no string ------------------------------------------------------------------

# each admits no string: a rule that only refers to itself (Lark, GBNF), an empty character class
EMPTY = [{"grammar": 'start: x\nx: x "a"'}, {"grammar": 'root ::= root "a"'}, {"regex": "[^\\s\\S]"}]


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_a_grammar_that_admits_no_string_is_a_400(url, endpoint):
    """It answered 200 with an empty completion, where an unsatisfiable JSON schema is a 400."""
    base = {"model": "tiny", "max_tokens": 8, "temperature": 0}
    base.update({"prompt": "Mia has"} if endpoint == "/v1/completions" else
                {"messages": [{"role": "user", "content": "Mia has"}]})
    for spec in EMPTY:
        r = httpx.post(url + endpoint, json={**base, "structured_outputs": spec}, timeout=60)
        assert r.status_code == 400, (spec, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == "structured_outputs", err
        assert "admits no string" in err["message"], err
    # a grammar of the empty string alone admits one string: answered with it, as any other grammar's
    for spec, want in (({"grammar": 'start: ""'}, ""), ({"grammar": 'start: "ab"'}, "ab"), ({"regex": "ab?"}, "a")):
        r = httpx.post(url + endpoint, json={**base, "structured_outputs": spec}, timeout=60)
        assert r.status_code == 200, (spec, r.text)
        choice = r.json()["choices"][0]
        text = choice["text"] if endpoint == "/v1/completions" else choice["message"]["content"]
        assert choice["finish_reason"] == "stop" and text in (want, "ab"), (spec, choice)


# ---- /health while a large /tokenize is served ---------------------------------------------------------

def test_health_answers_while_a_large_tokenize_response_is_built(url, model_dir):
    """Two large /tokenize requests (token strings too) queue in the server's one preparing thread; after
    the first one's response has arrived, /health must still answer while the second one is prepared
    (`preparing` 1). It did not: each response was built on the event loop (token_strs, FastAPI's
    jsonable_encoder over millions of items, json.dumps), which held /health and every other request for
    as long, and the second request's tokenizing ended while the first response was being built."""
    from transformers import AutoTokenizer

    text = ("Mia has 7 shells and finds 5 more. How many now? " * 12000)[:600_000]
    texts = [text, text[:len(text) // 2]]   # the second shorter: before the fix its tokenizing always ended first
    got, seen, arrived = {}, [], threading.Event()

    def tokenize(k):
        got[k] = httpx.post(url + "/tokenize", json={"prompt": texts[k], "return_token_strs": True}, timeout=600)
        if k == 0:
            arrived.set()

    def health():
        return httpx.get(url + "/health", timeout=600).json()

    first = threading.Thread(target=tokenize, args=(0,))
    first.start()
    while health()["preparing"] < 1:   # the first is in the preparing thread: the second queues behind it
        pass
    second = threading.Thread(target=tokenize, args=(1,))
    second.start()
    while second.is_alive():
        after = arrived.is_set()
        h = health()
        seen.append((after, h["preparing"]))
    first.join()
    second.join()
    assert (True, 1) in seen, seen   # /health answered after the first response, the second still preparing
    hf = AutoTokenizer.from_pretrained(model_dir)
    for k in (0, 1):   # the responses hold what the tokenizer gives, as JSON
        assert got[k].status_code == 200, got[k].text
        body, ids = got[k].json(), hf(texts[k])["input_ids"]
        assert body == {"count": len(ids), "max_model_len": 256, "tokens": ids,
                        "token_strs": hf.convert_ids_to_tokens(ids)}


# ---- --device cuda without CUDA ------------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_serve_and_generate_on_cuda_without_cuda_are_one_line(tmp_path, model_dir):
    """`grpolab serve --device cuda` on a CPU-only machine was a traceback (a built-in checkpoint) or an
    error naming model.device (a Hugging Face model): one line naming --device, exit 2, as `grpolab train`."""
    ckpt = save_checkpoint(tmp_path / "checkpoints", 0, _builtin(n_embd=32, n_layer=1), tokenizer=CharTokenizer())
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    out = tmp_path / "out.jsonl"
    for model, verb, device in ((ckpt, "serve", "cuda"), (model_dir, "generate", "cuda:1")):
        argv = ["serve", str(model), "--port", "0"] if verb == "serve" else \
            ["generate", str(model), "--in", str(prompts), "--out", str(out)]
        r = run_cli(*argv, "--device", device, timeout=120)
        lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("grpolab: warning:")]
        assert r.returncode == 2 and len(lines) == 1, (verb, device, r.returncode, r.stderr)
        assert lines[0].startswith("grpolab: ") and f"--device: {device!r}" in lines[0], lines
        assert "Traceback" not in r.stderr and not out.exists()
