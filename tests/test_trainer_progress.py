"""What a run tells its user while it works (issue 34, run experience): progress lines with an ETA for
every job (the warm start included) and inside a long step, signals acknowledged at once, a second Ctrl-C
that stops at once (also inside a reward that never returns), the ETA after a resume, the final eval in
metrics.jsonl and TensorBoard, the first and last step's samples, and a dash where there is no value."""

import io
import json
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from conftest import ROOT, run_cli
from test_grpo import TINY, make_trainer

from grpolab.monitor.console import Console, StepProgress, eta_seconds
from grpolab.rollout.engine import generate

STEP_ROW = {"reward": 0.5, "completions/mean_length": 3.0, "perf/gen_tokens_per_sec": 10.0, "time/step": 2.0}


def test_the_eta_is_this_process_pace_after_a_resume():
    assert eta_seconds(20.0, 2, 2) == 20.0 and eta_seconds(5.0, 0, 3) == 0.0
    out = io.StringIO()
    # resumed at step 6: 2 steps in 20 s, 2 to go -> 20 s (the global step would say 20 / 8 * 2 = 5 s)
    Console(stream=out).step(STEP_ROW, 8, 10, 20.0, start_step=6)
    Console(stream=out).progress("sft", 8, 10, 20.0, ["loss 1.0000"], start_step=6)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and all(line.endswith("ETA 20s") for line in lines), lines


def test_a_progress_line_names_the_phase_rows_tokens_and_rate():
    p = StepProgress(None, interval=10.0)
    p.start_step("step 3/50")
    t0 = p._t_step
    p.start_phase("rollout", 128)
    p._t_phase = t0
    p.add(tokens=2400)
    # no row done yet (a rollout's rows finish together, an update's single micro-batch at its end): the size
    assert p.line(now=t0 + 12) == "  step 3/50: rollout for 12s, 128 rows, 2400 tokens, 200 tok/s"
    p.add(rows=32)
    assert p.line(now=t0 + 5) is None               # a step shorter than the interval prints nothing extra
    assert p.line(now=t0 + 12) == "  step 3/50: rollout for 12s, 32/128 rows, 2400 tokens, 200 tok/s"
    p.end_step()
    assert p.line(now=t0 + 30) is None              # between steps: nothing


def test_counting_sampled_tokens_leaves_the_samples_as_they_are(tiny_gpt, tok):
    prompts = [tok.render_prompt(f"{i} + {i} =") for i in range(3)]
    keys = torch.arange(12)
    plain = generate(tiny_gpt, prompts, num_generations=4, max_new_tokens=10, stop_ids=tok.stop_ids,
                     pad_id=tok.pad_id, keys=keys)
    seen = []
    hooked = generate(tiny_gpt, prompts, num_generations=4, max_new_tokens=10, stop_ids=tok.stop_ids,
                      pad_id=tok.pad_id, keys=keys, logits_hook=lambda lg, t, rows: seen.append(rows.numel()) or lg)
    assert torch.equal(plain.completion_ids, hooked.completion_ids)
    assert torch.equal(plain.sampler_logprobs, hooked.sampler_logprobs)
    # every row that sampled a token was counted: at least the completions' tokens, at most rows x steps
    assert int(plain.completion_mask.sum()) <= sum(seen) <= 12 * 10


def test_progress_is_shown_inside_a_long_step(tmp_path):
    """A reward that takes a while: lines name the step and the phase while the step runs, and the
    update's rows and tokens are the batch's."""
    (tmp_path / "slow.py").write_text("import time\n\ndef slow(completions, **kw):\n    time.sleep(0.8)\n"
                                      "    return [float(len(c)) for c in completions]\n")
    tr = make_trainer(tmp_path / "run", "train.max_steps=1", f"reward.functions=[{tmp_path / 'slow.py'}:slow]",
                      "algorithm.beta=0.0")
    lines: list[str] = []
    tr.progress = StepProgress(lines.append, interval=0.3)
    with tr.progress:
        tr.train_step()
    assert any(line.startswith("  step 1/1: score for") for line in lines), lines
    b = tr.last_batch
    assert tr.progress.rows == len(b) and tr.progress.tokens == int(b.gen.completion_mask.sum())


def _reader(proc, lines):
    for line in proc.stderr:
        lines.append((time.monotonic(), line.rstrip("\n")))


def _wait_for(path, proc, limit=120):
    deadline = time.monotonic() + limit
    while not path.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        time.sleep(0.05)


def _start(tmp_path, reward, *extra):
    cmd = [sys.executable, "-m", "grpolab.cli", "train", *TINY, "sft.steps=40", "train.max_steps=3",
           f"reward.functions=[{tmp_path / 'r.py'}:{reward}]", f"train.output_dir={tmp_path / 'run'}", *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list = []
    threading.Thread(target=_reader, args=(proc, lines), daemon=True).start()
    return proc, lines


@pytest.mark.slow
def test_a_second_ctrl_c_stops_a_step_stuck_in_a_reward_at_once(tmp_path):
    flag = tmp_path / "in_reward"
    (tmp_path / "r.py").write_text(f"import pathlib, time\n\ndef stuck(completions, **kw):\n"
                                   f"    pathlib.Path({str(flag)!r}).touch()\n    time.sleep(3600)\n")
    proc, lines = _start(tmp_path, "stuck")
    _wait_for(flag, proc)
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    ack = []
    while not ack and time.monotonic() < sent + 10:
        time.sleep(0.02)
        ack = [(t, line) for t, line in lines if "stopping after this step and saving" in line]
    assert ack and ack[0][1] == "grpolab: SIGINT: stopping after this step and saving; press Ctrl-C again to " \
                                "stop now", lines
    assert ack[0][0] - sent < 5        # at once, while the reward still runs
    assert proc.poll() is None         # the first Ctrl-C waits for the step
    second = time.monotonic()
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 130
    assert time.monotonic() - second < 15
    time.sleep(0.2)
    last = lines[-1][1]
    assert last.startswith("grpolab:") and len(last) > len("grpolab: ") and "second SIGINT" in last, lines
    assert not any("Traceback" in line for _, line in lines)
    assert not (tmp_path / "run" / "checkpoints").exists()   # the step was never finished


@pytest.mark.slow
def test_sigterm_is_acknowledged_then_the_step_finishes_and_is_saved(tmp_path):
    """Also: the warm start shows its progress, a line per interval with an ETA."""
    flag = tmp_path / "in_reward"
    (tmp_path / "r.py").write_text(f"import pathlib, time\n\ndef slow(completions, **kw):\n"
                                   f"    f = pathlib.Path({str(flag)!r})\n    if not f.exists():\n"
                                   f"        f.touch()\n        time.sleep(3)\n"
                                   f"    return [float(len(c)) for c in completions]\n")
    proc, lines = _start(tmp_path, "slow")
    _wait_for(flag, proc)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out = proc.stdout.read()
    assert proc.wait(timeout=120) == 130
    time.sleep(0.2)
    ack = [(t, line) for t, line in lines if "stopping after this step and saving" in line]
    assert ack and ack[0][1] == "grpolab: SIGTERM: stopping after this step and saving; press Ctrl-C again to " \
                                "stop now" and ack[0][0] - sent < 2.5, lines
    assert "stopped by SIGTERM after step 1; checkpoint saved" in lines[-1][1], lines
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == ["step_1"]
    warm = [line for line in out.splitlines() if "warm start: sft step" in line]
    assert len(warm) == 20 and all("ETA" in line for line in warm), out   # every 40 // 20 = 2 steps
    assert warm[-1].startswith("[####################] warm start: sft step 40/40")


@pytest.mark.slow
def test_the_final_eval_is_logged_and_short_runs_keep_their_first_and_last_samples(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    out = tmp_path / "run"
    r = run_cli("train", *TINY, "train.max_steps=3", "log.tensorboard=true", "log.samples_per_step=2",
                f"train.output_dir={out}")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in rows] == [1, 2, 3]
    final = json.loads((out / "eval.json").read_text())
    assert {k[5:]: v for k, v in rows[-1].items() if k.startswith("eval/")} == final
    assert not any(k.startswith("eval/") for m in rows[:-1] for k in m)
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("eval/greedy_accuracy")] == [(3, final["greedy_accuracy"])]
    # log.samples_every=10 (the default) is longer than the run: the first and the last step's samples
    samples = [json.loads(line)["step"] for line in (out / "samples.jsonl").read_text().splitlines()]
    assert samples == [1, 1, 3, 3]


@pytest.mark.slow
def test_a_fresh_model_has_a_dash_not_nan_before_training(tmp_path):
    r = run_cli("sft", *TINY, "sft.steps=3", "eval.num_problems=4", "eval.k=1", f"train.output_dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    table = r.stdout[r.stdout.index("metric (held-out)"):].splitlines()
    body = [line for line in table[2:] if line.strip() and not line.startswith("report")]
    assert body and all(line.split()[1] == "\u2013" and line.split()[3] == "\u2013" for line in body), table
    assert "nan" not in r.stdout


@pytest.mark.slow
def test_a_finished_offline_run_continued_further_equals_an_unbroken_one(tmp_path):
    """sft for 2 steps (its final eval logged with step 2), then sft.steps=3 with train.resume=auto (a
    constant learning rate: a decaying one depends on sft.steps): the 3 rows equal an unbroken 3-step run's,
    timing aside (step 2's final eval was the shorter run's, not a step's), and the last row holds the
    longer run's final eval."""
    small = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "data.test_size=4", "eval.num_problems=2",
             "eval.k=1", "sft.batch_size=4", "train.save_every=1", "sft.lr_schedule=constant", "sft.warmup_steps=0"]
    r = run_cli("sft", *small, "sft.steps=3", f"train.output_dir={tmp_path / 'whole'}", timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    for steps in (2, 3):
        r = run_cli("sft", *small, f"sft.steps={steps}", "train.resume=auto", f"train.output_dir={tmp_path / 'parts'}",
                    timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        if steps == 2:   # the shorter run logged its final eval with its last step
            assert any(k.startswith("eval/") for k in json.loads(
                (tmp_path / "parts" / "metrics.jsonl").read_text().splitlines()[-1]))

    def rows(d):
        return [{k: v for k, v in json.loads(x).items() if not k.startswith(("time/", "perf/"))}
                for x in (d / "metrics.jsonl").read_text().splitlines()]
    whole, parts = rows(tmp_path / "whole"), rows(tmp_path / "parts")
    assert len(whole) == 3 and parts == whole
    assert any(k.startswith("eval/") for k in whole[-1]) and not any(k.startswith("eval/") for k in whole[1])
