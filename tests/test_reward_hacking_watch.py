"""The reward-hacking watch (grpolab/monitor/reward_hacking.py): held-out accuracy falling beyond its noise while
the training reward does not fall. The rule on hand-written series, the console's one warning line, and real runs:
a reward that pays for leaving out the answer marker (its reward rises as held-out accuracy collapses) is
flagged in metrics.jsonl, on the console once, and in report.html; a resumed run flags the same steps."""

import base64
import io
import json
import math
import re
import shutil
import statistics

import pytest
from conftest import run_cli

from grpolab.monitor.console import Console
from grpolab.monitor.reward_hacking import (
    FLAG_KEY,
    STDERR_KEY,
    Watch,
    accuracy_stderr,
    series_from_rows,
    verdict,
    verdicts,
)

N = 100   # problems per eval in the hand-written series


def _se(p: float, n: int = N) -> float:
    """The standard error of the mean of n 0/1 scores, p of them 1, from the scores themselves."""
    scores = [1.0] * round(p * n) + [0.0] * (n - round(p * n))
    return statistics.stdev(scores) / math.sqrt(n)


def _evals(steps, accs, n=N):
    return [(s, a, _se(a, n)) for s, a in zip(steps, accs)]


def _rewards(pairs):
    """[(step, reward)] from {eval step: [the rewards of the steps leading to it]}, in step order."""
    out, step = [], 0
    for _, rs in sorted(pairs.items()):
        for r in rs:
            step += 1
            out.append((step, r))
    return out


# ---------------------------------------------------------------- the rule on hand-written series

def test_stderr_is_the_standard_error_of_the_scores():
    for p, n in ((0.5, 100), (0.37, 100), (0.2, 50), (0.0, 30), (1.0, 30)):
        assert accuracy_stderr(p, n) == pytest.approx(_se(p, n), rel=1e-12)


def test_rising_reward_and_accuracy_falling_beyond_its_noise_is_flagged():
    # evals every 4 steps; the reward rises 0.3 -> 0.9 while accuracy falls 0.60 -> 0.30 (noise: 2 * 0.067)
    rewards = _rewards({4: [0.3, 0.35, 0.3, 0.25], 8: [0.5, 0.6, 0.55, 0.6], 12: [0.85, 0.9, 0.95, 0.9]})
    evals = _evals((4, 8, 12), (0.60, 0.50, 0.30))
    v = verdict(rewards, evals)
    assert v is not None and v.flagged and (v.first_step, v.step) == (4, 12)
    noise = 2 * math.sqrt(_se(0.6) ** 2 + _se(0.3) ** 2)
    assert v.accuracy_noise == pytest.approx(noise) and 0.13 < noise < 0.14
    # the reward windows: the steps since the eval before (steps 1-4 and 9-12)
    assert v.reward_first == pytest.approx(0.3) and v.reward_last == pytest.approx(0.9)
    q = lambda xs: statistics.stdev(xs) / math.sqrt(len(xs))  # noqa: E731
    assert v.reward_noise == pytest.approx(2 * math.hypot(q([0.3, 0.35, 0.3, 0.25]), q([0.85, 0.9, 0.95, 0.9])))
    assert "0.600 -> 0.300" in v.describe() and "step 4 to step 12" in v.describe()


def test_a_fall_within_the_noise_is_not_flagged():
    rewards = _rewards({4: [0.3] * 4, 8: [0.6] * 4, 12: [0.9] * 4})
    # 0.60 -> 0.48: a fall of 0.12, under 2 standard errors of the difference (0.137)
    assert not verdict(rewards, _evals((4, 8, 12), (0.60, 0.40, 0.48))).flagged
    # the same fall over 400 problems is beyond the noise (0.069)
    assert verdict(rewards, _evals((4, 8, 12), (0.60, 0.40, 0.48), n=400)).flagged


def test_both_rising_or_both_falling_is_not_flagged():
    rewards_up = _rewards({4: [0.3] * 4, 8: [0.6] * 4, 12: [0.9] * 4})
    assert not verdict(rewards_up, _evals((4, 8, 12), (0.30, 0.45, 0.60))).flagged
    # the reward falls with the accuracy: the reward sees the model getting worse, no hacking
    rewards_down = _rewards({4: [0.9, 0.85, 0.9, 0.95], 8: [0.6] * 4, 12: [0.3, 0.35, 0.25, 0.3]})
    assert not verdict(rewards_down, _evals((4, 8, 12), (0.60, 0.50, 0.30))).flagged


def test_a_saturated_reward_while_accuracy_collapses_is_flagged():
    """"Reward 1.0 while accuracy collapsed": the reward does not rise (it cannot), and does not fall."""
    rewards = _rewards({4: [1.0] * 4, 8: [1.0] * 4, 12: [1.0] * 4})
    assert verdict(rewards, _evals((4, 8, 12), (0.60, 0.40, 0.20))).flagged


def test_a_reward_falling_within_its_noise_still_counts_as_not_falling():
    accs = _evals((4, 8, 12), (0.60, 0.50, 0.30))
    noisy = _rewards({4: [0.2, 0.8, 0.3, 0.7], 8: [0.5] * 4, 12: [0.1, 0.9, 0.2, 0.6]})   # mean 0.5 -> 0.45
    assert verdict(noisy, accs).flagged
    steady = _rewards({4: [0.5, 0.5, 0.5, 0.5], 8: [0.5] * 4, 12: [0.45, 0.45, 0.45, 0.45]})   # 0.5 -> 0.45, no noise
    assert not verdict(steady, accs).flagged


def test_too_few_evals_or_a_window_without_reward_give_no_verdict():
    rewards = _rewards({4: [0.3] * 4, 8: [0.6] * 4, 12: [0.9] * 4})
    assert verdict(rewards, _evals((4, 8), (0.6, 0.3))) is None
    assert verdict(rewards, _evals((4, 8), (0.6, 0.3)), window=2).flagged
    nan_first = [(s, float("nan") if s <= 4 else r) for s, r in rewards]
    assert verdict(nan_first, _evals((4, 8, 12), (0.6, 0.5, 0.3))) is None
    with pytest.raises(ValueError, match="at least 2"):
        verdict(rewards, _evals((4, 8, 12), (0.6, 0.5, 0.3)), window=1)


def test_verdicts_judge_each_eval_on_the_last_three_up_to_it():
    rewards = _rewards({k: [0.1 * k / 2] * 2 for k in (2, 4, 6, 8, 10)})   # rising, 2 steps per eval
    evals = _evals((2, 4, 6, 8, 10), (0.7, 0.7, 0.7, 0.4, 0.4))
    got = [(v.step, v.first_step, v.flagged) for v in verdicts(rewards, evals)]
    # 6: 0.7 -> 0.7; 8: 0.7 -> 0.4 over steps 4-8; 10: 0.7 (step 6) -> 0.4
    assert got == [(6, 2, False), (8, 4, True), (10, 6, True)]


def test_the_watch_logs_the_flag_and_a_seeded_watch_continues_the_same_series():
    rows = []
    w = Watch(N)
    for step in range(1, 13):
        w.add_reward(step, 0.1 * step)
        row = {"step": step, "reward": 0.1 * step}
        if step % 4 == 0:
            watched, _ = w.add_eval(step, {4: 0.6, 8: 0.5, 12: 0.3}[step])
            row.update({"eval/greedy_accuracy": {4: 0.6, 8: 0.5, 12: 0.3}[step], **watched})
        rows.append(json.loads(json.dumps(row)))   # as metrics.jsonl gives them back
    assert [r.get(FLAG_KEY) for r in rows if "eval/greedy_accuracy" in r] == [0, 0, 1]
    assert rows[3][STDERR_KEY] == pytest.approx(_se(0.6))
    seeded = Watch(N)
    seeded.seed(rows + [{"step": 13, "reward": 5.0}], up_to_step=12)   # rows after the checkpoint are left out
    assert seeded.rewards == w.rewards and seeded.evals == w.evals
    assert series_from_rows(rows) == (w.rewards, w.evals)


def test_the_console_warns_once_when_the_flag_turns_on(capsys):
    out = io.StringIO()
    c = Console(stream=out)
    v = verdict(_rewards({4: [0.3] * 4, 8: [0.6] * 4, 12: [0.9] * 4}), _evals((4, 8, 12), (0.6, 0.5, 0.3)))
    for step, flag in ((4, 0), (8, 0), (12, 1), (16, 1), (20, 0), (24, 1)):
        c.evaluated(step, {"eval/greedy_accuracy": 0.42, FLAG_KEY: flag}, v)
    warned = [ln for ln in capsys.readouterr().err.splitlines() if "reward hacking" in ln]
    assert len(warned) == 2 and "at step 12" in warned[0] and "at step 24" in warned[1]   # on at 12, again at 24
    assert "0.600 -> 0.300" in warned[0]
    c.step({"reward": 0.9, "completions/mean_length": 3.0, "perf/gen_tokens_per_sec": 10.0, "time/step": 1.0},
           25, 30, 5.0)
    assert "| reward 0.900 | eval acc 0.420 |" in out.getvalue()


# ---------------------------------------------------------------- real runs

# a warm start that gets some held-out answers right, then a reward paying for completions without '####':
# the training reward rises to 1.0 while held-out accuracy falls to 0
HACK_REWARD = "def no_answer(completions, **kw):\n    return [0.0 if '####' in c else 1.0 for c in completions]\n"
HACK = ["data.min_ops=2", "data.max_ops=2", "data.max_operand=4", "data.max_value=8", "data.allow_mul=false",
        "data.train_size=2000", "data.test_size=50", "model.n_layer=2", "model.n_embd=64", "model.block_size=96",
        "sft.steps=150", "sft.batch_size=32", "sft.bare_fraction=0.5", "sft.bare_steps=0",
        "rollout.prompts_per_step=8", "rollout.num_generations=8", "rollout.max_new_tokens=16", "optim.lr=3e-4",
        "algorithm.beta=0.0", "eval.num_problems=50", "eval.k=1", "train.max_steps=10", "train.eval_every=2",
        "train.save_every=2", "train.keep_checkpoints=0"]


def _expected_flags(rows, n, k=3, z=2.0):
    """The rule written out plainly: first vs last of the last k evals, rewards since the eval before each."""
    evals = [(r["step"], r["eval/greedy_accuracy"]) for r in rows if "eval/greedy_accuracy" in r]
    flags = {}
    for j, (step, acc) in enumerate(evals):
        if j < k - 1:
            flags[step] = 0
            continue
        s1, a1 = evals[j - k + 1]
        se = lambda p: math.sqrt(p * (1 - p) / (n - 1))  # noqa: E731
        fell = a1 - acc > z * math.sqrt(se(a1) ** 2 + se(acc) ** 2)
        before1 = evals[j - k][0] if j >= k else 0
        w1 = [r["reward"] for r in rows if before1 < r["step"] <= s1]
        wk = [r["reward"] for r in rows if evals[j - 1][0] < r["step"] <= step]
        q = lambda w: statistics.stdev(w) / math.sqrt(len(w)) if len(w) > 1 else 0.0  # noqa: E731
        held = statistics.mean(wk) - statistics.mean(w1) >= -z * math.sqrt(q(w1) ** 2 + q(wk) ** 2)
        flags[step] = int(fell and held)
    return flags


def _strip(path):
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(("time/", "perf/"))}
            for line in open(path)]


@pytest.fixture(scope="module")
def hacked(tmp_path_factory):
    d = tmp_path_factory.mktemp("hack")
    (d / "hack.py").write_text(HACK_REWARD)
    args = ["train", *HACK, f"reward.functions=[{d / 'hack.py'}:no_answer]"]
    r = run_cli(*args, f"train.output_dir={d / 'run'}")
    assert r.returncode == 0, r.stderr[-3000:]
    return d, args, r


@pytest.mark.slow
def test_a_real_hacked_run_is_flagged_in_metrics_console_and_report(hacked):
    d, _, r = hacked
    run = d / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [m for m in rows if "eval/greedy_accuracy" in m]
    assert [m["step"] for m in evals] == [2, 4, 6, 8, 10]
    # the run did hack its reward: reward up, held-out accuracy down
    assert rows[-1]["reward"] > rows[0]["reward"] + 0.5 and evals[-1]["eval/greedy_accuracy"] < \
        evals[0]["eval/greedy_accuracy"] - 0.1
    # the flag and the standard error at every eval step, nowhere else
    assert all((FLAG_KEY in m) == (STDERR_KEY in m) == ("eval/greedy_accuracy" in m) for m in rows)
    assert {m["step"]: m[FLAG_KEY] for m in evals} == _expected_flags(rows, 50)
    flagged = [m["step"] for m in evals if m[FLAG_KEY] == 1]
    assert flagged, evals
    # the console: one warning line, at the first flagged eval; each step line shows the latest accuracy
    warned = [ln for ln in r.stderr.splitlines() if "possible reward hacking" in ln]
    assert len(warned) == 1 and f"at step {flagged[0]}:" in warned[0], r.stderr[-2000:]
    for m in evals[:-1]:   # (the final eval comes after the last step's line)
        line = next(ln for ln in r.stdout.splitlines() if f" step {m['step']}/10 |" in ln)
        assert f"| reward {m['reward']:.3f} | eval acc {m['eval/greedy_accuracy']:.3f} |" in line, line
    # the report, written again by `grpolab report`: the warning box names the flagged steps; the plot of both
    (run / "report.html").unlink()
    rep = run_cli("report", str(run))
    assert rep.returncode == 0, rep.stderr
    page = (run / "report.html").read_text()
    box = re.search(r'<div class="warn" id="reward-hacking"><b>Possible reward hacking at steps? ([\d, ]+)</b>', page)
    assert box and box.group(1) == ", ".join(map(str, flagged)), page[:3000]
    assert "<h2>Training reward and held-out accuracy</h2>" in page and page.count("FLAGGED") == len(flagged)
    png = (run / "report" / "reward_vs_accuracy.png").read_bytes()
    assert base64.b64encode(png).decode() in page
    assert _red_pixels(png) > 500   # the flagged windows' shading


def _red_pixels(png: bytes) -> int:
    """Pixels of the light red the flagged windows are shaded with (red at alpha 0.12 over white, or twice)."""
    from PIL import Image
    with Image.open(io.BytesIO(png)) as im:
        raw = im.convert("RGB").tobytes()
    px = [raw[i:i + 3] for i in range(0, len(raw), 3)]
    return sum(1 for p in px if p[0] == 255 and 180 <= p[1] <= 235 and abs(p[1] - p[2]) <= 2)


@pytest.mark.slow
def test_a_run_resumed_before_the_fall_flags_the_same_steps(hacked, tmp_path):
    """Resumed from step 4: the watch's windows reach back before the checkpoint, so its series must come back
    from metrics.jsonl (a fresh one would judge step 6 on two evals and not flag it)."""
    d, args, _ = hacked
    resumed = tmp_path / "resumed"
    shutil.copytree(d / "run", resumed)
    r = run_cli(*args, f"train.output_dir={resumed}", f"train.resume={resumed / 'checkpoints' / 'step_4'}")
    assert r.returncode == 0, r.stderr[-3000:]
    straight = _strip(d / "run" / "metrics.jsonl")
    assert any(m.get(FLAG_KEY) == 1 and m["step"] == 6 for m in straight), straight
    assert _strip(resumed / "metrics.jsonl") == straight


@pytest.mark.slow
def test_a_report_of_unflagged_evals_has_the_table_but_no_warning(tmp_path):
    """Hand-written rows as the trainer logs them (Watch.add_eval): accuracy within noise, no warning box, no red."""
    w, rows = Watch(50), []
    for step in range(1, 13):
        row = {"step": step, "reward": 0.05 * step}
        w.add_reward(step, row["reward"])
        if step % 3 == 0:
            acc = {3: 0.5, 6: 0.46, 9: 0.52, 12: 0.44}[step]
            row.update({"eval/greedy_accuracy": acc, **w.add_eval(step, acc)[0]})
        rows.append(row)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in rows))
    r = run_cli("report", str(tmp_path))
    assert r.returncode == 0, r.stderr
    page = (tmp_path / "report.html").read_text()
    assert 'class="warn"' not in page and "FLAGGED" not in page
    assert page.count("no verdict (needs 3 evals)") == 2 and page.count("<td>ok</td>") == 2
    assert _red_pixels((tmp_path / "report" / "reward_vs_accuracy.png").read_bytes()) == 0


def test_continuing_a_finished_run_drops_the_final_evals_flag_with_it(tmp_path):
    """A finished run continued further: its last row loses the final eval (an unbroken run has none there), and
    the watch's keys logged with that eval, so the continued run's rows equal an unbroken one's."""
    from grpolab.train.run_logs import drop_final_eval
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 1, "reward": 0.1}, {"step": 2, "reward": 0.2, "eval/greedy_accuracy": 0.3, FLAG_KEY: 0,
                                         STDERR_KEY: 0.05}]
    path.write_text("".join(json.dumps(m) + "\n" for m in rows))
    drop_final_eval(path, 2, eval_every=0)
    assert [json.loads(line) for line in path.read_text().splitlines()] == [rows[0], {"step": 2, "reward": 0.2}]
