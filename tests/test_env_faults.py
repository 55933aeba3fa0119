"""Environments that misbehave, and environment settings that cannot work, end a command with one line and exit
code 2: os._exit inside an environment, faults in close() and first_prompt(), a reply with an unknown role, a
timeout past the ceiling, the `env` reward without an environment, the eval's code_exec on rows without tests,
reasoning-gym sizes past the ceiling and config values of the wrong type.

The faults run through the real CLI entry (`grpolab.cli.main`) on a tiny chat model, with the environments in a
Python file written by the test (and tests/env_cases.py's Raises and Hangs). All of them run in ONE subprocess,
one `main` call each (a fault that ends the process early, as an unguarded os._exit does, leaves the later calls
without a record)."""

import json
import subprocess
import sys
import textwrap

import pytest
from conftest import ROOT

from grpolab.cli import main
from grpolab.config.load import load_config
from grpolab.config.validate import MAX_GENERATED_ROWS, MAX_TIMEOUT
from grpolab.errors import ConfigError
from grpolab.models.tiny_hf import save_tiny_model

ENVS = '''
import os

from grpolab.envs.environment import Environment, Reply


class Fine(Environment):
    def step(self, text):
        return Reply([{"role": "user", "content": "again"}], 0.0, False)

    def first_prompt(self, seed):
        return [{"role": "user", "content": f"guess my number {seed}"}]


class ExitInStep(Fine):
    def step(self, text):
        os._exit(0)


class ExitInReset(Fine):
    def reset(self, row):
        os._exit(3)


class SwallowsExit(Fine):
    def step(self, text):
        try:
            os._exit(0)
        except SystemExit:
            pass
        return super().step(text)


class CloseRaises(Fine):
    def close(self):
        raise RuntimeError("the door is stuck")


class Banana(Fine):
    def step(self, text):
        return Reply([{"role": "banana", "content": "hi"}], 0.0, False)


class NoPrompt(Fine):
    def first_prompt(self, seed):
        return None


class PromptRaises(Fine):
    def first_prompt(self, seed):
        raise KeyError("no such level")
'''

# each main() call's exit code and what it wrote to stderr, appended to a file as soon as it returns
DRIVER = textwrap.dedent('''
    import contextlib, io, json, sys, traceback
    from grpolab.cli import main
    runs, record = json.load(open(sys.argv[1])), sys.argv[2]
    for name, argv in runs:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except BaseException:
                traceback.print_exc()
                code = "raised"
        with open(record, "a") as f:
            f.write(json.dumps({"name": name, "code": code, "stderr": err.getvalue()}) + "\\n")
''')

# (environment class, what its one line says, extra overrides); Raises and Hangs are tests/env_cases.py's
FAULTS = [
    ("ExitInStep", "step of turn 1: called os._exit(0)", []),
    ("ExitInReset", "reset: called os._exit(3)", []),
    ("SwallowsExit", "called os._exit(0)", []),
    ("Raises", "raised ValueError: the board is on fire", []),
    ("CloseRaises", "close: raised RuntimeError: the door is stuck", []),
    ("Banana", "role must be one of system, developer, user, assistant, tool, got 'banana'", []),
    ("NoPrompt", "first_prompt(0) returned None", ["data.task=env", "data.train_path=null", "data.train_size=2"]),
    ("PromptRaises", "first_prompt(0): raised KeyError: 'no such level'",
     ["data.task=env", "data.train_path=null", "data.train_size=2"]),
    ("Hangs", "no answer within env.timeout=1s", ["env.timeout=1"]),   # last: its thread sleeps on
]
CASES = ROOT / "tests" / "env_cases.py"


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """An untrained tiny Llama with a chat template: its turns run to the token budget, and are stepped then."""
    return save_tiny_model(tmp_path_factory.mktemp("env_faults_model"), layers=1, hidden=32, heads=2,
                           intermediate=64)


def _rows(tmp_path, rows):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _train_argv(model, rows, envs, cls, out, *extra):
    return ["train", f"model.name_or_path={model}", "data.task=files", f"data.train_path={rows}",
            f"env.name={envs}:{cls}", "env.max_turns=2", "reward.functions=[env]", "rollout.prompts_per_step=2",
            "rollout.num_generations=2", "rollout.max_new_tokens=6", "rollout.max_completion_tokens=40",
            "eval.num_problems=0", "train.threads=1", "train.max_steps=1", f"train.output_dir={out}", *extra]


def test_every_environment_fault_ends_the_run_with_one_line_naming_it_and_exit_2(chat_model, tmp_path):
    """os._exit(0) and os._exit(3) (in step, in reset, and one the environment catches), a raise, a hang past
    env.timeout, close() raising, a reply with an unknown role, first_prompt() returning None or raising: each
    `grpolab train` stops with exit 2 and one line naming the environment, no traceback."""
    envs = tmp_path / "faulty_envs.py"
    envs.write_text(ENVS)
    rows = _rows(tmp_path, [{"prompt": [{"role": "user", "content": "guess my number"}], "answer": a}
                            for a in ("7", "3")])
    where = {cls: CASES if cls in ("Raises", "Hangs") else envs for cls, _, _ in FAULTS}
    runs = [(cls, _train_argv(chat_model, rows, where[cls], cls, tmp_path / cls, *extra)) for cls, _, extra in FAULTS]
    (tmp_path / "runs.json").write_text(json.dumps(runs))
    record = tmp_path / "record.jsonl"
    r = subprocess.run([sys.executable, "-c", DRIVER, str(tmp_path / "runs.json"), str(record)], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    got = {x["name"]: x for x in map(json.loads, record.read_text().splitlines())} if record.exists() else {}
    assert list(got) == [cls for cls, _, _ in FAULTS], (r.returncode, r.stderr[-2000:], got)
    assert r.returncode == 0 and r.stderr == ""
    for cls, says, _ in FAULTS:
        lines = got[cls]["stderr"].strip().splitlines()
        assert got[cls]["code"] == 2 and len(lines) == 1, (cls, got[cls])
        assert lines[0].startswith(f"grpolab: env error: environment {where[cls]}:{cls}: "), (cls, lines)
        assert says in lines[0], (cls, lines)
        assert not (tmp_path / cls / "metrics.jsonl").exists() or not (tmp_path / cls / "metrics.jsonl").read_text()


def test_the_env_reward_without_an_environment_is_refused():
    """reward.functions=[env] (or eval.reward=env) without env.name scored every episode None: reward NaN, loss 0
    at every step, exit 0."""
    with pytest.raises(ConfigError, match=r"^reward.functions: env scores an environment's episodes; set env.name"):
        load_config(None, ["reward.functions=[env]"])
    with pytest.raises(ConfigError, match=r"^eval.reward: env scores an environment's episodes; set env.name"):
        load_config(None, ["eval.reward=env"])


@pytest.mark.parametrize("key", ["env.timeout", "rollout.tool_timeout"])
def test_a_timeout_past_the_ceiling_is_refused(key):
    """1e30 seconds overflowed Python's timers (an OverflowError traceback at the first step)."""
    env = ["env.name=textarena:GuessTheNumber-v0"] if key == "env.timeout" else []
    with pytest.raises(ConfigError, match=rf"^{key}: must be > 0 and at most {MAX_TIMEOUT:.0f} seconds"):
        load_config(None, [*env, f"{key}=1e30"])
    load_config(None, [*env, f"{key}={MAX_TIMEOUT:.0f}"])   # the ceiling itself is allowed


@pytest.mark.parametrize("key", ["train_size", "test_size"])
@pytest.mark.parametrize("task", ["reasoning_gym:gcd", "env"])
def test_generated_rows_past_the_ceiling_are_refused(task, key):
    """data.train_size=100000000 built reasoning-gym rows for minutes and gigabytes before anything else."""
    env = ["env.name=textarena:GuessTheNumber-v0", "reward.functions=[env]"] if task == "env" else \
        ["reward.functions=[reasoning_gym]"]
    with pytest.raises(ConfigError, match=rf"^data.{key}: {MAX_GENERATED_ROWS + 1} is more than the "
                                          rf"{MAX_GENERATED_ROWS} rows data.task={task} may generate"):
        load_config(None, [f"data.task={task}", *env, f"data.{key}={MAX_GENERATED_ROWS + 1}"])
    load_config(None, [f"data.task={task}", *env, f"data.{key}={MAX_GENERATED_ROWS}"])


@pytest.mark.parametrize("value", ["x", "2.5", "null", "[1]", "true"])
def test_a_reasoning_gym_config_value_of_the_wrong_type_names_its_field(value, capsys):
    """gcd's max_value: 'x' was refused as "'>' not supported between instances of 'str' and 'int'"."""
    pytest.importorskip("reasoning_gym")
    assert main(["train", "data.task=reasoning_gym:gcd", f"data.task_config={{max_value: {value}}}",
                 "reward.functions=[reasoning_gym]", "data.train_size=4", "data.test_size=2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("grpolab: config error: data.task_config.max_value: gcd's max_value "
                                               "is a whole number (default 1000), got "), err


def test_the_eval_check_code_exec_on_rows_without_tests_is_refused(chat_model, tmp_path, capsys):
    """eval.reward=code_exec on held-out rows without tests scored every eval metric 0.0 (the training reward
    code_exec on such rows is refused); `grpolab train` and `grpolab eval` both refuse it in one line."""
    rows = _rows(tmp_path, [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(4)])
    common = [f"data.train_path={rows}", f"data.test_path={rows}", "eval.reward=code_exec", "eval.num_problems=2",
              "eval.k=1", "rollout.max_new_tokens=4"]
    says = ("grpolab: reward error: eval.reward=code_exec runs each row's tests, but no row of the held-out rows "
            "has any: give a 'test' column")
    assert main(["train", f"model.name_or_path={chat_model}", "data.task=files", "reward.functions=[gsm8k_accuracy]",
                 "rollout.prompts_per_step=2", "rollout.num_generations=2", "train.threads=1", "train.max_steps=1",
                 f"train.output_dir={tmp_path / 'run'}", *common]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(says), err
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert not metrics.exists() or not metrics.read_text()
    assert main(["eval", str(chat_model), "data.task=files", "--out", str(tmp_path / "eval"), *common]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(says), err
    assert not (tmp_path / "eval" / "eval.json").exists()
