"""The server's logits path on a GPU: the same requests to the same tiny models served on the CPU and on
CUDA (run by hand when a GPU is lent; CI never has one). Prints one JSON line per check and a summary.

    python bench/gpu_serve_check.py              # needs torch with CUDA, fastapi, openai, llguidance, jsonschema

Checks, each CPU against CUDA (float32 built-in GPT, then a tiny Llama in float32 and bfloat16 on CUDA):
greedy completions with logit_bias, stop_token_ids, min_tokens and the three penalties (same text?); a
json_schema response format sampled 64 times (every answer that ended by itself valid?); echo with prompt
log-probs (largest difference); and one seeded request alone and inside a busy batch (same text?).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import jsonschema
import openai
import torch
from fastapi.testclient import TestClient

from grpolab.models import GPT, CharTokenizer, GPTConfig
from grpolab.models.tiny_hf import save_tiny_model
from grpolab.serve.api import create_app
from grpolab.serve.batcher import Batcher
from grpolab.serve.model_loader import load_engine
from grpolab.serve.requests import Server

SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}, "unit": {"enum": ["apples", "pears"]}},
          "required": ["answer", "unit"], "additionalProperties": False}
CUDA = "cuda"
PROMPT = "Tom has 3 apples and buys 4 more. "
GREEDY = {"plain": {}, "logit_bias": {"logit_bias": {"20": 8.0}}, "min_tokens": {"min_tokens": 10},
          "stop_token_ids": {"stop_token_ids": [20]},
          "penalties": {"presence_penalty": 0.8, "frequency_penalty": 0.5, "repetition_penalty": 1.3}}


def client(batcher: Batcher, tok, context: int):
    server = Server(batcher, tok, "m", context)
    http = TestClient(create_app(server))
    http.__enter__()
    return http, openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)


def run_all(c) -> dict:
    out = {}
    for name, kw in GREEDY.items():
        extra = {k: kw[k] for k in ("min_tokens", "stop_token_ids", "repetition_penalty") if k in kw}
        rest = {k: v for k, v in kw.items() if k not in extra}
        r = c.completions.create(model="m", prompt=PROMPT, max_tokens=24, temperature=0, extra_body=extra or None,
                                 **rest)
        out[name] = r.choices[0].text
    t0 = time.perf_counter()
    r = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "How many?"}], n=64, seed=3,
                                  max_tokens=96, temperature=1.0,
                                  response_format={"type": "json_schema",
                                                   "json_schema": {"name": "a", "schema": SCHEMA}})
    valid = 0
    finished = [ch for ch in r.choices if ch.finish_reason == "stop"]   # a cut-off answer cannot be whole JSON
    for ch in finished:
        try:
            jsonschema.validate(json.loads(ch.message.content), SCHEMA)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    out["json_valid"], out["json_s"] = f"{valid}/{len(finished)}", round(time.perf_counter() - t0, 2)
    r = c.completions.create(model="m", prompt=PROMPT, max_tokens=1, temperature=0, echo=True, logprobs=1)
    out["echo_logprobs"] = r.choices[0].logprobs.token_logprobs
    seeded = dict(model="m", prompt=PROMPT, max_tokens=24, temperature=1.0, seed=7,
                  extra_body={"repetition_penalty": 1.2})
    alone = c.completions.create(**seeded).choices[0].text
    # the same prompt first (its keys come from its place in the request) among 8 others decoded with it
    busy = c.completions.create(**{**seeded, "prompt": [PROMPT] + [PROMPT + "x" * i for i in range(1, 9)]})
    out["seeded_alone_eq_batched"] = alone == busy.choices[0].text
    return out


def compare(tag: str, a: dict, b: dict) -> dict:
    same = {k: a[k] == b[k] for k in GREEDY}
    lp = max((abs(x - y) for x, y in zip(a["echo_logprobs"][1:], b["echo_logprobs"][1:])), default=0.0)
    row = {"check": tag, "greedy_same_text": same, "json_valid_cpu": a["json_valid"],
           "json_valid_cuda": b["json_valid"],
           "json_s_cpu": a["json_s"], "json_s_cuda": b["json_s"], "echo_logprob_max_diff": lp,
           "seeded_batch_independent_cpu": a["seeded_alone_eq_batched"],
           "seeded_batch_independent_cuda": b["seeded_alone_eq_batched"]}
    print(json.dumps(row), flush=True)
    return row


def main() -> int:
    if os.environ.get("GPU_CHECK_DEVICE") == "cpu":   # a dry run of the script itself on a machine without one
        global CUDA
        CUDA = "cpu"
    elif not torch.cuda.is_available():
        print("gpu_serve_check: no CUDA device", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name(0) if CUDA == "cuda" else "cpu (dry run)"
    print(json.dumps({"device": name, "torch": torch.__version__}), flush=True)
    rows = []
    tok = CharTokenizer()
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=2, n_head=2, n_embd=64, block_size=512)).eval()
    results = {}
    for device in ("cpu", CUDA):
        http, c = client(Batcher(gpt.to(device), tok, max_batch=64, context=512), tok, 512)
        results[device] = run_all(c)
        http.__exit__(None, None, None)
    rows.append(compare("builtin_gpt_float32", results["cpu"], results[CUDA]))
    with tempfile.TemporaryDirectory() as d:
        save_tiny_model(d, vocab_size=512, hidden=64, layers=2, heads=4, intermediate=128)
        results = {}
        for device, dtype in (("cpu", "float32"), (CUDA, "float32"), (CUDA, "bfloat16")):
            batcher, htok, _ = load_engine(d, max_batch=64, max_model_len=256, dtype=dtype, device=device)
            http, c = client(batcher, htok, 256)
            results[(device, dtype)] = run_all(c)
            http.__exit__(None, None, None)
        rows.append(compare("tiny_llama_float32", results[("cpu", "float32")], results[(CUDA, "float32")]))
        rows.append(compare("tiny_llama_bf16_vs_cpu_fp32", results[("cpu", "float32")], results[(CUDA, "bfloat16")]))
    ok = all(r["json_valid_cuda"].split("/")[0] == r["json_valid_cuda"].split("/")[1]
             and r["seeded_batch_independent_cuda"] for r in rows)
    print(json.dumps({"summary": "ok" if ok else "FAILED"}), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
