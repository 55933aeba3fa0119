"""What a run shows and records: console levels, samples.jsonl, TensorBoard events, report.html."""

import json

import pytest
from conftest import run_cli
from test_grpo import TINY


@pytest.mark.slow
def test_verbose_run_records_samples_tensorboard_and_report(tmp_path):
    out = tmp_path / "run"
    r = run_cli("train", *TINY, "train.max_steps=3", f"train.output_dir={out}", "log.level=verbose",
                "log.samples_every=1", "log.samples_per_step=4", "log.tensorboard=true", "train.eval_every=2")
    assert r.returncode == 0, r.stderr
    assert "samples at step 3" in r.stdout and "step 3/3" in r.stdout and "ETA" in r.stdout
    # held-out accuracy next to the reward from the first eval on, and the reward-hacking watch's keys with it
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    acc = rows[1]["eval/greedy_accuracy"]
    for step in (2, 3):
        line = next(ln for ln in r.stdout.splitlines() if f" step {step}/3 |" in ln)
        assert f"| reward {rows[step - 1]['reward']:.3f} | eval acc {acc:.3f} |" in line, line
    assert [(m.get("watch/reward_hacking"), "watch/greedy_accuracy_stderr" in m) for m in rows] == \
        [(None, False), (0, True), (0, True)]   # two evals: too few for a verdict
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [1] * 4 + [2] * 4 + [3] * 4
    assert set(samples[0]) == {"step", "prompt", "completion", "reward", "rewards", "advantage"}
    assert set(samples[0]["rewards"]) == {"gsm8k_accuracy"}
    events = list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("reward")] == [1, 2, 3]
    html = (out / "report.html").read_text()
    assert html.count("<img") >= 6
    assert "<h2>Training reward and held-out accuracy</h2>" in html and 'class="warn"' not in html


@pytest.mark.slow
def test_quiet_level_prints_no_step_lines(tmp_path):
    r = run_cli("train", *TINY, "train.max_steps=2", f"train.output_dir={tmp_path}", "log.level=quiet")
    assert r.returncode == 0, r.stderr
    assert "step 1/2" not in r.stdout and "sft step" not in r.stdout
    assert "final eval" in r.stdout


@pytest.mark.slow
def test_report_command_on_a_run(tmp_path):
    out = tmp_path / "run"
    assert run_cli("train", *TINY, "train.max_steps=2", f"train.output_dir={out}").returncode == 0
    (out / "report.html").unlink()
    r = run_cli("report", str(out))
    assert r.returncode == 0, r.stderr
    assert (out / "report.html").is_file() and str(out / "report.html") in r.stdout
    r = run_cli("report", str(tmp_path / "nothing"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
