"""A run's logs through crashes, resumes, reports and evals: a torn metrics/samples line whose step has a checkpoint
is written again from it on resume; a run killed (SIGKILL) during its final eval resumes to the never-killed run's
metrics.jsonl; `grpolab report` names a last line it skips; report.html is written without an eval; the eval
scores its greedy completions with the reward functions (eval/rewards/<name>/mean)."""

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import ROOT, run_cli
from test_grpo import TINY
from test_resume import _strip, _train

from grpolab.errors import DataError, RewardError
from grpolab.monitor.report import write_report

# the training reward, which can hang in the final eval (trainer_state.global_step reaches max_steps only there:
# training scores a step's batch before the step counts) so that a test can kill the run inside it
GATED = """
import os, pathlib, time
def gated_len(completions, trainer_state, **_):
    mark = os.environ.get("HANG_MARK")
    if mark and trainer_state.global_step >= 3:
        pathlib.Path(mark).write_text("in the final eval")
        time.sleep(600)
    return [float(len(c)) for c in completions]
"""


def _args(tmp_path, out):
    fn = tmp_path / "gated.py"
    fn.write_text(GATED)
    return ["train", *TINY, f"reward.functions=[{fn}:gated_len]", "train.max_steps=3", "train.save_every=1",
            "train.keep_checkpoints=0", "train.threads=1", "log.samples_every=1", f"train.output_dir={out}"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """A never-killed 3-step run with its final eval (never modified: tests compare with it)."""
    tmp = tmp_path_factory.mktemp("straight")
    r = run_cli(*_args(tmp, tmp / "run"))
    assert r.returncode == 0, r.stderr
    return tmp / "run"


@pytest.mark.slow
def test_a_run_killed_in_its_final_eval_resumes_to_the_never_killed_logs(straight, tmp_path):
    killed = tmp_path / "killed"
    mark = tmp_path / "mark"
    proc = subprocess.Popen([sys.executable, "-m", "grpolab.cli", *_args(tmp_path, killed)], cwd=ROOT,
                            env={**os.environ, "HANG_MARK": str(mark)}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not mark.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert mark.exists(), "the run never reached its final eval"
    rows = _strip(killed / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3] and not any(k.startswith("eval/") for k in rows[-1])
    assert not (killed / "eval.json").exists()
    # the same kill, and the last row torn too (a kill while the final eval is written into it)
    torn = tmp_path / "torn"
    shutil.copytree(killed, torn)
    text = (torn / "metrics.jsonl").read_text()
    (torn / "metrics.jsonl").write_text(text[:text.rstrip("\n").rfind("\n") + 40])

    for run in (killed, torn):
        r = run_cli(*_args(tmp_path, run), "train.resume=auto")
        assert r.returncode == 0, r.stderr
        assert _strip(run / "metrics.jsonl") == _strip(straight / "metrics.jsonl"), run.name
        assert json.loads((run / "eval.json").read_text()) == json.loads((straight / "eval.json").read_text())
        assert (run / "samples.jsonl").read_text() == (straight / "samples.jsonl").read_text()
    assert "eval/rewards/gated_len/mean" in _strip(straight / "metrics.jsonl")[-1]


BASE = ["train.max_steps=4", "train.save_every=2", "train.keep_checkpoints=0", "log.samples_every=1",
        "log.samples_per_step=3", "reward.functions=[length]", "train.threads=1"]


@pytest.mark.slow
def test_a_torn_row_and_samples_of_a_checkpointed_step_are_written_again_on_resume(tmp_path):
    """Step 2's metrics row torn, and its samples cut mid-record, while checkpoints/step_2 exists: the resumed run
    writes steps [1, 2, 3, 4] (not [1, 3, 4]), the same lines as a run never stopped."""
    a, b = tmp_path / "straight", tmp_path / "resumed"
    _train(a, BASE)
    shutil.copytree(a, b)
    rows = (a / "metrics.jsonl").read_text().splitlines()
    (b / "metrics.jsonl").write_text(rows[0] + "\n" + rows[1][:len(rows[1]) // 2])
    samples = (a / "samples.jsonl").read_text().splitlines()
    (b / "samples.jsonl").write_text("\n".join(samples[:4]) + "\n" + samples[4][:30])
    _train(b, [*BASE, f"train.resume={b / 'checkpoints' / 'step_2'}"])
    assert [r["step"] for r in _strip(b / "metrics.jsonl")] == [1, 2, 3, 4]
    assert _strip(b / "metrics.jsonl") == _strip(a / "metrics.jsonl")
    assert (b / "metrics.jsonl").read_text().splitlines()[1] == rows[1]   # the very row, its timings too
    assert (b / "samples.jsonl").read_text() == (a / "samples.jsonl").read_text()


# ---------------------------------------------------------------- grpolab report

@pytest.mark.parametrize("last", ['{"step": 3, "rew', "garbage", "[1, 2]"])
def test_the_report_names_a_last_line_it_skips(tmp_path, capsys, last):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward": 0.5}\n{"step": 2, "reward": 0.7}\n' + last + "\n")
    write_report(tmp_path)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{tmp_path / 'metrics.jsonl'}: skipped its last line, line 3" in err[0], err
    assert "2</td>" in (tmp_path / "report.html").read_text()   # the two rows before it are reported


def test_a_json_line_that_is_no_object_before_the_last_is_one_line_naming_it(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward": 0.5}\n[1, 2]\n{"step": 3, "reward": 0.7}\n')
    with pytest.raises(DataError, match=r"metrics\.jsonl: line 2 is not a JSON object"):
        write_report(tmp_path)


# ---------------------------------------------------------------- a run without an eval

def _run(out, console, *overrides):
    from grpolab.config.load import load_config
    from grpolab.jobs.train import run_train
    cfg = load_config(None, [*TINY, "train.max_steps=2", "train.threads=1", "reward.functions=[length]",
                             f"train.output_dir={out}", *overrides])
    return run_train(cfg, console)


@pytest.mark.slow
def test_a_run_without_an_eval_writes_its_report_and_shows_no_eval_numbers(tmp_path):
    """Two runs on one console (a pipeline's stages): the second, without an eval, writes report.html and its step
    lines show no held-out accuracy (the first run's would be stale)."""
    from grpolab.monitor.console import Console
    buf = io.StringIO()
    console = Console(stream=buf)
    _run(tmp_path / "a", console, "eval.k=1", "train.log_every=1", "train.eval_every=1")
    assert "eval acc" in buf.getvalue().splitlines()[-3], buf.getvalue()   # step 2's line: step 1's eval
    buf.seek(0)
    buf.truncate()
    _run(tmp_path / "b", console, "eval.num_problems=0", "train.log_every=1")
    steps = [ln for ln in buf.getvalue().splitlines() if "step 2/2" in ln or "step 1/2" in ln]
    assert steps and not any("eval acc" in ln for ln in steps), buf.getvalue()
    assert (tmp_path / "b" / "report.html").is_file()
    assert f"report: {tmp_path / 'b' / 'report.html'}" in buf.getvalue()


# ---------------------------------------------------------------- the eval's reward means

LEN_REWARD = """
import torch
def char_len(completions, **_):
    torch.rand(3)   # draws from the global stream: the eval must not move the run's
    return [float(len(c)) for c in completions]

def boom(completions, **_):
    raise ValueError("boom in eval")
"""


def _eval_rows(answers: bool):
    rows = [{"prompt": f"{a}+{b}=", **({"answer": str(a + b)} if answers else {}), "tag": a}
            for a, b in [(1, 2), (3, 4), (2, 2), (5, 1)]]
    return [{**r, "answer": r.get("answer")} for r in rows]   # the loader's form: an answer, or None


def test_eval_rewards_are_the_mean_of_each_function_on_the_greedy_completions(tiny_gpt, tok, tmp_path):
    from grpolab.train.evaluate import evaluate
    (tmp_path / "lenrw.py").write_text(LEN_REWARD)
    fn = f"{tmp_path / 'lenrw.py'}:char_len"
    tagged = f"{tmp_path / 'tagrw.py'}:by_tag"
    (tmp_path / "tagrw.py").write_text("def by_tag(completions, tag, **_):\n"
                                       "    return [None if t == 3 else float(t) for t in tag]\n")
    rows = _eval_rows(answers=True)
    kw = dict(k=4, max_new_tokens=6, seed=1)
    plain = evaluate(tiny_gpt, tok, rows, **kw)
    before = torch.get_rng_state()
    res = evaluate(tiny_gpt, tok, rows, functions=[fn, tagged], **kw)
    assert torch.equal(torch.get_rng_state(), before)
    # the accuracy metrics as they were; the reward means besides, checked by hand on the greedy completions
    assert {k: v for k, v in res.items() if not k.startswith("rewards/") and k != "samples"} == \
        {k: v for k, v in plain.items() if k != "samples"}
    greedy = [s["greedy"] for s in res["samples"]]
    assert greedy == [s["greedy"] for s in plain["samples"]]
    assert res["rewards/char_len/mean"] == pytest.approx(sum(map(len, greedy)) / 4, abs=1e-6)
    assert res["rewards/by_tag/mean"] == pytest.approx((1 + 2 + 5) / 3)   # the row where it is None left out
    assert [s["greedy_rewards"]["by_tag"] for s in res["samples"]] == [1.0, None, 2.0, 5.0]
    # rows without answers: no accuracy (it would be 0 for every row), the reward means still
    bare = evaluate(tiny_gpt, tok, _eval_rows(answers=False), functions=[fn], **kw)
    assert set(bare) == {"rewards/char_len/mean", "samples"}
    assert bare["rewards/char_len/mean"] == res["rewards/char_len/mean"]
    with pytest.raises(RewardError, match="boom in eval"):
        evaluate(tiny_gpt, tok, rows, functions=[f"{tmp_path / 'lenrw.py'}:boom"], **kw)


def test_eval_functions_leave_out_a_reward_that_needs_the_missing_answers():
    from grpolab.train.eval_rewards import eval_functions
    kept, said = eval_functions(["gsm8k_accuracy", "length"], _eval_rows(answers=False))
    assert kept == ["length"]
    assert len(said) == 1 and said[0].startswith("eval: no eval/rewards/gsm8k_accuracy/mean (") and \
        "'answer'" in said[0]


@pytest.mark.slow
def test_grpolab_eval_scores_with_the_rewards_and_a_raising_one_is_one_line(straight, tmp_path):
    """`grpolab eval` of the last checkpoint reports what the final eval logged, the reward mean included; a
    reward that raises in the eval stops it with one line, exit 2."""
    ckpt = straight / "checkpoints" / "step_3"
    args = [a for a in _args(tmp_path, straight)[1:] if not a.startswith("train.output_dir")]
    r = run_cli("eval", str(ckpt), "--out", str(tmp_path / "ev"), *args)
    assert r.returncode == 0, r.stderr
    got = json.loads((tmp_path / "ev" / "eval.json").read_text())
    assert got == json.loads((straight / "eval.json").read_text())
    greedy = [json.loads(ln)["greedy"] for ln in open(tmp_path / "ev" / "eval_samples.jsonl")]
    assert got["rewards/gated_len/mean"] == pytest.approx(sum(map(len, greedy)) / len(greedy), abs=1e-6)
    (tmp_path / "boom.py").write_text(LEN_REWARD)
    bad = [a if not a.startswith("reward.functions") else f"reward.functions=[{tmp_path / 'boom.py'}:boom]"
           for a in args]
    r = run_cli("eval", str(ckpt), "--out", str(tmp_path / "ev2"), *bad)
    lines = [ln for ln in r.stderr.strip().splitlines() if not ln.startswith("grpolab: using ")]   # the config read
    assert r.returncode == 2 and len(lines) == 1 and "boom in eval" in lines[0] and "Traceback" not in r.stderr, \
        r.stderr


@pytest.mark.slow
def test_the_python_api_evaluates_prompt_only_rows_with_the_reward_functions(tmp_path):
    """TRL's shape: prompt-only train and eval rows, reward_len: the final eval and evaluate() give the reward's
    mean under TRL's names (eval_rewards/reward_len/mean), and no accuracy of rows without answers."""
    from api_rewards import reward_len

    from grpolab import GRPOConfig, GRPOTrainer
    from grpolab.data.tasks import arithmetic
    from grpolab.models.tiny_hf import save_tiny_model
    texts = [r["prompt"] + "\n" + r["answer"] for r in arithmetic.generate("train", 200, seed=0)]
    tiny = save_tiny_model(tmp_path / "llama", texts, vocab_size=300, hidden=32, layers=2, heads=2, intermediate=64)
    train = [{"prompt": r["prompt"]} for r in arithmetic.generate("train", 12, seed=3)]
    held = [{"prompt": r["prompt"]} for r in arithmetic.generate("test", 4, seed=3)]
    trainer = GRPOTrainer(model=str(tiny), reward_funcs=reward_len, train_dataset=train, eval_dataset=held,
                          args=GRPOConfig(output_dir=str(tmp_path / "run"), per_device_train_batch_size=4,
                                          num_generations=4, max_completion_length=8, max_steps=2,
                                          **{"train.threads": 1, "eval.k": 2}))
    final = trainer.train()
    assert set(final) == {"rewards/reward_len/mean"}
    assert trainer.evaluate() == {"eval_rewards/reward_len/mean": final["rewards/reward_len/mean"]}
    last = [json.loads(ln) for ln in open(tmp_path / "run" / "metrics.jsonl")][-1]
    assert last["eval/rewards/reward_len/mean"] == final["rewards/reward_len/mean"]
    assert "rewards/reward_len/mean" in last   # the training's, beside it
