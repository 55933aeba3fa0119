"""`grpolab sft` on a Hugging Face model: the built-in model's defaults the user left (sft.lr 3e-3, 20
warmup steps) change to TRL's values with one line, a warmup the user set longer than the run is one
line and exit 2, and the user's own rows are not evaluated on the built-in arithmetic task."""

import json

import pytest
import yaml
from conftest import run_cli

from grpolab.data.tasks import arithmetic
from grpolab.models.tiny_hf import save_tiny_model
from grpolab.train.sft import sft_lr_factor


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    rows = arithmetic.generate("train", 200, seed=0)
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", [r["prompt"] + "\n" + r["answer"] for r in rows],
                           vocab_size=300, hidden=32, layers=1, heads=2, intermediate=64)


@pytest.fixture(scope="module")
def own_rows(tmp_path_factory):
    path = tmp_path_factory.mktemp("rows") / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Say {w}.", "completion": f" {w}"}) + "\n"
                            for w in ("hi", "yes", "no", "ok") * 4))
    return path


def _sft(tiny_dir, out, *extra):
    return run_cli("sft", f"model.name_or_path={tiny_dir}", "sft.steps=3", "sft.batch_size=4",
                   "eval.num_problems=4", "eval.k=1", "train.threads=1", f"train.output_dir={out}", *extra)


def _lrs(out):
    return [json.loads(line)["lr"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_lora_on_own_rows_gets_trl_defaults_and_no_arithmetic_eval(tiny_dir, own_rows, tmp_path):
    out = tmp_path / "run"
    r = _sft(tiny_dir, out, "model.lora_rank=4", f"sft.train_path={own_rows}")
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("sft: defaults for a Hugging Face model"))
    assert "sft.lr 0.003 -> 0.0002 (TRL's LoRA example)" in line
    assert "sft.warmup_steps 20 -> 0 (a tenth of the 3 steps)" in line
    assert "sft: no eval on the built-in arithmetic task" in r.stdout
    saved = yaml.safe_load((out / "config.yaml").read_text())["sft"]
    assert saved["lr"] == 2e-4 and saved["warmup_steps"] == 0   # config.yaml records what ran
    assert _lrs(out)[0] == pytest.approx(2e-4)   # no warmup: the first step at the peak lr
    evaluated = json.loads((out / "eval.json").read_text())
    assert "greedy_accuracy" not in evaluated and "loss" not in evaluated


def test_full_fine_tuning_gets_trl_sftconfig_lr_and_a_set_lr_is_kept(tiny_dir, own_rows, tmp_path):
    r = _sft(tiny_dir, tmp_path / "full", f"sft.train_path={own_rows}", f"sft.test_path={own_rows}")
    assert r.returncode == 0, r.stderr
    assert "sft.lr 0.003 -> 2e-05 (TRL SFTConfig's default for full fine-tuning)" in r.stdout
    assert "loss" in json.loads((tmp_path / "full" / "eval.json").read_text())   # sft.test_path: a held-out loss

    r = _sft(tiny_dir, tmp_path / "set", f"sft.train_path={own_rows}", "sft.lr=1e-3", "sft.warmup_steps=2")
    assert r.returncode == 0, r.stderr
    assert "sft: defaults for" not in r.stdout
    assert _lrs(tmp_path / "set") == pytest.approx([1e-3 * sft_lr_factor(i, 2, 3) for i in range(3)])   # as set


def test_a_set_warmup_longer_than_the_run_is_one_line(tiny_dir, own_rows, tmp_path):
    out = tmp_path / "run"
    r = _sft(tiny_dir, out, f"sft.train_path={own_rows}", "sft.warmup_steps=50")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "grpolab: config error: sft.warmup_steps=50 is longer than the run's 3 steps (sft.steps): the lr would "
        "never reach sft.lr; set sft.warmup_steps <= 3"]
    assert not (out / "config.yaml").exists()


def test_the_task_eval_stays_when_the_rows_are_the_task(tiny_dir, tmp_path):
    """No sft.train_path: the run trains on the arithmetic task's rows, and is evaluated on them."""
    r = _sft(tiny_dir, tmp_path / "run", "model.lora_rank=4")
    assert r.returncode == 0, r.stderr
    assert "no eval on the built-in" not in r.stdout
    assert "greedy_accuracy" in json.loads((tmp_path / "run" / "eval.json").read_text())
