"""The code task (pyfunc), the code_exec reward's program extraction and test formats, its config,
and the sandbox's start-up error, unsafe mode and Ctrl-C."""

from __future__ import annotations

import ast
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from grpolab.config.load import load_config
from grpolab.data.tasks import pyfunc
from grpolab.errors import ConfigError
from grpolab.rewards.code import code_exec, extract_program, prompt_code, stdio_cases
from grpolab.rewards.runtime import RewardRuntime
from grpolab.sandbox import SandboxError
from grpolab.sandbox.runner import _verdicts

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- the pyfunc task
def test_pyfunc_splits_are_disjoint_problems_and_generation_is_deterministic():
    train, test = pyfunc.problems("train"), pyfunc.problems("test")
    key = lambda p: (p[0][0], p[1], p[2], p[3])  # noqa: E731 - (operation, constant, function, argument)
    assert train and test and not {key(p) for p in train} & {key(p) for p in test}
    rows = pyfunc.generate("test", 50, seed=3)
    assert rows == pyfunc.generate("test", 50, seed=3)
    assert len({r["prompt"] for r in rows}) == 50
    held_out = {key(p) for p in test}
    for r in rows:   # every generated test row is one of the test split's problems
        fn, arg = r["prompt"][4:].split("(")[0], r["prompt"].split("(")[1].split(")")[0].split(",")[0]
        assert any(k[2] == fn and k[3] == arg and k[0] == r["operation"] and k[1] == r["constant"] for k in held_out)


def test_pyfunc_reference_bodies_pass_their_hidden_tests_and_guessed_bodies_fail():
    rows = pyfunc.generate("train", 40, seed=1)
    prompts = [r["prompt"] for r in rows]
    cols = dict(test=[r["test"] for r in rows], entry_point=[r["entry_point"] for r in rows])
    assert code_exec(prompts=prompts, completions=[r["answer"] for r in rows], **cols) == [1.0] * 40
    rng = random.Random(0)
    guessed = [pyfunc.guess_body(r, rng)["answer"] for r in rows]
    assert all(g != r["answer"] and g.startswith("    return ") for g, r in zip(guessed, rows))
    got = code_exec(prompts=prompts, completions=guessed, **cols)
    assert all(0.0 <= x <= 1.0 for x in got) and sum(x == 1.0 for x in got) <= 4   # another operation rarely
    #                                                                               agrees on 5 inputs


# ---------------------------------------------------------------- extraction and test formats
HUMANEVAL_LIKE = ('from typing import List\n\n\ndef helper(x):\n    return x + 1\n\n\n'
                  'def f(xs: List[int]):\n    """Doc."""\n')


def test_extract_program_takes_the_last_fenced_block_after_the_prompts_code():
    completion = ("First:\n```python\ndef f(xs):\n    return 0\n```\n"
                  "Better:\n```python\ndef f(xs: List[int]):\n    return helper(1)\n```\n")
    program = extract_program(completion, HUMANEVAL_LIKE)
    assert program == HUMANEVAL_LIKE + "\n" + "def f(xs: List[int]):\n    return helper(1)\n"
    # without a fence the completion continues the prompt's code
    assert extract_program("    return 1\n", HUMANEVAL_LIKE) == HUMANEVAL_LIKE + "    return 1\n"
    # a prompt that is not code is not put in front
    assert extract_program("print(1)", "Write a program that prints 1.") == "print(1)"
    # chat prompts: the last user message's code, or the code block inside it
    chat = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Complete this:\n```python\ndef g():\n    pass\n```"}]
    assert prompt_code(chat) == "def g():\n    pass\n"
    assert prompt_code([{"role": "user", "content": HUMANEVAL_LIKE}]) == HUMANEVAL_LIKE


def test_stdio_test_cases_in_every_accepted_form():
    want = [{"input": "1", "output": "2"}, {"input": "3\n4", "output": "7"}]
    assert stdio_cases([{"input": "1", "output": "2"}, {"input": "3\n4", "output": 7}]) == want
    assert stdio_cases({"inputs": ["1", ["3", "4"]], "outputs": ["2", "7"]}) == want
    assert stdio_cases(json.dumps({"inputs": ["1", "3\n4"], "outputs": ["2", "7"]})) == want   # verl's ground truth
    assert stdio_cases("42") is None and stdio_cases({"inputs": [], "outputs": [], "fn_name": "f"}) is None
    program = "a = [int(x) for x in open(0).read().split()]\nprint(sum(a) + (1 if len(a) == 1 else 0))\n"
    ground_truth = json.dumps({"inputs": ["1", "3\n4", "5"], "outputs": ["2", "7", "5"]})
    got = code_exec(prompts=None, completions=[program, program, "print('x')"], test_cases=[None, want, None],
                    answer=[ground_truth, None, "7"])
    assert got == [2 / 3, 1.0, None]   # verl rows via `answer`; a row without tests is not scored


# ---------------------------------------------------------------- config
def test_code_exec_config_keys_nest_under_reward_and_are_validated():
    cfg = load_config(None, ["reward.code_exec.timeout=2.5", "reward.code_exec.max_concurrent=3"])
    assert cfg.reward.code_exec.timeout == 2.5 and cfg.reward.code_exec.max_concurrent == 3
    assert cfg.to_dict()["reward"]["code_exec"]["timeout"] == 2.5
    with pytest.raises(ConfigError, match="reward.code_exec.timeout: must be > 0"):
        load_config(None, ["reward.code_exec.timeout=0"])
    with pytest.raises(ConfigError, match="did you mean reward.code_exec.max_procs"):
        load_config(None, ["reward.code_exec.max_proc=4"])
    with pytest.raises(ConfigError, match="eval.reward: data.task=pyfunc is checked by running the code"):
        load_config(None, ["data.task=pyfunc", "reward.functions=[code_exec]", "eval.reward=gsm8k_accuracy"])
    assert load_config(None, ["data.task=pyfunc", "reward.functions=[code_exec]"]).eval.reward == "code_exec"
    cfg = load_config(ROOT / "configs" / "code_demo.yaml")
    assert cfg.data.task == "pyfunc" and cfg.reward.functions == ["code_exec"] and cfg.eval.reward == "code_exec"


# ---------------------------------------------------------------- start-up error, unsafe mode, Ctrl-C
def test_a_machine_that_cannot_isolate_gets_one_line_with_the_fix():
    with pytest.raises(SandboxError) as e:
        _verdicts(b"ISOLATION unshare: Operation not permitted\n", b"", 71, 3)
    msg = str(e.value)
    assert "\n" not in msg and "unshare: Operation not permitted" in msg
    assert "kernel.unprivileged_userns_clone=1" in msg and "reward.code_exec.unsafe_no_sandbox: true" in msg


def test_unsafe_mode_warns_on_every_run_and_still_judges(capsys):
    from grpolab.config import CodeExecConfig, RewardConfig
    for _ in range(2):
        runtime = RewardRuntime.from_config(RewardConfig(code_exec=CodeExecConfig(unsafe_no_sandbox=True,
                                                                                  timeout=3.0)))
        runtime.check()
        assert "WITHOUT isolation" in capsys.readouterr().err
    test = "def check(candidate):\n    assert candidate(2) == 4\n"
    got = code_exec(prompts=None, completions=["def f(x):\n    return x * 2\n", "def f(x):\n    return x\n",
                                               "import os\nos._exit(0)\n"], test=test, entry_point="f",
                    runtime=runtime)
    assert got == [1.0, 0.0, 0.0]


CTRL_C = """
import sys, time
from grpolab.sandbox import Limits, run_programs
sleepy = ("import time\\ntime.sleep(100)\\n", {"mode": "stdio", "cases": [{"input": "", "output": ""}]})
print("started", flush=True)
run_programs([sleepy] * 4, Limits(timeout=60), max_concurrent=2)
"""


@pytest.mark.slow
def test_ctrl_c_kills_every_sandbox_at_once(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", CTRL_C], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT, env={**os.environ, "GRPOLAB_CTRL_C_TEST": str(tmp_path)})
    assert proc.stdout.readline().strip() == "started"
    _wait_for_sandboxes(str(tmp_path))
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)   # the sandboxes sleep 100 s: ending before that is "at once"
    assert "KeyboardInterrupt" in err
    _wait_gone(str(tmp_path))


@pytest.mark.slow
def test_the_sandboxes_die_with_a_killed_trainer(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", CTRL_C], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT, env={**os.environ, "GRPOLAB_CTRL_C_TEST": str(tmp_path)})
    assert proc.stdout.readline().strip() == "started"
    _wait_for_sandboxes(str(tmp_path))
    proc.kill()   # SIGKILL: no handler runs in the trainer
    proc.wait()
    _wait_gone(str(tmp_path))


def _wait_for_sandboxes(tag: str) -> None:
    """Until the script and its sandboxes run (a loaded machine starts them slowly), then a little longer."""
    deadline = time.monotonic() + 120
    while len(_sandboxes(tag)) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(_sandboxes(tag)) >= 2
    time.sleep(1.0)   # both sandboxes up and sleeping


def _wait_gone(tag: str) -> None:
    """The sandboxes end well before their 100 s sleep would (a loaded machine reaps them slowly)."""
    deadline = time.monotonic() + 30
    while _sandboxes(tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _sandboxes(tag)


def _sandboxes(tag: str) -> list[int]:
    """PIDs of this test's sandbox processes (launchers and everything under them carry its env tag)."""
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                env = Path(f"/proc/{p}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"GRPOLAB_CTRL_C_TEST={tag}".encode() in env and int(p) != os.getpid():
                out.append(int(p))
    return out


# ---------------------------------------------------------------- GRPO on the code task
def _code_run(out: Path) -> tuple[dict, list[dict]]:
    from grpolab.jobs.train import run_train
    cfg = load_config(ROOT / "configs" / "code_demo.yaml", [
        "model.n_layer=1", "model.n_head=2", "model.n_embd=32", "sft.steps=20", "sft.bare_steps=5",
        "data.train_size=200", "data.test_size=6", "rollout.prompts_per_step=4", "rollout.num_generations=2",
        "rollout.max_new_tokens=24", "eval.k=2", "eval.num_problems=6", "train.max_steps=2",
        f"train.output_dir={out}"])
    final = run_train(cfg)
    metrics = [{k: v for k, v in json.loads(line).items() if not k.startswith(("time/", "perf/"))}
               for line in (out / "metrics.jsonl").read_text().splitlines()]
    return final, metrics


@pytest.mark.slow
def test_grpo_on_pyfunc_is_scored_by_code_exec_and_bit_identical_across_runs(tmp_path):
    final, metrics = _code_run(tmp_path / "a")
    assert set(final) >= {"greedy_accuracy", "pass@1", "pass@2"} and not any(k.startswith("maj@") for k in final)
    steps = [m for m in metrics if "rewards/code_exec/mean" in m]
    assert len(steps) == 2 and all("code_exec/timeout_rate" in m for m in steps)
    assert (final, metrics) == _code_run(tmp_path / "b")


NON_ROOT = """
import importlib.util, os, sys
spec = importlib.util.spec_from_file_location("runner", sys.argv[1])
runner = importlib.util.module_from_spec(spec)
sys.modules["runner"] = runner
spec.loader.exec_module(runner)
probe = "import os\\ndef f():\\n    raise ValueError(repr((os.getuid(), sorted(os.listdir('/')))))\\n"
ok = runner.run_program("def f(x):\\n    return x + 1\\n",
                        {"mode": "check", "test": "def check(c):\\n    assert c(1) == 2\\n", "entry_point": "f"})
seen = runner.run_program(probe, {"mode": "check", "test": "def check(c):\\n    c()\\n", "entry_point": "f"})
print(os.getuid(), ok.status, seen.detail)
"""


@pytest.mark.skipif(os.geteuid() != 0 or not Path("/usr/bin/python3").exists() or not shutil.which("runuser"),
                    reason="needs root (to become another user), runuser and a system Python")
def test_an_unprivileged_trainer_gets_the_same_sandbox():
    """The non-root path: the sandbox's root maps to the trainer's own uid (here 'nobody', with the system
    Python, which that user can run); the program sees uid 0 of its namespace and the same bare root."""
    # 'nobody' may not be able to reach the checkout (a clone inside a 0700 dir, a private home): stage the
    # sandbox's files (standard library only) in a fresh dir it can read and root alone can write
    staged = Path(tempfile.mkdtemp(prefix="grpolab-sandbox-src-", dir="/tmp"))
    try:
        for src in (ROOT / "grpolab" / "sandbox").glob("*.py"):
            if src.name != "__init__.py":
                shutil.copyfile(src, staged / src.name)
                (staged / src.name).chmod(0o644)
        staged.chmod(0o755)
        out = subprocess.run(["runuser", "-u", "nobody", "--", "/usr/bin/python3", "-c", NON_ROOT,
                              str(staged / "runner.py")], capture_output=True, text=True, timeout=60, cwd="/",
                             env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8", "TMPDIR": "/tmp"})
    finally:
        shutil.rmtree(staged)
    assert out.returncode == 0, out.stderr[-2000:]
    uid, status, detail = out.stdout.strip().split(" ", 2)
    assert uid != "0" and status == "passed"
    assert detail.startswith("ValueError: ")
    ns_uid, listing = ast.literal_eval(detail[len("ValueError: "):])
    assert ns_uid == 0 and {"dev", "etc", "proc", "tmp", "usr"} <= set(listing)
    assert set(listing) <= {"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "sbin", "tmp", "usr"}
