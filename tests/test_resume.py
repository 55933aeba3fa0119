"""Stop and resume exactly: a run killed (SIGKILL) or resumed from an earlier checkpoint writes the same
metrics.jsonl, samples.jsonl, TensorBoard scalars and wandb history as one that never stopped."""

import json
import re
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT, run_cli, wait_for_rows
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


@pytest.mark.slow
def test_sigkill_then_resume_gives_identical_metrics(tmp_path):
    straight = tmp_path / "straight"
    r = run_cli(*_args(tmp_path, straight))
    assert r.returncode == 0, r.stderr

    resumed = tmp_path / "resumed"
    proc = subprocess.Popen([sys.executable, "-m", "grpolab.cli", *_args(tmp_path, resumed)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = resumed / "metrics.jsonl"
    wait_for_rows(metrics, 3, proc)
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


@pytest.mark.slow
def test_sigint_saves_a_checkpoint_and_exits(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "grpolab.cli", *_args(tmp_path, out),
                             "train.save_every=0"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    metrics = out / "metrics.jsonl"
    wait_for_rows(metrics, 1)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "checkpoint saved, continue with train.resume=auto" in err
    assert "Traceback" not in err
    steps = [p.name for p in (out / "checkpoints").iterdir()]
    assert len(steps) == 1 and steps[0] == f"step_{len(metrics.read_text().splitlines())}"


@pytest.mark.slow
def test_sigkill_during_a_checkpoint_write_keeps_the_previous_one(tmp_path):
    """A wide model makes each checkpoint write take a while; kill as soon as one is being written."""
    from grpolab.models.checkpoint import list_checkpoints, load_model
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


# ---------------------------------------------------------------- in-process: resume from an earlier checkpoint
# A finished run's directory is what a run killed after its last step leaves; resuming it from an
# earlier checkpoint (explicit train.resume=PATH) must cut every record back to that step and
# write the same files again.

PARITY_REWARD = """
import re
def parity_len(prompts, completions, **_):
    return [0.0 if int(re.search(r"\\d+", p).group()) % 2 == 0 else float(len(c))
            for p, c in zip(prompts, completions)]
"""


def _train(out, args):
    from grpolab.config.load import load_config
    from grpolab.jobs.common import setup_torch
    from grpolab.jobs.train import build_trainer
    from grpolab.monitor.console import Console
    from grpolab.train.run import Run
    cfg = load_config(None, TINY + [f"train.output_dir={out}", *args])
    setup_torch(cfg)
    trainer = build_trainer(cfg, Run(cfg, "grpo"), Console(quiet=True))
    trainer.train()
    return trainer


def _straight_then_resumed(tmp_path, args, resume_step=2):
    import shutil
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    started = time.time()
    _train(straight, args)
    shutil.copytree(straight, resumed)
    # TensorBoard event files and wandb offline runs are named by the second they were created in;
    # the resumed writers must not share the interrupted ones' second (outside a test they never do)
    if int(time.time()) == int(started):
        time.sleep(1.01 - time.time() % 1.0)
    ckpt = resumed / "checkpoints" / f"step_{resume_step}"
    trainer = _train(resumed, [*args, f"train.resume={ckpt}"])
    return straight, resumed, trainer


BASE = ["train.max_steps=4", "train.save_every=2", "train.keep_checkpoints=0", "log.samples_every=1",
        "log.samples_per_step=3", "reward.functions=[length]"]
CASES = {
    "beta": ["algorithm.beta=0.04", "log.tensorboard=true"],
    "num_iterations": ["algorithm.num_iterations=2", "algorithm.beta=0.04"],
    "dynamic_sampling": ["algorithm.dynamic_sampling=true", "algorithm.max_sampling_rounds=3"],
    # calculator calls inside the rollouts (warm start on worked steps that all call it)
    "tools": ["rollout.tools=[calculator]", "sft.tool_fraction=1.0", "sft.steps=40", "rollout.max_new_tokens=40",
              "rollout.max_completion_tokens=48"],
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_resume_from_an_explicit_path_rewrites_the_same_records(tmp_path, case):
    args = BASE + CASES[case]
    if case == "dynamic_sampling":
        fn = tmp_path / "parity.py"
        fn.write_text(PARITY_REWARD)
        args = [a for a in args if not a.startswith("reward.")] + [f"reward.functions=[{fn}:parity_len]"]
    straight, resumed, trainer = _straight_then_resumed(tmp_path, args)
    assert trainer.step == 4
    a, b = _strip(straight / "metrics.jsonl"), _strip(resumed / "metrics.jsonl")
    assert [m["step"] for m in b] == [1, 2, 3, 4]
    assert a == b
    if case == "dynamic_sampling":
        assert any(m["dynamic_sampling/rounds"] > 1 for m in a)   # the data position moved unevenly
    if case == "tools":   # calls happened, and the records show them
        assert all(m["tools/calls_per_completion"] > 0 for m in a), a
        recs = [json.loads(ln) for ln in (resumed / "samples.jsonl").read_text().splitlines()]
        assert any(r["tool_calls"] and "<|out|>" in r["completion"] for r in recs)
    samples = (resumed / "samples.jsonl").read_text()
    assert [json.loads(ln)["step"] for ln in samples.splitlines()] == [1] * 3 + [2] * 3 + [3] * 3 + [4] * 3
    assert samples == (straight / "samples.jsonl").read_text()
    assert sorted(p.name for p in (resumed / "checkpoints").iterdir()) == ["step_2", "step_4"]
    if "log.tensorboard=true" in args:
        _check_tensorboard(straight, resumed)


def _scalars(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _check_tensorboard(straight, resumed):
    assert len(list((resumed / "tensorboard").glob("events.out.tfevents.*"))) == 2   # interrupted + resumed
    want, got = _scalars(straight), _scalars(resumed)
    assert set(got) == set(want) and "reward" in got
    for tag, points in want.items():
        if tag.startswith(("time/", "perf/")):
            assert [s for s, _ in got[tag]] == [1, 2, 3, 4], tag
        else:
            assert got[tag] == points, tag   # each step once, the uninterrupted run's values


@pytest.mark.slow
def test_wandb_offline_run_continues_under_the_same_id(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    args = BASE + ["log.wandb_project=grpolab-test"]
    straight, resumed, _ = _straight_then_resumed(tmp_path, args)
    runs = sorted((resumed / "wandb").glob("offline-run-*"))
    assert len(runs) == 2   # the interrupted run's directory (copied) and the resumed one
    # offline-run-<date>_<time>-<id>; wandb adds '-N' to a name already taken (two starts in one second)
    ids = {re.match(r"offline-run-\d{8}_\d{6}-([^-]+)", p.name).group(1) for p in runs}
    assert len(ids) == 1
    run_id = ids.pop()
    state = json.loads((resumed / "checkpoints" / "step_4" / "trainer_state.json").read_text())
    assert state["wandb_run_id"] == run_id
    # wandb's service process writes the file; on a loaded machine it may still be flushing after finish()
    deadline = time.time() + 30
    while not (history := _wandb_history(runs[1] / f"run-{run_id}.wandb")) and time.time() < deadline:
        time.sleep(0.5)
    assert sorted(history) == [3, 4]   # the resumed run logged the steps after the checkpoint
    metrics = {m["step"]: m for m in _strip(straight / "metrics.jsonl")}
    for step, logged in history.items():
        assert logged["reward"] == pytest.approx(metrics[step]["reward"], abs=1e-12)
        assert logged["loss"] == pytest.approx(metrics[step]["loss"], abs=1e-12)


def _wandb_history(path):
    """{step: {key: value}} from an offline run's .wandb file (LevelDB log format of Record protos)."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, buf, out = 7, 32768, b"", {}
    while pos + 7 <= len(data):
        room = block - pos % block
        if room < 7:
            pos += room
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if n == 0 and kind == 0:
            break
        buf += data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):   # FULL or LAST
            rec = pb.Record()
            rec.ParseFromString(buf)
            buf = b""
            if rec.WhichOneof("record_type") == "history":
                items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
                out[rec.history.step.num] = items
    return out


def test_resuming_a_finished_run_keeps_its_final_eval_in_the_last_row(tmp_path):
    """train.resume=auto on a run that already reached train.max_steps trains nothing; its last metrics row keeps
    the final eval (report and trackers read it there) and eval.json says the same."""
    out = tmp_path / "run"
    args = ["train", *TINY, "train.max_steps=2", "train.threads=1", f"train.output_dir={out}"]
    assert run_cli(*args).returncode == 0
    rows, evals = _strip(out / "metrics.jsonl"), json.loads((out / "eval.json").read_text())
    assert any(k.startswith("eval/") for k in rows[-1])
    r = run_cli(*args, "train.resume=auto")
    assert r.returncode == 0, r.stderr
    assert _strip(out / "metrics.jsonl") == rows
    assert json.loads((out / "eval.json").read_text()) == evals
