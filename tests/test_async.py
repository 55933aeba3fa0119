"""Asynchronous RL (train.async_steps, rollout worker processes): the logical clock, bit-identical runs,
exact resume after a SIGKILL of either side, k=0 equal to the synchronous loop, the sampler's log-probs
coming from the weight version that sampled the batch, and the refusals."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import ROOT, run_cli, wait_for_rows
from test_grpo import TINY, make_trainer

from grpolab.algorithms.rollout_correction import rollout_correction
from grpolab.config.load import load_config
from grpolab.jobs.common import setup_torch
from grpolab.jobs.train import build_trainer
from grpolab.models.logprobs import completion_logprobs
from grpolab.monitor.console import Console
from grpolab.rollout.worker_pool import weight_version
from grpolab.rollout.worker_process import share, share_of_call
from grpolab.train.grpo import GRPOTrainer
from grpolab.train.run import Run

SLOW_REWARD = """
import time
def slow_len(prompts, completions, **_):
    time.sleep({pause})
    return [float(len(c) % 7) for c in completions]
"""


def _args(tmp_path, out, *extra, steps=8, pause=0.0):
    fn = tmp_path / "slow.py"
    fn.write_text(SLOW_REWARD.format(pause=pause))
    return ["train", *TINY, f"reward.functions=[{fn}:slow_len]", "algorithm.beta=0.04", f"train.max_steps={steps}",
            "train.threads=1", "train.worker_threads=1", "train.save_every=2", "algorithm.rollout_correction=tis",
            f"train.output_dir={out}", *extra]


def _rows(run, drop=("time/", "perf/", "async/")):
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(drop)}
            for line in open(run / "metrics.jsonl")]


def _same_run(a, b, drop=("time/", "perf/")):
    assert _rows(a, drop) == _rows(b, drop)
    assert (a / "eval.json").read_text() == (b / "eval.json").read_text()
    last = sorted((a / "checkpoints").iterdir())[-1].name
    assert (a / "checkpoints" / last / "model.safetensors").read_bytes() == \
        (b / "checkpoints" / last / "model.safetensors").read_bytes()


def _same_to_rounding(a, b):
    """The same completions (rewards, lengths exact); what log-probs feed equal to float rounding."""
    for x, y in zip(_rows(a), _rows(b), strict=True):
        assert x.keys() == y.keys()
        for key in x:
            exact = key.startswith(("reward", "completions/", "frac_")) or key in ("step", "lr")
            assert x[key] == (y[key] if exact else pytest.approx(y[key], rel=1e-4, abs=1e-6)), key


def _workers(parent: int) -> list[int]:
    """The rollout worker processes `parent` started (not another run's)."""
    out = subprocess.run(["pgrep", "-P", str(parent), "-f", "grpolab.rollout.worker_process"], capture_output=True,
                         text=True).stdout
    return [int(p) for p in out.split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] if os.path.exists(f"/proc/{pid}") else "X"
    return state != "Z"   # a zombie has exited: only its parent has not collected it yet


def test_the_logical_clock():
    # batch t (the batch step t trains on) is sampled with the policy after step t-k-1; the first k+1 with
    # the initial policy, version 0
    assert [weight_version(t, 0) for t in range(1, 6)] == [0, 1, 2, 3, 4]
    assert [weight_version(t, 1) for t in range(1, 6)] == [0, 0, 1, 2, 3]
    assert [weight_version(t, 2) for t in range(1, 7)] == [0, 0, 0, 1, 2, 3]


def test_a_batch_is_split_over_workers_whole_and_in_order():
    for n in (1, 2, 5, 7):
        for workers in (1, 2, 3):
            parts = [share(n, w, workers) for w in range(workers)]
            assert [i for lo, hi in parts for i in range(lo, hi)] == list(range(n))
            assert max(hi - lo for lo, hi in parts) - min(hi - lo for lo, hi in parts) <= 1
    call = {"prompts": [[1], [2], [3]], "num_generations": 2, "keys": torch.arange(6)}
    second = share_of_call(call, 1, 2)   # worker 1 of 2: prompts 2 and 3 of 3, and their keys
    assert second["prompts"] == [[2], [3]] and second["keys"].tolist() == [2, 3, 4, 5]
    assert share_of_call({"prompts": [[1]]}, 0, 2) is None   # one prompt, two workers: the first gets none


def test_ratio_statistics_are_the_plain_mean_and_max():
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.1, 0.0]])
    sampler = torch.tensor([[-1.2, -1.5, -0.5], [-0.3, -0.4, 0.0]])
    mask = torch.tensor([[True, True, False], [True, True, False]])
    _, _, m = rollout_correction(old, sampler, mask)
    rhos = [torch.exp(torch.tensor(a - b, dtype=torch.float64)).item()
            for a, b in ((-1.0, -1.2), (-2.0, -1.5), (-0.3, -0.3), (-0.1, -0.4))]
    assert m["rollout/ratio_sum"] == pytest.approx(sum(rhos))
    assert m["rollout/ratio_max"] == pytest.approx(max(rhos), rel=1e-6)


@pytest.mark.slow
def test_k0_with_a_worker_equals_the_synchronous_loop(tmp_path):
    sync, one, two = tmp_path / "sync", tmp_path / "one", tmp_path / "two"
    assert run_cli(*_args(tmp_path, sync)).returncode == 0
    r = run_cli(*_args(tmp_path, one), "--rollout-workers", "1")
    assert r.returncode == 0, r.stderr
    _same_run(sync, one, drop=("time/", "perf/", "async/"))
    assert all(json.loads(x)["async/staleness"] == 0 for x in open(one / "metrics.jsonl"))
    # two workers, each sampling half of every batch's prompts: the same completions; their log-probs
    # (computed in smaller batches) equal to float rounding only, so the run is the same up to rounding
    r = run_cli(*_args(tmp_path, two), "--rollout-workers", "2")
    assert r.returncode == 0, r.stderr
    _same_to_rounding(sync, two)


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 2])
def test_async_runs_are_bit_identical_and_keep_their_clock(tmp_path, k):
    a, b = tmp_path / "a", tmp_path / "b"
    for run in (a, b):
        r = run_cli(*_args(tmp_path, run, f"train.async_steps={k}", "train.eval_every=4"))
        assert r.returncode == 0, r.stderr
    _same_run(a, b)
    rows = [json.loads(x) for x in open(a / "metrics.jsonl")]
    assert [x["async/weight_version"] for x in rows] == [max(0, s - k - 1) for s in range(1, 9)]
    assert [x["async/staleness"] for x in rows] == [min(s - 1, k) for s in range(1, 9)]
    assert "eval/greedy_accuracy" in rows[3]
    # a stale sampler is visible: its log-probs differ from the trainer's once the policy has moved
    assert rows[0]["rollout/logprob_abs_diff"] < 1e-5 < rows[-1]["rollout/logprob_abs_diff"]
    # and k changes the run (the sync run trains every batch on the policy that sampled it)
    sync = tmp_path / "sync"
    assert run_cli(*_args(tmp_path, sync, "train.eval_every=4")).returncode == 0
    assert _rows(sync)[k + 1]["loss"] != _rows(a)[k + 1]["loss"]


def _kill_midway(tmp_path, out, which, workers=1):
    proc = subprocess.Popen([sys.executable, "-m", "grpolab.cli", *_args(tmp_path, out, "train.async_steps=2",
                                                                         f"train.rollout_workers={workers}",
                                                                         pause=0.15)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_for_rows(out / "metrics.jsonl", 3, proc)
    workers = _workers(proc.pid)
    assert workers, "no rollout worker is running"
    killed = time.time()
    os.kill(workers[0] if which == "worker" else proc.pid, signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    return proc.returncode, err, time.time() - killed, workers


@pytest.mark.slow
@pytest.mark.parametrize("which", ["worker", "trainer"])
def test_sigkill_then_resume_equals_the_uninterrupted_run(tmp_path, which):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    r = run_cli(*_args(tmp_path, straight, "train.async_steps=2"))
    assert r.returncode == 0, r.stderr

    code, err, took, workers = _kill_midway(tmp_path, resumed, which)
    assert 3 <= len((resumed / "metrics.jsonl").read_text().splitlines()) < 8   # killed part-way
    if which == "worker":   # the trainer ends the job with one line, within seconds, exit 2
        assert code == 2 and took < 10, (code, took, err)
        assert err.strip().splitlines()[-1] == ("grpolab: training error: rollout worker 1 was killed by signal 9; "
                                                "the run stopped (the last checkpoint is kept: train.resume=auto "
                                                "continues it)"), err
        assert "Traceback" not in err
    else:   # the worker does not outlive its trainer
        deadline = time.time() + 5
        while time.time() < deadline and any(_alive(p) for p in workers):
            time.sleep(0.05)
        assert not any(_alive(p) for p in workers)

    r = run_cli(*_args(tmp_path, resumed, "train.async_steps=2"), "train.resume=auto")
    assert r.returncode == 0, r.stderr
    assert "resuming from" in r.stdout + r.stderr
    _same_run(straight, resumed)


@pytest.mark.slow
def test_one_dead_worker_of_two_ends_the_run_at_once(tmp_path):
    code, err, took, workers = _kill_midway(tmp_path, tmp_path / "run", "worker", workers=2)
    assert code == 2 and took < 10, (code, took, err)
    assert err.strip().splitlines()[-1].startswith("grpolab: training error: rollout worker "), err
    assert "was killed by signal 9" in err and "Traceback" not in err
    assert len(workers) == 2 and not any(_alive(p) for p in workers)   # the other one was stopped too


@pytest.mark.slow
def test_sampler_logprobs_are_those_of_the_version_that_sampled(tmp_path):
    fn = tmp_path / "slow.py"
    fn.write_text(SLOW_REWARD.format(pause=0.0))
    trainer = make_trainer(tmp_path, "train.async_steps=1", "train.max_steps=4", "train.worker_threads=1",
                           "algorithm.beta=0.0", "optim.lr=0.01", f"reward.functions=[{fn}:slow_len]")
    try:
        versions = [{k: v.clone() for k, v in trainer.model.state_dict().items()}]
        seen = []
        for _ in range(4):
            trainer.train_step()
            versions.append({k: v.clone() for k, v in trainer.model.state_dict().items()})
            seen.append(trainer.last_batch)
    finally:
        trainer.close()
    model = trainer.model
    for step, batch in enumerate(seen, 1):
        assert batch.weight_version == max(0, step - 2)
        g = batch.gen

        def logprobs(state):
            model.load_state_dict(state)
            with torch.no_grad():
                return completion_logprobs(model, g.prompt_ids, g.prompt_mask, g.completion_ids, g.completion_mask,
                                           1.0)

        m = g.completion_mask
        gap_sampler = (logprobs(versions[batch.weight_version]) - g.sampler_logprobs)[m].abs().max()
        gap_current = (logprobs(versions[step - 1]) - g.sampler_logprobs)[m].abs().max()
        assert gap_sampler < 1e-4, (step, gap_sampler)
        if batch.weight_version != step - 1:   # the policy moved since: the current weights did not sample it
            assert gap_current > 100 * max(float(gap_sampler), 1e-6), (step, gap_current)


@pytest.mark.slow
def test_what_rollout_workers_do_not_run_is_one_line(tmp_path):
    r = run_cli(*_args(tmp_path, tmp_path / "a", "train.async_steps=1", "algorithm.dynamic_sampling=true"))
    assert r.returncode == 2 and r.stderr.strip().startswith("grpolab: config error: algorithm.dynamic_sampling:")
    assert "Traceback" not in r.stderr
    r = run_cli(*_args(tmp_path, tmp_path / "b", "train.async_steps=-1"))
    assert r.returncode == 2 and "train.async_steps: must be >= 0" in r.stderr
    r = run_cli(*_args(tmp_path, tmp_path / "c"), "--rollout-workers", "-1")
    assert r.returncode == 2 and "--rollout-workers: must be >= 0" in r.stderr, r.stderr


@pytest.mark.slow
def test_resume_with_another_k_is_refused(tmp_path):
    out = tmp_path / "run"
    assert run_cli(*_args(tmp_path, out, "train.async_steps=1", steps=2)).returncode == 0
    r = run_cli(*_args(tmp_path, out, "train.async_steps=2", steps=4), "train.resume=auto")
    assert r.returncode == 2 and "train.async_steps" in r.stderr.strip().splitlines()[-1], r.stderr


@pytest.mark.slow
def test_two_trainer_ranks_beside_a_worker_repeat_exactly(tmp_path):
    # rank 0 talks to the worker for the whole batch and hands rank 1 its share; both keep the clock
    a, b = tmp_path / "a", tmp_path / "b"
    for run in (a, b):
        r = run_cli(*_args(tmp_path, run, "train.async_steps=1", steps=4), "--nproc", "2", "--rollout-workers", "1")
        assert r.returncode == 0, r.stderr
    _same_run(a, b)
    assert [json.loads(x)["async/weight_version"] for x in open(a / "metrics.jsonl")] == [0, 0, 1, 2]
    # the same batches as one trainer process beside the worker: the run equal to float rounding
    one = tmp_path / "one"
    assert run_cli(*_args(tmp_path, one, "train.async_steps=1", steps=4), "--rollout-workers", "1").returncode == 0
    _same_to_rounding(a, one)


@pytest.mark.slow
def test_ctrl_c_saves_the_batches_in_flight_and_the_resume_is_exact(tmp_path):
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    assert run_cli(*_args(tmp_path, straight, "train.async_steps=2")).returncode == 0
    # its own session: Ctrl-C in a terminal reaches the trainer and its workers
    proc = subprocess.Popen([sys.executable, "-m", "grpolab.cli", *_args(tmp_path, stopped, "train.async_steps=2",
                                                                         pause=0.15)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    metrics = stopped / "metrics.jsonl"
    wait_for_rows(metrics, 3)
    workers = _workers(proc.pid)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, (proc.returncode, err)
    assert "Traceback" not in err and "checkpoint saved" in err, err
    done = len(metrics.read_text().splitlines())
    assert done < 8
    ckpt = stopped / "checkpoints" / f"step_{done}"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert sorted(state["async"]["in_flight"]) == [str(done + 1), str(done + 2)]   # k batches ahead, saved whole
    assert (ckpt / "in_flight.pt").exists()
    assert not any(_alive(p) for p in workers)   # the workers were stopped with the trainer
    r = run_cli(*_args(tmp_path, stopped, "train.async_steps=2"), "train.resume=auto")
    assert r.returncode == 0, r.stderr
    _same_run(straight, stopped)


@pytest.mark.parametrize("correction, warned", [("none", True), ("tis", False)])
def test_async_without_a_rollout_correction_is_warned_about(tmp_path, capsys, correction, warned):
    """Batches sampled by an older policy are trained on as if on-policy unless a correction is asked for:
    the trainer says so once, at its start (no worker starts before the first step)."""
    cfg = load_config(None, TINY + ["sft.steps=0", "train.async_steps=1", f"algorithm.rollout_correction={correction}",
                                    f"train.output_dir={tmp_path}"])
    setup_torch(cfg)
    tr = build_trainer(cfg, Run(cfg, GRPOTrainer.job), Console())
    tr.close()
    said = ("warning: train.async_steps=1 with algorithm.rollout_correction=none: batches sampled by a policy up to 1 "
            "steps old are trained on as if on-policy")
    err = capsys.readouterr().err
    assert (said in err) == warned, err
