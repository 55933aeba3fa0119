"""The Python API's edges: save_model into the run directory as TRL's idiom does, the run lock and a resume's rows,
every peft LoraConfig field, every TRL field's type at construction, the trainer's state after Ctrl-C, and
evaluate() right after train() (grpolab/api/, docs/python-api.md)."""

import dataclasses
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest
import torch
from api_rewards import reward_len
from conftest import ROOT
from safetensors.torch import load_file

import grpolab
from grpolab import GRPOConfig, GRPOTrainer
from grpolab.data.tasks import arithmetic
from grpolab.errors import ConfigError
from grpolab.models.tiny_hf import save_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    rows = arithmetic.generate("train", 200, seed=0)
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", [r["prompt"] + "\n" + r["answer"] for r in rows],
                           vocab_size=300, hidden=32, layers=2, heads=2, intermediate=64)


def _rows(n: int, seed: int = 3, answers: bool = False) -> list[dict]:
    return [{"prompt": r["prompt"], **({"answer": r["answer"]} if answers else {})}
            for r in arithmetic.generate("train", n, seed=seed)]


def _args(out, **fields) -> GRPOConfig:
    return GRPOConfig(**{"output_dir": str(out), "per_device_train_batch_size": 4, "num_generations": 4,
                         "max_completion_length": 6, "max_steps": 1, "learning_rate": 1e-2, "train.threads": 1,
                         **fields})


def _trainer(tiny, out, rows=None, **kw) -> GRPOTrainer:
    fields = {k: kw.pop(k) for k in list(kw) if k not in ("peft_config", "callbacks", "eval_dataset")}
    return GRPOTrainer(model=str(tiny), reward_funcs=reward_len, train_dataset=rows or _rows(8),
                       args=_args(out, **fields), **kw)


def _files(d) -> dict[str, str]:
    """Every file under `d` (relative path: sha256)."""
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*"))
            if p.is_file()}


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([[1, 2, 3, 4, 5]])).logits


# ---------------------------------------------------------------- save_model

@pytest.mark.parametrize("lora", [False, True])
def test_save_model_into_the_run_directory_keeps_the_run_and_loads_as_trl_s_does(tiny, tmp_path, lora):
    """TRL's idiom `trainer.save_model(args.output_dir)`: the run stays whole (checkpoints, metrics, config, inputs)
    and the directory loads as the trained model: with transformers, or with LoRA with peft onto the base model."""
    from peft import LoraConfig, PeftModel
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    peft = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear") if lora else None
    trainer = _trainer(tiny, run, peft_config=peft)
    trainer.train()
    before = _files(run)
    assert trainer.save_model(str(run)) == str(run)
    after = _files(run)
    assert {k: after.get(k) for k in before} == before   # nothing of the run removed or changed
    assert not (run / "optimizer.pt").exists() and not (run / "rng.pt").exists()   # no training state
    ckpt = run / "checkpoints" / "step_1"
    if lora:
        base = AutoModelForCausalLM.from_pretrained(str(tiny))
        saved = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tiny)), str(run))
        at_ckpt = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tiny)), str(ckpt))
        assert not torch.equal(_logits(saved), _logits(base))   # the trained adapter, loaded
    else:
        saved, at_ckpt = (AutoModelForCausalLM.from_pretrained(str(p)) for p in (run, ckpt))
        assert load_file(str(run / "model.safetensors")).keys() == load_file(str(ckpt / "model.safetensors")).keys()
    assert torch.equal(_logits(saved), _logits(at_ckpt))


def test_save_model_removes_nothing_and_refuses_the_checkpoints_and_a_mix_of_two_models(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    trainer = _trainer(tiny, run)
    trainer.train()
    ckpt = run / "checkpoints" / "step_1"
    kept = _files(run)
    for target in (ckpt, ckpt / "export", run / "checkpoints", run / "checkpoints" / "final"):
        with pytest.raises(ConfigError, match=r"^save_model: .* is inside the run's checkpoints"):
            trainer.save_model(str(target))
    assert _files(run) == kept and not (ckpt / "export").exists()
    # a directory of the user's own files: the model files are copied in beside them
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("my notes")
    trainer.save_model(str(mine))
    assert (mine / "notes.txt").read_text() == "my notes"
    AutoModelForCausalLM.from_pretrained(str(mine))
    trainer.save_model(str(mine))   # again: the same files replaced
    # another model's weights that the copy would not replace: refused, nothing touched
    other = tmp_path / "other"
    other.mkdir()
    (other / "adapter_config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"^save_model: .*other holds adapter_config.json"):
        trainer.save_model(str(other))
    assert sorted(p.name for p in other.iterdir()) == ["adapter_config.json"]
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(ConfigError, match=r"^save_model: .*a_file"):
        trainer.save_model(str(tmp_path / "a_file"))
    assert trainer.save_model() == str(run / "final") and (run / "final" / "model.safetensors").is_file()


# ---------------------------------------------------------------- the run lock and a resume's rows

def test_a_trainer_refused_by_the_run_lock_writes_nothing_into_the_live_run(tiny, tmp_path):
    run = tmp_path / "run"
    (run / "inputs").mkdir(parents=True)
    live = "".join(json.dumps(r) + "\n" for r in _rows(8, seed=1))
    (run / "inputs" / "train.jsonl").write_text(live)
    holder = subprocess.Popen(   # another process holds the run, as a live `grpolab train` does
        [sys.executable, "-c", "import sys; from grpolab.config import Config; from grpolab.train.run import Run; "
         "c = Config(); c.train.output_dir = sys.argv[1]; Run(c).lock(); print('held', flush=True); sys.stdin.read()",
         str(run)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert holder.stdout.readline().strip() == "held"
        second = _trainer(tiny, run, rows=_rows(8, seed=2), eval_dataset=_rows(4, seed=5, answers=True))
        with pytest.raises(ConfigError, match="is in use by another grpolab run"):
            second.train()
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    assert (run / "inputs" / "train.jsonl").read_text() == live
    assert sorted(p.name for p in (run / "inputs").iterdir()) == ["train.jsonl"]


def test_resuming_on_other_rows_than_the_run_s_is_refused_and_on_its_own_rows_continues(tiny, tmp_path):
    run = tmp_path / "run"
    rows = _rows(8, seed=1)
    _trainer(tiny, run, rows=rows).train()
    inputs = (run / "inputs" / "train.jsonl").read_text()
    other = _trainer(tiny, run, rows=_rows(8, seed=2), max_steps=2)
    with pytest.raises(ConfigError, match=r"^train_dataset: other rows than the run .* was trained on"):
        other.train(resume_from_checkpoint=True)
    assert (run / "inputs" / "train.jsonl").read_text() == inputs
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 1
    same = _trainer(tiny, run, rows=rows, max_steps=2)
    same.train(resume_from_checkpoint=True)
    assert same.state.global_step == 2 and [r["step"] for r in same.state.log_history] == [1, 2]


# ---------------------------------------------------------------- peft's LoraConfig

def test_every_lora_config_field_is_mapped_refused_or_without_effect(tiny, tmp_path):
    """peft's LoraConfig fields, listed from the dataclass: a field added by a newer peft fails here until
    grpolab/api/lora_fields.py says what it does."""
    from peft import LoraConfig

    from grpolab.api.lora_fields import LORA_INERT, LORA_MAPPED, LORA_UNSUPPORTED, lora_settings

    fields = {f.name for f in dataclasses.fields(LoraConfig)}
    assert fields <= set(LORA_MAPPED) | set(LORA_UNSUPPORTED) | set(LORA_INERT), \
        fields - set(LORA_MAPPED) - set(LORA_UNSUPPORTED) - set(LORA_INERT)
    plain = LoraConfig(r=4, target_modules="all-linear")
    assert lora_settings(plain)["model.lora_rank"] == 4
    for name, (default, other, _) in LORA_UNSUPPORTED.items():
        if name not in fields:
            continue
        assert getattr(plain, name) == default, name   # peft's default, accepted
        cfg = LoraConfig(r=4, target_modules="all-linear")
        setattr(cfg, name, other)
        with pytest.raises(ConfigError, match=rf"^peft_config\.{name}=.*not supported by grpolab"):
            lora_settings(cfg)
    for kw in ({"exclude_modules": ["q_proj"]}, {"lora_bias": True}):   # through the trainer, as a user gives them
        with pytest.raises(ConfigError, match=rf"^peft_config\.{next(iter(kw))}="):
            _trainer(tiny, tmp_path, peft_config=LoraConfig(r=4, target_modules="all-linear", **kw))


# ---------------------------------------------------------------- field types, at construction

def _wrong(default):
    """Values of another type than a field's TRL default (bool before int: a bool is an int to Python)."""
    if isinstance(default, bool):
        return [1, "yes", object()]
    if isinstance(default, int):
        return [2.5, "3", True, object()]
    if isinstance(default, float):
        return ["abc", "1e-5", False, object()]
    if isinstance(default, str):
        return [3, object()]
    return [object()]


@pytest.mark.parametrize("name", ["GRPOConfig", "SFTConfig", "DPOConfig", "RewardConfig"])
def test_every_field_of_another_type_than_trl_s_default_is_one_error_at_construction(name):
    config = getattr(grpolab, name)
    for field, default in config.FIELDS.items():
        if isinstance(default, int) and "float" in config.KINDS.get(field, ()):   # TRL's 0 of a float field
            default = float(default)
        for value in _wrong(default):
            with pytest.raises(ConfigError, match=rf"^{name}\.{field}=.*: expected "):
                config(**{field: value})
    config(max_steps=3.0, num_train_epochs=2, warmup_steps=0.1)   # a whole float for an int; an int for a float


def test_the_issue_s_values_are_refused_at_construction_as_trl_refuses_them():
    for fields, what in (({"max_steps": 2.7}, "max_steps=2.7: expected a whole number"),
                         ({"max_steps": "10"}, "max_steps='10': expected a whole number"),
                         ({"num_generations": "2"}, "num_generations='2': expected a whole number"),
                         ({"learning_rate": "abc"}, "learning_rate='abc': expected a number"),
                         ({"save_steps": 0.5}, "save_steps=0.5: expected a whole number"),
                         ({"per_device_train_batch_size": 6, "num_generations": 4}, "divisible by num_generations"),
                         ({"num_generations": 1}, "num_generations >= 2"),
                         ({"bf16": True, "fp16": True}, "bf16 and fp16 are both set")):
        with pytest.raises(ConfigError, match=what):
            GRPOConfig(**fields)
    with pytest.raises(ConfigError, match="SFTConfig.max_length=1.5: expected a whole number or None"):
        grpolab.SFTConfig(max_length=1.5)


def test_an_output_dir_that_is_a_file_or_under_one_is_one_error_at_construction(tiny, tmp_path):
    (tmp_path / "f").write_text("x")
    for out in (tmp_path / "f", tmp_path / "f" / "run"):
        with pytest.raises(ConfigError, match=r"^train.output_dir: cannot write the run directory .* is a file"):
            _trainer(tiny, out)
    assert (tmp_path / "f").read_text() == "x"


@pytest.mark.slow
def test_a_read_only_output_dir_is_one_error_at_construction(tiny):
    """A directory its user cannot write. Root writes everywhere: as root the trainer runs without the capabilities
    that let it (setpriv drops them), so the directory's mode holds for it as for any user."""
    prefix = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("root needs setpriv to run without its file-permission capabilities")
        prefix = ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner"]
    parent = tempfile.mkdtemp(dir="/tmp")
    os.chmod(parent, 0o555)
    code = ("import sys; from grpolab import GRPOConfig, GRPOTrainer\n"
            "try:\n"
            "    GRPOTrainer(model=sys.argv[1], reward_funcs='math_accuracy', train_dataset=[{'prompt': 'x'}], "
            "args=GRPOConfig(output_dir=sys.argv[2], num_generations=2))\n"
            "except Exception as e:\n"
            "    print(type(e).__name__, e)\n")

    try:
        r = subprocess.run([*prefix, sys.executable, "-c", code, str(tiny), os.path.join(parent, "run")], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
    finally:
        os.chmod(parent, 0o755)
        os.rmdir(parent)
    assert r.stdout.startswith("ConfigError train.output_dir: cannot write the run directory"), r.stdout + r.stderr
    assert "Permission denied" in r.stdout


# ---------------------------------------------------------------- state after Ctrl-C; evaluate after train

def test_after_ctrl_c_the_state_is_the_saved_step_and_evaluate_scores_that_checkpoint(tiny, tmp_path):
    """A real SIGINT to this process (sent by a callback after step 1): the trainer finishes step 2, saves it and
    raises KeyboardInterrupt; the trainer's state then says step 2, and evaluate() runs the eval the run did not."""

    class CtrlC:
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                os.kill(os.getpid(), signal.SIGINT)

    trainer = _trainer(tiny, tmp_path, rows=_rows(8, answers=True), max_steps=3, callbacks=[CtrlC()],
                       eval_dataset=_rows(4, seed=6, answers=True),
                       **{"eval.k": 2, "eval.reward": "gsm8k_accuracy"})
    with pytest.raises(KeyboardInterrupt, match="checkpoint saved"):
        trainer.train()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_2"]
    assert trainer.state.global_step == 2 and trainer.state.max_steps == 3
    assert [r["step"] for r in trainer.state.log_history] == [1, 2]
    scores = trainer.evaluate()   # step 2 logged no eval: it is run now
    assert {"eval_greedy_accuracy", "eval_pass@1", "eval_pass@2", "eval_maj@2"} <= set(scores)
    assert json.loads((tmp_path / "evaluate" / "eval.json").read_text()) == {k[5:]: v for k, v in scores.items()}


def test_evaluate_right_after_train_returns_the_final_eval_the_run_logged(tiny, tmp_path):
    trainer = GRPOTrainer(model=str(tiny), reward_funcs="gsm8k_accuracy", train_dataset=_rows(8, answers=True),
                          eval_dataset=_rows(4, seed=6, answers=True),
                          args=_args(tmp_path, max_steps=2, **{"eval.k": 2}))
    final = trainer.train()
    last = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 2 and {f"eval/{k}": v for k, v in final.items()}.items() <= last.items()
    assert trainer.evaluate() == {f"eval_{k}": v for k, v in final.items()}
    assert not (tmp_path / "evaluate").exists()   # not run again
