"""train.threads=0 on a shared machine: OpenMP's idle threads sleep after a short spin instead of spinning for
milliseconds (grpolab/determinism.py: OMP_WAIT_POLICY=PASSIVE, GOMP_SPINCOUNT=3000, or 0 when other processes keep
the machine busy at import), and how they wait changes no bits.
bench/threads.py measures the speed."""

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT

# every subprocess starts without the user's OpenMP/MKL settings, as a plain shell would
CLEAN = ("OMP_", "GOMP_", "KMP_", "MKL_")


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(CLEAN)}
    env.update(extra)
    return env


def test_importing_grpolab_sets_the_wait_policy_before_torch_loads():
    """The OpenMP runtime reads OMP_WAIT_POLICY and GOMP_SPINCOUNT once, when torch loads it: importing grpolab
    must set them without importing torch; a wait setting the user exported wins, and then grpolab sets none
    (its spin count would override the user's policy)."""
    probe = ("import os, sys, grpolab; e = os.environ.get; print(e('OMP_WAIT_POLICY'), e('GOMP_SPINCOUNT'), "
             "e('KMP_BLOCKTIME'), 'torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", probe], env=_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = r.stdout.split()
    assert out[0] == "PASSIVE" and out[1] in ("3000", "0") and out[2:] == ["0", "False"], out   # (0: a busy machine)
    r = subprocess.run([sys.executable, "-c", probe], env=_env(OMP_WAIT_POLICY="ACTIVE"), capture_output=True,
                       text=True, timeout=60)
    assert r.stdout.split() == ["ACTIVE", "None", "None", "False"], r.stderr


def test_beside_busy_processes_idle_threads_do_not_spin():
    """Importing grpolab samples the machine for 30 ms: beside two busy-loop processes (one per core here) it
    counts them and sets no spin (GOMP_SPINCOUNT=0); the rule: half a core or more kept busy by others."""
    from grpolab.determinism import BUSY_CORES, openmp_env
    assert openmp_env(None)["GOMP_SPINCOUNT"] == openmp_env(BUSY_CORES - 0.01)["GOMP_SPINCOUNT"] == "3000"
    assert openmp_env(BUSY_CORES)["GOMP_SPINCOUNT"] == "0" and openmp_env(BUSY_CORES)["OMP_WAIT_POLICY"] == "PASSIVE"
    probe = ("import os, grpolab, grpolab.determinism as d; "
             "print(os.environ['GOMP_SPINCOUNT'], d.busy_cores(0.2))")
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(min(2, os.cpu_count() or 1))]
    try:
        r = subprocess.run([sys.executable, "-c", probe], env=_env(), capture_output=True, text=True, timeout=60)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    assert r.returncode == 0, r.stderr
    spin, busy = r.stdout.split()
    assert float(busy) >= 0.8 * len(hogs) and spin == "0", r.stdout


# CPU time the OpenMP worker threads burn while the main thread sleeps between small parallel regions
# (an add of 2^18 floats is split over 2 threads): a spinning worker burns it, a sleeping one does not.
SPIN_PROBE = """
import sys, time
if sys.argv[1] == "torch-first":   # the runtime starts before grpolab sets its variables (the old order)
    import torch, grpolab
else:                              # what `grpolab` and `python -m grpolab` do
    import grpolab, torch
torch.set_num_threads(2)
x = torch.ones(1 << 18)
for _ in range(10):
    x.add_(1)
cpu0, main0 = time.process_time(), time.thread_time()
for _ in range(50):
    x.add_(1)
    time.sleep(0.002)
print((time.process_time() - cpu0) - (time.thread_time() - main0))
"""


def _workers_cpu(order: str) -> float:
    r = subprocess.run([sys.executable, "-c", SPIN_PROBE, order], env=_env(), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    return float(r.stdout)


@pytest.mark.slow
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="OpenMP needs 2 cores to run a region on 2 threads")
def test_idle_openmp_workers_sleep_instead_of_spinning():
    """The runtime really runs with grpolab's settings: between regions the worker thread spins briefly (3000
    spins), then sleeps, burning (almost) no CPU. The old start-up order is the control: its worker spins
    through every sleep."""
    spinning = _workers_cpu("torch-first")
    passive = _workers_cpu("grpolab-first")
    # 50 sleeps of 2 ms: a spinning worker burns up to ~0.1 s (less when the machine is busy); the
    # work itself is 60 adds of half of 1 MiB, well under 10 ms
    assert spinning > 0.02, f"the control did not spin ({spinning:.4f} s): the probe measures nothing here"
    assert passive < 0.01 and passive < spinning / 4, (passive, spinning)


TINY_SFT = ["sft", "sft.steps=3", "model.n_layer=1", "model.n_embd=64", "model.n_head=2", "sft.batch_size=8",
            "data.train_size=50", "data.test_size=4", "eval.num_problems=2", "eval.k=2", "log.level=quiet",
            "train.threads=0"]
OLD_ORDER = "import sys, runpy, torch; sys.argv[0] = 'grpolab'; runpy.run_module('grpolab', run_name='__main__')"


def _losses(out) -> list[tuple[str, str]]:
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    return [(float(r["loss"]).hex(), float(r["grad_norm"]).hex()) for r in rows]


@pytest.mark.slow
def test_the_wait_policy_changes_no_bits(tmp_path):
    """`grpolab sft` at train.threads=0 computes the same losses and gradient norms, bit for bit, with
    the passive policy (now) and with OpenMP's spinning default (torch imported first: before)."""
    now = subprocess.Popen([sys.executable, "-m", "grpolab", *TINY_SFT, f"train.output_dir={tmp_path / 'now'}"],
                           cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    before = subprocess.Popen([sys.executable, "-c", OLD_ORDER, *TINY_SFT, f"train.output_dir={tmp_path / 'old'}"],
                              cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    for p in (now, before):
        assert p.wait(timeout=300) == 0, p.stderr.read()
        p.stderr.close()
    got, ref = _losses(tmp_path / "now"), _losses(tmp_path / "old")
    assert len(got) == 3 and got == ref
