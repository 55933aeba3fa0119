"""Bad input through the real CLI: one clear line on stderr, exit code 2, no traceback."""

import json

import pytest

from conftest import run_cli
from test_grpo import TINY

QUICK = TINY + ["sft.steps=0", "train.max_steps=2"]

BAD_REWARDS = """
def raises(prompts, completions, **_):
    return [1.0 / (len(c) % 3) for c in completions]   # ZeroDivisionError on some completions
def too_few(prompts, completions, **_):
    return [0.0]
def nan(prompts, completions, **_):
    return [float("nan")] * len(completions)
"""


def _case(name, tmp_path):
    """(CLI args, text the one-line message must contain) for a named bad input."""
    rewards = tmp_path / "bad_rewards.py"
    rewards.write_text(BAD_REWARDS)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": \n')
    nocol = tmp_path / "nocol.jsonl"
    nocol.write_text(json.dumps({"question": "a", "answer": "1"}) + "\n")
    afile = tmp_path / "afile"
    afile.write_text("x")
    out = f"train.output_dir={tmp_path / 'run'}"
    files = ["data.task=files", f"data.train_path={broken}", f"data.test_path={broken}"]
    cases = {
        "unknown key": (["rollout.temprature=0.5"], "did you mean rollout.temperature"),
        "bad value": (["rollout.temperature=hot"], "rollout.temperature: expected float"),
        "missing config file": ([str(tmp_path / "nope.yaml")], "nope.yaml' not found"),
        "malformed row": (files, "broken.jsonl"),
        "missing column": (["data.task=files", f"data.train_path={nocol}", f"data.test_path={nocol}"],
                           "prompt"),
        "unknown reward": (["reward.functions=[accuracyy]"], "unknown reward 'accuracyy'"),
        "reward raises": ([f"reward.functions=[{rewards}:raises]"], ":raises' raised ZeroDivisionError: float division by zero on sample "),
        "reward wrong count": ([f"reward.functions=[{rewards}:too_few]"], "returned 1 values for"),
        "reward NaN": ([f"reward.functions=[{rewards}:nan]"], "returned nan for sample 0"),
        "prompt too long": (["data.max_prompt_length=5", "data.on_long_prompt=error"], "over data.max_prompt_length=5"),
        "missing model": ([f"model.name_or_path={tmp_path / 'no_model'}"], "no config.json"),
        "unwritable output": ([f"train.output_dir={afile / 'run'}"], "afile"),
        "not a checkpoint": (["train.resume=" + str(tmp_path)], "is not a training checkpoint"),
        "diverged": (["optim.lr=1e30", "optim.max_grad_norm=0", "train.max_bad_steps=0", "sft.steps=5",
                      "train.max_steps=6", "reward.functions=[length]"], "are NaN/inf (the weights diverged)"),
    }
    args, want = cases[name]
    if name == "missing config file":
        return ["train", *args], want
    return ["train", *QUICK, out, *args], want


@pytest.mark.parametrize("name", ["unknown key", "bad value", "missing config file", "malformed row",
                                  "missing column", "unknown reward", "reward raises", "reward wrong count",
                                  "reward NaN", "prompt too long", "missing model", "unwritable output",
                                  "not a checkpoint", "diverged"])
def test_bad_input_gives_one_clear_line(name, tmp_path):
    args, want = _case(name, tmp_path)
    r = run_cli(*args)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("warning:")]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("grpolab: ") and want in lines[0], lines[0]
    assert "Traceback" not in r.stderr


def test_debug_flag_shows_the_traceback(tmp_path):
    r = run_cli("--debug", "train", *QUICK, "reward.functions=[accuracyy]")
    assert r.returncode != 0 and "Traceback" in r.stderr
