"""Peak memory and time of the policy's log-prob pass (forward + backward), per memory switch.

What it runs: `completion_logprobs` with entropy, then backward of sum(logp), on a random
Hugging Face Llama (width 256, 4 layers, 32,000-token vocabulary: a small model with a real
vocabulary, where the vocabulary-wide tensors dominate), 8 rows x (64 prompt + 128 completion)
tokens, float32, 2 threads. Each mode runs in its own processes; the peak is the rise of resident
memory (VmHWM, reset before the pass) over the resident memory just before it, in the last of 3
passes (the first also allocates once), the time the best of 3 in another process (see main).

    .venv/bin/python bench/logprob_memory.py [--vocab 32000] [--rows 8] [--completion 128]

Prints ONE JSON line: per mode, step_peak_mb and seconds, and each mode's peak relative to
`full`. bench/memory.py measures a whole GRPO step, with LoRA, against TRL.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

MODES = {"full": (0, False), "chunk32": (32, False), "full+ckpt": (0, True), "chunk32+ckpt": (32, True)}


def _status(key: str) -> float:
    return int(next(ln for ln in open("/proc/self/status") if ln.startswith(key)).split()[1]) / 1024


def one(mode: str, vocab: int, rows: int, completion: int) -> dict:
    import torch

    from grpolab.models import set_gradient_checkpointing
    from grpolab.models.hf import HFPolicy
    from grpolab.models.logprobs import completion_logprobs
    from grpolab.models.tiny_hf import build_tiny_llama

    chunk, ckpt = MODES[mode]
    torch.set_num_threads(2)
    model = HFPolicy(build_tiny_llama(vocab, hidden=256, layers=4, heads=4, intermediate=1024)).train()
    set_gradient_checkpointing(model, ckpt)
    g = torch.Generator().manual_seed(0)
    pid = torch.randint(0, vocab, (rows, 64), generator=g)
    cid = torch.randint(0, vocab, (rows, completion), generator=g)
    pm, cm = torch.ones_like(pid, dtype=torch.bool), torch.ones_like(cid, dtype=torch.bool)
    times, peak = [], 0.0
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")   # reset the peak resident size (VmHWM) to the current one
        before = _status("VmRSS")
        t = time.perf_counter()
        lp, _ = completion_logprobs(model, pid, pm, cid, cm, 1.0, with_entropy=True, chunk=chunk)
        lp.sum().backward()
        times.append(time.perf_counter() - t)
        peak = _status("VmHWM") - before   # the last pass: steady state (the first one also allocates once)
    return {"step_peak_mb": round(peak, 1), "seconds": round(min(times), 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--completion", type=int, default=128)
    ap.add_argument("--mode", choices=list(MODES))
    a = ap.parse_args()
    if a.mode:   # a child: one mode, its result on stdout
        print(json.dumps(one(a.mode, a.vocab, a.rows, a.completion)))
        return
    res = {}
    for mode in MODES:
        args = [sys.executable, __file__, "--mode", mode, "--vocab", str(a.vocab), "--rows", str(a.rows),
                "--completion", str(a.completion)]
        # memory: glibc's malloc maps blocks of 64 KiB or more on their own and unmaps them when freed (a
        # fixed threshold, not the adaptive one), so resident memory follows the live tensors and VmHWM
        # is their peak. Time: a second run with the default allocator (mapping per block is slower).
        mem = subprocess.run(args, capture_output=True, text=True, check=True,
                             env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})
        fast = subprocess.run(args, capture_output=True, text=True, check=True)
        res[mode] = {"step_peak_mb": json.loads(mem.stdout.strip().splitlines()[-1])["step_peak_mb"],
                     "seconds": json.loads(fast.stdout.strip().splitlines()[-1])["seconds"]}
    for r in res.values():
        r["peak_vs_full"] = round(r["step_peak_mb"] / res["full"]["step_peak_mb"], 3)
    print(json.dumps({"bench": "logprob_memory", "vocab": a.vocab, "rows": a.rows, "completion": a.completion,
                      "modes": res}))


if __name__ == "__main__":
    main()
