"""Reward functions that misbehave: hang, edit their inputs, call sys.exit, return values float32
cannot hold, or need a column the data lacks. Each is a real function in a .py file, loaded by
spec as users load them; each gives one RewardError line naming the function (and the sample)."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from conftest import ROOT, run_cli
from test_grpo import TINY

from grpolab.config import RewardConfig
from grpolab.errors import RewardError
from grpolab.rewards import combine
from grpolab.rewards.calling import TrainerState
from grpolab.rewards.combine import check_signatures, score
from grpolab.rewards.runtime import RewardRuntime
from grpolab.rollout.tools import ToolRunner, load_tools

QUICK = TINY + ["sft.steps=0", "train.max_steps=2"]

FAULTS = '''
import asyncio
import sys
import time


def spins(completions, **_):
    while True:
        pass


def sleeps(completions, **_):
    time.sleep(10_000)


def catches(completions, **_):            # swallows the first interruption, then returns late
    try:
        time.sleep(10_000)
    except BaseException:
        pass
    return [0.0] * len(completions)


async def awaits(completions, **_):
    await asyncio.sleep(10_000)


async def blocks_the_loop(completions, **_):   # a sync call inside async def: the loop itself is stuck
    time.sleep(10_000)


async def quick_async(completions, **_):
    return [0.25] * len(completions)


def exits_0(completions, **_):
    sys.exit(0)


def exits_3(completions, **_):
    raise SystemExit(3)


def exits_on_b(completions, **_):
    if any("b" in c for c in completions):
        sys.exit()
    return [0.0] * len(completions)


async def exits_async(completions, **_):
    sys.exit(0)


def huge(completions, **_):
    return [1.0, 1e308][:len(completions)] + [0.0] * (len(completions) - 2)


def near_max(completions, **_):
    return [3.0e38] * len(completions)


def returns(completions, **_):
    return RETURN * len(completions)


def vandal(prompts, completions, completion_ids, trainer_state, answer, **_):
    for i in range(len(completions)):
        completions[i] = "#### 999"          # gsm8k_accuracy must still see the sampled text
        answer[i] = "999"
        prompts[i] = "vandalized"
        completion_ids[i].append(-1)
    trainer_state.global_step = -5
    return [0.0] * len(completions)


async def async_vandal(completions, answer, **_):
    completions[0] = "#### 999"
    answer[0] = "999"
    return [0.0] * len(completions)


def witness(prompts, completions, completion_ids, trainer_state, answer, **_):
    SEEN.append((list(prompts), list(completions), [list(x) for x in completion_ids], trainer_state.global_step,
                 list(answer)))
    return [1.0] * len(completions)


SEEN = []
RETURN = [0.0]


def needs_answer(completions, answer, **_):
    return [0.0] * len(completions)


def answer_optional(completions, answer=None, **_):
    return [0.0] * len(completions)


def needs_label(completions, label, **_):
    return [0.0] * len(completions)


def math_verified(completions, answer, **_):   # math-verify's own signal.alarm timeouts (the defaults)
    from math_verify import parse, verify
    return [float(verify(parse(a), parse(c))) for c, a in zip(completions, answer)]
'''


@pytest.fixture
def faults(tmp_path):
    """'path/faults.py' (a spec prefix) and the module as grpolab loaded it."""
    f = tmp_path / "faults.py"
    f.write_text(FAULTS)
    from grpolab.rewards.custom import _load_file_module
    return str(f), _load_file_module(str(f.resolve()))


def _late(name):
    return f"reward function '{name}' did not return within reward.timeout = 0.5 s"


# ---- item 2: reward.timeout --------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("fn,limit", [("spins", 1.5), ("sleeps", 1.5), ("catches", 1.5), ("awaits", 1.5),
                                      ("blocks_the_loop", 0.5 + 2.0 + 1.5)])
def test_a_reward_that_never_returns_stops_at_reward_timeout(faults, fn, limit):
    path, _ = faults
    t0 = time.monotonic()
    with pytest.raises(RewardError) as e:
        score(["length", f"{path}:{fn}"], None, ["q"] * 2, ["a", "b"], {}, timeout=0.5)
    took = time.monotonic() - t0
    assert str(e.value).startswith(_late(f"{path}:{fn}")) and "\n" not in str(e.value)
    assert 0.5 <= took < limit, took


@pytest.mark.slow
def test_after_a_stuck_event_loop_async_rewards_run_on_a_new_one(faults):
    path, _ = faults
    with pytest.raises(RewardError, match="blocks_the_loop' did not return"):
        score([f"{path}:blocks_the_loop"], None, ["q"], ["a"], {}, timeout=0.5)
    _, per = score([f"{path}:quick_async"], None, ["q"] * 3, ["a", "b", "c"], {}, timeout=0.5)
    assert per[f"{path}:quick_async"].tolist() == [0.25] * 3


def test_the_timeout_also_holds_outside_the_main_thread(faults):
    path, _ = faults
    out = {}

    def run():
        t0 = time.monotonic()
        try:
            score([f"{path}:sleeps"], None, ["q"], ["a"], {}, timeout=0.5)
        except RewardError as e:
            out["error"], out["took"] = str(e), time.monotonic() - t0

    t = threading.Thread(target=run)
    t.start()
    t.join(10)
    assert out["error"].startswith(_late(f"{path}:sleeps")) and out["took"] < 1.5


def test_the_timeout_changes_no_value_and_keeps_signal_timeouts_working(faults, monkeypatch):
    """Functions run in the main thread as without a limit: the same values, and math-verify's
    signal.alarm timeouts (which refuse to run in any other thread) still work."""
    path, _ = faults
    specs = ["gsm8k_accuracy", "format", "math_accuracy", f"{path}:math_verified", f"{path}:quick_async"]
    completions = ["so #### 4", "<answer>4</answer> #### 5", "$\\frac{1}{2}$", "x #### 0.5", "no answer"]
    answers = ["4", "5", "0.5", "1/2", "3"]
    cols = {"answer": answers}
    plain_total, plain = score(specs, [1.0, 0.5, 2.0, 1.0, 1.0], ["q"] * 5, completions, cols, timeout=0)
    total, per = score(specs, [1.0, 0.5, 2.0, 1.0, 1.0], ["q"] * 5, completions, cols, timeout=30)
    assert torch.equal(total, plain_total)
    assert all(torch.equal(per[s], plain[s]) for s in specs) and list(per) == specs
    from math_verify import parse, verify
    assert per[f"{path}:math_verified"].tolist() == [float(verify(parse(a), parse(c)))
                                                     for c, a in zip(completions, answers)]
    assert per[f"{path}:math_verified"].tolist()[2] == 1.0   # (1/2 == \frac{1}{2}: it really ran)
    # no SIGURG handler and no watchdog thread are left behind
    assert signal.getsignal(signal.SIGURG) in (signal.SIG_DFL, None)
    assert not [t for t in threading.enumerate() if t.name == "grpolab-reward-timeout"]


def test_the_runtime_sets_the_timeout(faults):
    path, _ = faults
    assert RewardRuntime().timeout == RewardConfig().timeout == 300.0
    runtime = RewardRuntime.from_config(RewardConfig(timeout=0.5))
    with pytest.raises(RewardError, match=r"within reward.timeout = 0.5 s"):
        score([f"{path}:sleeps"], None, ["q"], ["a"], {}, runtime=runtime)


def test_code_exec_may_take_what_its_sandboxes_take(faults):
    """Programs that all loop forever are killed one by one at reward.code_exec.timeout: they score 0,
    they must not trip reward.timeout and stop the run."""
    from grpolab.rewards import code
    from grpolab.sandbox import Limits
    path, mod = faults
    runtime = RewardRuntime(timeout=300.0, limits=Limits(timeout=10.0), max_concurrent=2)
    # 256 programs, 2 at a time, up to 10 s each: 128 rounds of 10 s, the runner's own 10 s, 10 s to spare
    assert combine._limit(code.code_exec, 256, runtime) == 128 * 10 + 10 + 10
    assert combine._limit(code.code_exec, 8, runtime) == 300.0
    assert combine._limit(code.code_exec, 256, RewardRuntime(timeout=0.0, limits=Limits(timeout=10.0),
                                                             max_concurrent=2)) == 0.0
    assert combine._limit(mod.sleeps, 256, runtime) == 300.0


# ---- item 3: every function gets its own inputs --------------------------------------------------------
@pytest.mark.parametrize("vandal", ["vandal", "async_vandal"])
def test_a_reward_that_edits_its_inputs_changes_nothing_for_the_others(faults, vandal):
    path, mod = faults
    mod.SEEN.clear()
    prompts = ["p0", "p1", "p2"]
    completions = ["x #### 4", "y #### 7", "z #### 1"]
    answers = ["4", "8", "1"]
    ids = [[1, 2], [3], [4, 5, 6]]
    state = TrainerState(global_step=7, max_steps=10)
    specs = [f"{path}:{vandal}", "gsm8k_accuracy", f"{path}:witness"]
    total, per = score(specs, None, prompts, completions, {"answer": answers}, completion_ids=ids,
                       trainer_state=state)
    # gsm8k_accuracy, by hand: the final number after '####' equals the answer
    want = [1.0 if c.rsplit("####", 1)[1].strip() == a else 0.0 for c, a in zip(completions, answers)]
    assert want == [1.0, 0.0, 1.0]
    assert per["gsm8k_accuracy"].tolist() == want
    assert mod.SEEN == [(prompts, completions, ids, 7, answers)]
    assert total.tolist() == [w + 1.0 for w in want]
    # and the caller's own lists are untouched
    assert (prompts, completions, answers, ids, state.global_step) == (
        ["p0", "p1", "p2"], ["x #### 4", "y #### 7", "z #### 1"], ["4", "8", "1"], [[1, 2], [3], [4, 5, 6]], 7)


def test_the_copy_is_deep_for_chat_prompts_and_nested_columns(faults):
    path, mod = faults
    mod.SEEN.clear()
    chat = [[{"role": "user", "content": "q"}]]

    def vandal(prompts, completions, meta, **_):
        prompts[0][0]["content"] = "edited"
        completions[0][0]["content"] = "edited"
        meta[0]["tests"].append("rm -rf")
        return [0.0]
    from grpolab import rewards
    rewards.REWARDS["_vandal_nested"] = vandal
    try:
        meta = [{"tests": ["assert f(1) == 2"]}]
        seen = {}
        rewards.REWARDS["_spy_nested"] = lambda prompts, completions, meta, **_: seen.update(
            p=prompts, c=completions, m=meta) or [0.0]
        score(["_vandal_nested", "_spy_nested"], None, chat, ["hi"], {"meta": meta})
        assert seen == {"p": [[{"role": "user", "content": "q"}]], "c": [[{"role": "assistant", "content": "hi"}]],
                        "m": [{"tests": ["assert f(1) == 2"]}]}
        assert chat == [[{"role": "user", "content": "q"}]] and meta == [{"tests": ["assert f(1) == 2"]}]
    finally:
        rewards.REWARDS.pop("_vandal_nested")
        rewards.REWARDS.pop("_spy_nested")


# ---- item 4: sys.exit inside a reward or a tool ----------------------------------------------------------
@pytest.mark.parametrize("fn,code", [("exits_0", "0"), ("exits_3", "3"), ("exits_async", "0")])
def test_sys_exit_in_a_reward_is_a_reward_error(faults, fn, code):
    path, _ = faults
    with pytest.raises(RewardError) as e:
        score([f"{path}:{fn}"], None, ["q"] * 2, ["a", "b"], {})
    msg = str(e.value)
    assert msg.startswith(f"reward function '{path}:{fn}' raised SystemExit ({code}: sys.exit() inside a reward")
    assert msg.endswith(" on sample 0 (completion 'a')") and "\n" not in msg


def test_sys_exit_names_the_sample_that_causes_it(faults):
    path, _ = faults
    with pytest.raises(RewardError, match=r"raised SystemExit \(0: .* on sample 1 \(completion 'b'\)$"):
        score([f"{path}:exits_on_b"], None, ["q"] * 3, ["a", "b", "c"], {})


def test_sys_exit_in_a_user_tool_is_a_tool_error(tmp_path):
    f = tmp_path / "quitter.py"
    f.write_text('import sys\n\ndef quit_now(code: int) -> str:\n    """Quit.\n\n    Args:\n'
                 '        code: the exit code\n    """\n    sys.exit(code)\n')
    runner = ToolRunner(load_tools([f"{f}:quit_now"]), timeout=5, max_output_chars=200)
    try:
        rec = runner.run([("quit_now", {"code": 3})])[0]
    finally:
        runner.close()
    assert rec.error and rec.output == "error: SystemExit: 3"


@pytest.mark.slow
def test_sys_exit_in_a_reward_exits_2_through_the_cli(faults, tmp_path):
    path, _ = faults
    r = run_cli("train", *QUICK, f"train.output_dir={tmp_path / 'run'}", f"reward.functions=[{path}:exits_0]")
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("warning:")]
    assert len(lines) == 1 and lines[0].startswith(f"grpolab: reward error: reward function '{path}:exits_0' "
                                                   f"raised SystemExit (0: "), r.stderr


# ---- item 5: values float32 cannot hold ------------------------------------------------------------------
def test_a_value_beyond_float32_is_a_reward_error(faults):
    path, _ = faults
    with pytest.raises(RewardError) as e:
        score([f"{path}:huge"], None, ["q"] * 3, ["a", "b", "c"], {})
    assert str(e.value) == (f"reward function '{path}:huge' returned 1e+308 for sample 1, beyond float32's range "
                            f"(|r| <= 3.403e+38) that rewards are trained in; rescale the reward")
    assert combine.FLOAT32_MAX == float(torch.finfo(torch.float32).max) == 3.4028234663852886e38


@pytest.mark.parametrize("value,ok", [(3.4028234663852886e38, True), (-3.4028234663852886e38, True),
                                      (3.41e38, False), (-1e39, False), (float("inf"), False),
                                      (float("nan"), False), ("1.0", False), ([1.0], False)])
def test_returned_values_at_the_edges(faults, value, ok):
    path, mod = faults
    mod.RETURN = [value]
    if ok:
        _, per = score([f"{path}:returns"], None, ["q"], ["a"], {})
        assert per[f"{path}:returns"].tolist() == [value]
        return
    with pytest.raises(RewardError) as e:
        score([f"{path}:returns"], None, ["q"], ["a"], {})
    assert str(e.value).startswith(f"reward function '{path}:returns' returned {value!r} for sample 0")


@pytest.mark.parametrize("value", [10 ** 400, -(10 ** 400)])
def test_an_int_beyond_every_float_is_a_reward_error_not_an_overflow(faults, value):
    path, mod = faults
    mod.RETURN = [value]
    with pytest.raises(RewardError) as e:   # float(10**400) raises OverflowError; it used to escape as a traceback
        score([f"{path}:returns"], None, ["q"], ["a"], {})
    assert str(e.value) == (f"reward function '{path}:returns' returned {repr(value)[:20]}... ({len(repr(value))} "
                            f"characters) for sample 0, beyond float32's range (|r| <= 3.403e+38) that rewards are "
                            f"trained in; rescale the reward")


def test_a_weighted_sum_that_overflows_float32_is_a_reward_error(faults):
    path, _ = faults
    with pytest.raises(RewardError, match=r"the weighted sum of the rewards overflows float32 on sample 0"):
        score([f"{path}:near_max", "length"], [2.0, 1.0], ["q"], ["a"], {})
    total, _ = score([f"{path}:near_max"], [1.0], ["q"], ["a"], {})
    assert total.tolist() == [float(torch.tensor(3.0e38, dtype=torch.float32))]


# ---- weak spot: a needed column the data has no values for ------------------------------------------
def test_a_reward_needing_a_column_no_row_has_is_refused_at_start(faults):
    path, _ = faults
    rows = [{"prompt": "q1", "answer": None}, {"prompt": "q2", "answer": None}]
    with pytest.raises(RewardError) as e:
        check_signatures(["length", "gsm8k_accuracy"], ["prompt", "answer"], rows=rows, source="data/train.jsonl")
    assert str(e.value) == ("reward function 'gsm8k_accuracy' needs the dataset column 'answer', but none of the 2 "
                            "rows of data/train.jsonl has a value for it; set data.answer_key to the column that "
                            "holds the reference answers, or use a reward that needs none")
    with pytest.raises(RewardError, match=f"'{path}:needs_label' needs the dataset column 'label', but none of"):
        check_signatures([f"{path}:needs_label"], ["prompt", "label"], rows=[{"prompt": "q", "label": None}])
    # a default means the function can do without; one row with a value is enough; no rows: names only
    check_signatures([f"{path}:answer_optional", "length"], ["prompt", "answer"], rows=rows)
    check_signatures(["gsm8k_accuracy", f"{path}:needs_answer"], ["prompt", "answer"],
                     rows=rows + [{"prompt": "q3", "answer": "4"}])
    check_signatures(["gsm8k_accuracy"], ["prompt", "answer"])


# ---- through the CLI: one line, exit 2, the checkpoint before kept; Ctrl-C ------------------------------
HANG_AT_STEP_2 = '''
import os, time

def hangs_later(completions, trainer_state, **_):
    if trainer_state.global_step >= 1 and os.path.exists(os.environ["HANG_FLAG"]):
        open(os.environ["HANG_FLAG"] + ".entered", "w").close()
        while True:
            time.sleep(0.05)
    return [float(len(c) % 3) for c in completions]
'''


@pytest.mark.slow
def test_a_hanging_reward_exits_2_and_the_run_resumes_from_the_checkpoint_before(tmp_path):
    f = tmp_path / "later.py"
    f.write_text(HANG_AT_STEP_2)
    flag = tmp_path / "hang"
    flag.touch()
    out = tmp_path / "run"
    args = ["train", *TINY, "sft.steps=0", "train.max_steps=3", "train.save_every=1", f"train.output_dir={out}",
            f"reward.functions=[{f}:hangs_later]", "reward.timeout=1"]
    env = {**os.environ, "HANG_FLAG": str(flag)}
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "grpolab.cli", *args], capture_output=True, text=True, cwd=ROOT,
                       env=env, timeout=300)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("warning:")]
    assert lines == [f"grpolab: reward error: reward function '{f}:hangs_later' did not return within "
                     f"reward.timeout = 1 s for one step's batch; make it return sooner (a timeout on its own "
                     f"network or subprocess calls), or raise reward.timeout (0 = no limit)"], r.stderr
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_1"]
    assert time.monotonic() - t0 < 120
    flag.unlink()   # the function is fixed: the run continues from step 1 to the end
    r = subprocess.run([sys.executable, "-m", "grpolab.cli", *args, "train.resume=auto"], capture_output=True,
                       text=True, cwd=ROOT, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "resuming from" in r.stderr + r.stdout and (out / "checkpoints" / "step_3").is_dir()


@pytest.mark.slow
def test_ctrl_c_stops_a_step_stuck_in_a_reward(tmp_path):
    """SIGINT while a reward hangs: training's first Ctrl-C asks to stop after the step (which never
    ends), the second stops now; within seconds, exit 130, a message that says where."""
    f = tmp_path / "later.py"
    f.write_text(HANG_AT_STEP_2)
    flag = tmp_path / "hang"
    flag.touch()
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "grpolab.cli", "train", *TINY, "sft.steps=0", "train.max_steps=3",
                             "train.save_every=1", f"train.output_dir={out}", f"reward.functions=[{f}:hangs_later]"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "HANG_FLAG": str(flag)})
    try:
        entered = tmp_path / "hang.entered"
        deadline = time.monotonic() + 240
        while not entered.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        time.sleep(0.3)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        try:   # stopping right away is fine too
            proc.wait(1.0)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=10)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err[-2000:]
    assert took < 6, took
    last = [ln for ln in err.splitlines() if ln.strip()][-1]
    # (the words are the trainer's: it names the signal and what was kept, or, when it gave none, this says where)
    assert last.startswith("grpolab: ") and len(last.split(":", 1)[1].strip()) > 10, err[-2000:]
    assert "Traceback" not in err
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_1"]


# ---- os._exit inside a reward (issue 48): one line, exit 2, not a silent exit 0 ---------------------------
EXITS = '''
import asyncio
import os
import threading


def exits(completions, **_):
    os._exit(0)


def exits_on_b(completions, **_):
    if any("b" in c for c in completions):
        os._exit(3)
    return [0.0] * len(completions)


def swallows(completions, **_):
    try:
        os._exit(0)
    except BaseException:
        pass
    return [0.0] * len(completions)


def in_a_thread(completions, **_):
    t = threading.Thread(target=os._exit, args=(0,), name="mine")
    t.start()
    t.join()
    return [0.0] * len(completions)


async def exits_async(completions, **_):
    os._exit(0)


async def swallows_async(completions, **_):
    try:
        os._exit(0)
    except BaseException:
        pass
    return [0.0] * len(completions)


def forks_a_child_that_exits(completions, **_):   # the child's os._exit is its own: exit code 5, for real
    import multiprocessing
    p = multiprocessing.get_context("fork").Process(target=os._exit, args=(5,))
    p.start()
    p.join()
    return [float(p.exitcode)] * len(completions)
'''

_EXITED = ("which would end the run as if it had finished; return the values instead (raise an exception to stop "
           "the run)")


@pytest.fixture
def exits(tmp_path):
    f = tmp_path / "exits.py"
    f.write_text(EXITS)
    return str(f)


@pytest.mark.parametrize("fn,code,where", [
    ("exits", 0, " on sample 0 (completion 'a')"),
    ("exits_on_b", 3, " on sample 1 (completion 'b')"),
    ("exits_async", 0, " on sample 0 (completion 'a')"),
    ("swallows", 0, " (in a thread of its own, or caught the SystemExit it raised)"),
    ("swallows_async", 0, " (in a thread of its own, or caught the SystemExit it raised)"),
    ("in_a_thread", 0, " (in a thread of its own, or caught the SystemExit it raised)"),
])
def test_os_exit_in_a_reward_is_a_reward_error(exits, fn, code, where, capfd, monkeypatch):
    monkeypatch.setattr(threading, "excepthook", threading.__excepthook__)   # Python's own, not pytest's
    real = os._exit
    for timeout in (0, 30):   # run plainly, and under the watchdog
        with pytest.raises(RewardError) as e:
            score(["length", f"{exits}:{fn}"], None, ["q"] * 3, ["a", "b", "c"], {}, timeout=timeout)
        assert str(e.value) == f"reward function '{exits}:{fn}' called os._exit({code}){where}, {_EXITED}"
        assert os._exit is real   # the guard is gone after the call
    assert "Traceback" not in capfd.readouterr().err   # (a thread ended by it goes quietly)


def test_a_child_the_reward_forks_still_exits_for_real(exits):
    _, per = score([f"{exits}:forks_a_child_that_exits"], None, ["q"] * 2, ["a", "b"], {})
    assert per[f"{exits}:forks_a_child_that_exits"].tolist() == [5.0, 5.0]


@pytest.mark.slow
def test_os_exit_in_a_reward_exits_2_through_the_cli(exits, tmp_path):
    out = tmp_path / "run"
    r = run_cli("train", *QUICK, f"train.output_dir={out}", f"reward.functions=[{exits}:exits]")
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])   # it was 0, with nothing said
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("warning:")]
    assert len(lines) == 1 and lines[0].startswith(f"grpolab: reward error: reward function '{exits}:exits' called "
                                                   f"os._exit(0) on sample 0 "), r.stderr
    assert lines[0].endswith(_EXITED)


# ---- a second Ctrl-C (or SIGTERM) when the interrupt cannot arrive: exit 130 at once (issue 48) ----------
STUCK = '''
import os
import time


def _entered():
    open(os.environ["HANG_FLAG"] + ".entered", "w").close()


def swallows_interrupts(completions, **_):   # a bare except around a wait: every KeyboardInterrupt is caught
    _entered()
    while True:
        try:
            time.sleep(1000)
        except:  # noqa: E722
            pass


def sleeps(completions, **_):
    _entered()
    time.sleep(1000)


def shells_out(completions, **_):   # os.system waits in C, retrying on signals: no Python handler runs
    _entered()
    os.system("echo $$ > " + os.environ["HANG_FLAG"] + ".child; exec sleep 300 </dev/null >/dev/null 2>&1")
    return [0.0] * len(completions)
'''


@pytest.mark.slow
@pytest.mark.parametrize("fn,sig", [("swallows_interrupts", signal.SIGINT), ("sleeps", signal.SIGINT),
                                    ("shells_out", signal.SIGTERM)])
def test_a_second_signal_stops_a_reward_that_keeps_the_interrupt_from_arriving(tmp_path, fn, sig):
    f = tmp_path / "stuck.py"
    f.write_text(STUCK)
    flag = tmp_path / "hang"
    out = tmp_path / "run"
    err_path = tmp_path / "stderr.txt"
    with open(err_path, "w") as err_file:
        proc = subprocess.Popen([sys.executable, "-m", "grpolab.cli", "train", *QUICK, "train.max_steps=3",
                                 "train.save_every=1", "reward.timeout=0", f"train.output_dir={out}",
                                 f"reward.functions=[{f}:{fn}]"],
                                stdout=subprocess.DEVNULL, stderr=err_file, cwd=ROOT,
                                env={**os.environ, "HANG_FLAG": str(flag)})
    try:
        entered = tmp_path / "hang.entered"
        deadline = time.monotonic() + 240
        while not entered.exists():
            assert proc.poll() is None and time.monotonic() < deadline, err_path.read_text()
            time.sleep(0.1)
        time.sleep(0.5)
        proc.send_signal(sig)
        time.sleep(0.5)
        proc.send_signal(sig)
        code = proc.wait(timeout=60)   # (it hung for good before)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        child = tmp_path / "hang.child"
        if child.exists():   # os.system's `sleep`, left behind by an exit without unwinding
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(child.read_text()), signal.SIGKILL)
    err = err_path.read_text()
    assert code == 130, err[-2000:]
    last = [ln for ln in err.splitlines() if ln.strip()][-1]
    assert last.startswith(f"grpolab: stopped at once by a second {sig.name}"), err[-2000:]
    assert last.endswith("the step in progress is not saved (the last checkpoint is intact)")
    assert "Traceback" not in err
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())


# ---- code_exec on data without tests (issue 48): refused at start, not NaN at every step -------------------
def test_code_exec_on_rows_without_tests_is_refused_at_start():
    rows = [{"prompt": "Write f.", "answer": "42"}, {"prompt": "Write g.", "answer": None}]
    with pytest.raises(RewardError) as e:
        check_signatures(["code_exec"], ["prompt", "answer"], rows=rows, source="data/code.jsonl")
    assert str(e.value) == (
        "reward function 'code_exec' runs each row's tests, but no row of data/code.jsonl has any: give a 'test' "
        "column (code defining check(candidate), with 'entry_point') or a 'test_cases' column "
        "([{\"input\", \"output\"}, ...]; verl: reward_model.ground_truth); columns found: prompt, answer")
    # one row with tests is enough (the others score None, as documented)
    check_signatures(["code_exec"], ["prompt", "answer", "test_cases"],
                     rows=rows + [{"prompt": "h", "test_cases": [{"input": "1", "output": "1"}]}])


@pytest.mark.slow
def test_code_exec_on_a_data_file_without_tests_exits_2_through_the_cli(tmp_path):
    data = tmp_path / "code.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Write f{i}.", "answer": str(i)}) + "\n" for i in range(8)))
    out = tmp_path / "run"
    r = run_cli("train", *QUICK, f"train.output_dir={out}", "data.task=files", f"data.train_path={data}",
                f"data.test_path={data}", "reward.functions=[code_exec]")
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("warning:")]
    assert len(lines) == 1 and lines[0].startswith(f"grpolab: reward error: reward function 'code_exec' runs each "
                                                   f"row's tests, but no row of {data} has any"), r.stderr
    assert not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text().strip()


SIGNALS_IN_A_CHILD = '''
import multiprocessing
import os
import signal
import time


def _signal_myself():
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)


def child_gets_signals(completions, trainer_state, **_):
    if trainer_state.global_step == 0:
        p = multiprocessing.get_context("fork").Process(target=_signal_myself)
        p.start()
        p.join()
        time.sleep(3)   # longer than the trainer waits for a second signal's interrupt to arrive
    return [float(len(c) % 3) for c in completions]
'''


@pytest.mark.slow
def test_signals_to_a_child_the_reward_forks_are_not_the_trainers(tmp_path):
    """A forked child (a multiprocessing worker that Pool.terminate() sends SIGTERM) is not the training
    loop: its signals neither ask the run to stop nor count as a second Ctrl-C."""
    f = tmp_path / "child.py"
    f.write_text(SIGNALS_IN_A_CHILD)
    r = run_cli("train", *QUICK, f"train.output_dir={tmp_path / 'run'}", f"reward.functions=[{f}:child_gets_signals]")
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert "SIGTERM" not in r.stderr and (tmp_path / "run" / "eval.json").is_file()
