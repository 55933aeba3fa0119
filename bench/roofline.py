"""This machine's own limits, to state rollout and step results against: float32 matmul GFLOP/s at
the realistic decode and update shapes, and memory bandwidth (a STREAM-style copy).

The realistic shape (bench/rollout.py --shape realistic) is a Llama of hidden 512, 8 layers, MLP 1024,
vocab 32,000, decoding 64 rows. "Decode" times that model's per-token matmuls for 64 rows (the
projections of every layer and the output head); "update" times the same weights at 4,096 tokens
(a slice of a step's 64 x 384: at that size the rate no longer depends on the row count), forward
and the two backward matmuls. Each figure is the median of `--runs` timings.

    python bench/roofline.py [--runs 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

HIDDEN, LAYERS, MLP, VOCAB = 512, 8, 1024, 32_000
ROWS, UPDATE_TOKENS = 64, 4096


def _linears() -> list[tuple[int, int]]:
    """(in, out) of every matmul one token goes through: per layer fused QKV, O, gate+up, down; then the head."""
    per_layer = [(HIDDEN, 3 * HIDDEN), (HIDDEN, HIDDEN), (HIDDEN, 2 * MLP), (MLP, HIDDEN)]
    return per_layer * LAYERS + [(HIDDEN, VOCAB)]


def _time(fn, runs: int) -> float:
    fn()   # warm-up
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def matmul_gflops(rows: int, runs: int, backward: bool = False) -> float:
    """GFLOP/s of the model's matmuls for `rows` tokens (with `backward`: also dX = dY W and dW = dY^T X)."""
    weights = [torch.randn(n_in, n_out) * 0.02 for n_in, n_out in _linears()]
    xs = {n_in: torch.randn(rows, n_in) for n_in, _ in _linears()}
    grads = {n_out: torch.randn(rows, n_out) for _, n_out in _linears()}

    def run():
        for w in weights:
            x = xs[w.size(0)]
            torch.mm(x, w)
            if backward:
                g = grads[w.size(1)]
                torch.mm(g, w.t())
                torch.mm(x.t(), g)
    flops = sum(2 * rows * a * b for a, b in _linears()) * (3 if backward else 1)
    return flops / _time(run, runs) / 1e9


def bandwidth_gbs(runs: int, mbytes: int = 512) -> float:
    """Copy bandwidth in GB/s (bytes read + bytes written per second), arrays far larger than the caches."""
    a = torch.ones(mbytes * 2**20 // 4)
    b = torch.empty_like(a)
    return 2 * a.numel() * 4 / _time(lambda: b.copy_(a), runs) / 1e9


def measure(runs: int = 7) -> dict:
    return {"decode_matmul_gflops": round(matmul_gflops(ROWS, runs), 1),
            "update_matmul_gflops": round(matmul_gflops(UPDATE_TOKENS, max(3, runs // 2), backward=True), 1),
            "copy_bandwidth_gbs": round(bandwidth_gbs(runs), 1), "threads": torch.get_num_threads()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(2)
    print(json.dumps({"bench": "roofline", **measure(args.runs), "torch": torch.__version__}))


if __name__ == "__main__":
    main()
