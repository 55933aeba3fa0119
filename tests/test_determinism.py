"""Same config and seed give the same bits on an idle or a busy machine (grpolab/determinism.py)."""

import hashlib
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from conftest import ROOT

# Big enough that MKL splits products across threads (width 128, batches of 32 x ~100 tokens),
# small enough for a test: a short warm start, two GRPO steps with a reference and two passes.
RUN = ["model.n_layer=2", "model.n_embd=128", "sft.steps=20", "sft.batch_size=32", "sft.bare_steps=10",
       "data.train_size=400", "data.test_size=8", "rollout.prompts_per_step=4", "rollout.num_generations=4",
       "rollout.max_new_tokens=16", "reward.functions=[gsm8k_accuracy,length]", "algorithm.beta=0.04",
       "algorithm.num_iterations=2", "train.max_steps=2",
       "eval.num_problems=8", "eval.k=2", "log.level=quiet"]


def _start(out):
    return subprocess.Popen([sys.executable, "-m", "grpolab.cli", "train", *RUN, f"train.output_dir={out}"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(out):
    metrics = [{k: v for k, v in json.loads(line).items() if not k.startswith(("time/", "perf/"))}
               for line in open(out / "metrics.jsonl")]
    weights = hashlib.sha256((out / "checkpoints" / "step_2" / "model.safetensors").read_bytes()).hexdigest()
    return metrics, weights, json.loads((out / "eval.json").read_text())


@pytest.mark.slow
def test_same_run_alone_and_two_at_once_is_bit_identical(tmp_path):
    alone = _start(tmp_path / "alone")
    assert alone.wait(timeout=600) == 0, alone.stderr.read()
    # two at once on this machine: each gets about half the cores it asked for
    busy = [_start(tmp_path / "busy1"), _start(tmp_path / "busy2")]
    for p in busy:
        assert p.wait(timeout=600) == 0, p.stderr.read()
    ref = _result(tmp_path / "alone")
    assert len(ref[0]) == 2 and ref[0][1]["kl"] > 0   # the policy moved off the reference
    for name in ("busy1", "busy2"):
        got = _result(tmp_path / name)
        assert got[0] == ref[0], name
        assert got[1] == ref[1], name   # final weights, byte for byte
        assert got[2] == ref[2], name


PROBE = """
import torch, grpolab
from grpolab.determinism import pin_cpu_numerics
n = pin_cpu_numerics({threads})
print('THREADS', n, torch.get_num_threads())
a = torch.randn(256, 512)
(a @ a.T).sum()
"""


@pytest.mark.slow
@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="this torch build does not use MKL")
@pytest.mark.parametrize("threads", [0, 1])
def test_mkl_runs_reproducibly_with_fixed_threads(threads):
    """Every MKL call after pin_cpu_numerics: CNR on (CBWR), dynamic threading off, the pinned thread count."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MKL_", "OMP_"))}
    env["MKL_VERBOSE"] = "1"
    r = subprocess.run([sys.executable, "-c", PROBE.format(threads=threads)], capture_output=True, text=True,
                       env=env, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    calls = [ln for ln in r.stdout.splitlines() if "GEMM(" in ln]
    assert calls, r.stdout[-2000:]
    n, in_use = map(int, re.search(r"THREADS (\d+) (\d+)", r.stdout).groups())
    assert n == in_use and (n == threads if threads else n >= 1)
    want = n
    for ln in calls:
        assert re.search(r"CNR:AUTO\b", ln) and re.search(r"Dyn:0\b", ln), ln
        assert re.search(rf"NThr:{want}\b", ln), ln


@pytest.mark.slow
@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="this torch build does not use MKL")
def test_the_train_command_pins_mkl(tmp_path):
    """The product, not only the helper: every matrix product of `grpolab train` (warm start, rollout,
    update, eval) runs with CNR on, dynamic threading off and one fixed thread count."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MKL_", "OMP_"))}
    env["MKL_VERBOSE"] = "1"
    r = subprocess.run([sys.executable, "-m", "grpolab.cli", "train", "model.n_layer=1", "model.n_embd=32",
                        "model.n_head=2", "sft.steps=2", "sft.batch_size=4", "data.train_size=50", "data.test_size=4",
                        "rollout.prompts_per_step=2", "rollout.num_generations=2", "rollout.max_new_tokens=4",
                        "train.max_steps=1", "eval.num_problems=2", "eval.k=2", "log.level=quiet",
                        f"train.output_dir={tmp_path}"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    calls = [ln for ln in r.stdout.splitlines() if "GEMM(" in ln]
    assert len(calls) > 100, r.stdout[-2000:]
    assert all("CNR:AUTO" in ln and "Dyn:0" in ln for ln in calls), next(
        ln for ln in calls if "CNR:AUTO" not in ln or "Dyn:0" not in ln)
    assert len({re.search(r"NThr:(\d+)", ln).group(1) for ln in calls}) == 1
