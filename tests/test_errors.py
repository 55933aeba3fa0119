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
    """(CLI args, texts the one-line message must contain: the key, file, row or function at fault
    and what is wrong) for a named bad input."""
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
        "unknown key": (["rollout.temprature=0.5"], ["unknown config key 'rollout.temprature'",
                                                     "did you mean rollout.temperature"]),
        "bad value": (["rollout.temperature=hot"], ["rollout.temperature: expected float, got 'hot'"]),
        "missing config file": ([str(tmp_path / "nope.yaml")],
                                [f"config file '{tmp_path / 'nope.yaml'}' not found"]),
        "malformed row": (files, [f"{broken}: line 2: invalid JSON"]),
        "missing column": (["data.task=files", f"data.train_path={nocol}", f"data.test_path={nocol}"],
                           [str(nocol), "row 1", "'prompt'", "data.prompt_key"]),
        "unknown reward": (["reward.functions=[accuracyy]"], ["reward.functions: unknown reward 'accuracyy'"]),
        "reward raises": ([f"reward.functions=[{rewards}:raises]"],
                          [f"{rewards}:raises' raised ZeroDivisionError: float division by zero on sample "]),
        "reward wrong count": ([f"reward.functions=[{rewards}:too_few]"],
                               [f"{rewards}:too_few'", "returned 1 values for"]),
        "reward NaN": ([f"reward.functions=[{rewards}:nan]"], [f"{rewards}:nan'", "returned nan for sample 0"]),
        "prompt too long": (["data.max_prompt_length=5", "data.on_long_prompt=error"],
                            ["row 1: prompt is ", " tokens, over data.max_prompt_length=5"]),
        "missing model": ([f"model.name_or_path={tmp_path / 'no_model'}"],
                          [str(tmp_path / "no_model"), "no config.json"]),
        "unwritable output": ([f"train.output_dir={afile / 'run'}"],
                              [f"train.output_dir: cannot write the run directory '{afile / 'run'}'",
                               f"'{afile}' is a file, not a directory"]),
        "not a checkpoint": (["train.resume=" + str(tmp_path)],
                             [f"train.resume: '{tmp_path}' is not a training checkpoint"]),
        "diverged": (["optim.lr=1e30", "optim.max_grad_norm=0", "train.max_bad_steps=0", "sft.steps=5",
                      "train.max_steps=6", "reward.functions=[length]"],
                     ["the policy's next-token probabilities are NaN/inf (the weights diverged)", "optim.lr"]),
        # the same policy sampled by a rollout worker process: the same line
        "diverged in a rollout worker": (["optim.lr=1e30", "optim.max_grad_norm=0", "train.max_bad_steps=0",
                                          "sft.steps=5", "train.max_steps=6", "reward.functions=[length]",
                                          "train.rollout_workers=1"],
                                         ["the policy's next-token probabilities are NaN/inf (the weights diverged)",
                                          "optim.lr"]),
    }
    args, want = cases[name]
    if name == "missing config file":
        return ["train", *args], want
    return ["train", *QUICK, out, *args], want


@pytest.mark.slow
@pytest.mark.parametrize("name", ["unknown key", "bad value", "missing config file", "malformed row",
                                  "missing column", "unknown reward", "reward raises", "reward wrong count",
                                  "reward NaN", "prompt too long", "missing model", "unwritable output",
                                  "not a checkpoint", "diverged", "diverged in a rollout worker"])
def test_bad_input_gives_one_clear_line(name, tmp_path):
    args, want = _case(name, tmp_path)
    r = run_cli(*args)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("warning:")]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("grpolab: "), lines[0]
    for text in want:
        assert text in lines[0], (text, lines[0])
    assert "Traceback" not in r.stderr


def test_debug_flag_shows_the_traceback(tmp_path):
    r = run_cli("--debug", "train", *QUICK, "reward.functions=[accuracyy]")
    assert r.returncode != 0 and "Traceback" in r.stderr


@pytest.mark.slow
def test_resume_refuses_a_checkpoint_holding_a_pickled_object(tmp_path):
    """optimizer.pt loads with weights_only=True: a pickled object is refused in one line, never run."""
    import torch
    from test_grpo import make_trainer
    from test_trainer_checkpoint import _Payload, reseal
    tr = make_trainer(tmp_path / "run", "sft.steps=0", "reward.functions=[length]")
    tr.train_step()
    ckpt = tr.save()
    marker = tmp_path / "was_run"
    torch.save({"optimizer": _Payload(marker), "scheduler": None}, ckpt / "optimizer.pt")
    reseal(ckpt)   # a consistent manifest: the weights_only refusal behind it must still hold
    r = run_cli("train", *QUICK, f"train.output_dir={tmp_path / 'run'}", f"train.resume={ckpt}")
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("warning:")]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith(f"grpolab: checkpoint error: {ckpt / 'optimizer.pt'}: refusing to load it"), lines[0]
    assert "it holds io.open" in lines[0]   # names what it refused
    assert not marker.exists()
