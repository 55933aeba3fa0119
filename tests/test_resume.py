"""Stop and resume exactly: a run killed with SIGKILL and resumed writes the same metrics."""

import json
import signal
import subprocess
import sys
import time

from conftest import ROOT, run_cli
from test_grpo import TINY

# A slow reward (0.3 s per step) so the test can kill the run between steps reliably.
SLOW_REWARD = """
import time
def slow_len(prompts, completions, **_):
    time.sleep(0.3)
    return [float(len(c) % 7) for c in completions]
"""


def _strip(path):
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(("time/", "perf/"))}
            for line in open(path)]


def _args(tmp_path, out):
    fn = tmp_path / "slow.py"
    fn.write_text(SLOW_REWARD)
    return ["train", *TINY, f"reward.functions=[{fn}:slow_len]", "algorithm.beta=0.04", "train.max_steps=6",
            "train.save_every=1", "train.keep_checkpoints=2", f"train.output_dir={out}"]


def test_sigkill_then_resume_gives_identical_metrics(tmp_path):
    straight = tmp_path / "straight"
    r = run_cli(*_args(tmp_path, straight))
    assert r.returncode == 0, r.stderr

    resumed = tmp_path / "resumed"
    proc = subprocess.Popen([sys.executable, "-m", "grpolab.cli", *_args(tmp_path, resumed)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = resumed / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = len(metrics.read_text().splitlines())
    assert 3 <= done < 6, done   # killed part-way

    r = run_cli(*_args(tmp_path, resumed), "train.resume=auto")
    assert r.returncode == 0, r.stderr
    assert "resuming from" in r.stdout + r.stderr
    assert _strip(metrics) == _strip(straight / "metrics.jsonl")
    # keep_checkpoints=2: only the newest two remain
    assert sorted(p.name for p in (resumed / "checkpoints").iterdir()) == ["step_5", "step_6"]


def test_sigint_saves_a_checkpoint_and_exits(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "grpolab.cli", *_args(tmp_path, out),
                             "train.save_every=0"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and not (metrics.exists() and metrics.read_text().strip()):
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "checkpoint saved, continue with train.resume=auto" in err
    assert "Traceback" not in err
    steps = [p.name for p in (out / "checkpoints").iterdir()]
    assert len(steps) == 1 and steps[0] == f"step_{len(metrics.read_text().splitlines())}"


def test_sigkill_during_a_checkpoint_write_keeps_the_previous_one(tmp_path):
    """A wide model makes each checkpoint write take a while; kill as soon as one is being written."""
    from grpolab.train.checkpoint import list_checkpoints, load_model
    out = tmp_path / "run"
    big = ["model.n_layer=2", "model.n_embd=640", "model.n_head=4"]
    proc = subprocess.Popen([sys.executable, "-m", "grpolab.cli", *_args(tmp_path, out), *big], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ckpts = out / "checkpoints"
    deadline = time.time() + 300
    killed_in_write = False
    while time.time() < deadline and proc.poll() is None:
        if ckpts.is_dir() and any(p.name.startswith(".tmp_step_") and p.name != ".tmp_step_1"
                                  for p in ckpts.iterdir()):
            proc.send_signal(signal.SIGKILL)
            killed_in_write = True
            break
        time.sleep(0.002)
    proc.wait()
    assert killed_in_write
    complete = list_checkpoints(ckpts)
    assert complete, "the checkpoint before the interrupted write must remain"
    load_model(complete[-1])   # loads cleanly
    r = run_cli(*_args(tmp_path, out), *big, "train.resume=auto")
    assert r.returncode == 0, r.stderr
    assert [json.loads(line)["step"] for line in open(out / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    assert not any(p.name.startswith(".tmp_") for p in ckpts.iterdir())
