"""`GRPOTrainer(model=..., reward_funcs=..., train_dataset=..., args=GRPOConfig(...)).train()`: TRL's shape over
`grpolab train`. The trainer writes what it was handed into the run directory (the data as JSON lines, a loaded
model as a Hugging Face directory), builds the same Config the command line would, and runs the same job: the
same run directory, metrics, checkpoints, resume, Ctrl-C handling and bits."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import Config
from ..config.load import _flatten, config_from_dict, read_yaml
from ..errors import ConfigError
from ..jobs.train import run_train
from .inputs import lora_settings, reward_specs, rows_of, write_rows
from .trl_fields import SUPPORTED, check_fields, grpo_settings


class GRPOConfig:
    """TRL's GRPOConfig fields (docs/python-api.md lists each with its grpolab key, or why it is refused) and
    grpolab's own config keys in dotted form: `GRPOConfig(learning_rate=1e-5, **{"rollout.top_k": 20})`.
    Fields not given take TRL's defaults; dotted keys are applied last and win."""

    def __init__(self, **fields: Any) -> None:
        check_fields(fields, "GRPOConfig")
        self.fields = {k: v for k, v in fields.items() if "." not in k}
        self.keys = {k: v for k, v in fields.items() if "." in k}

    def __getattr__(self, name: str) -> Any:
        if name in SUPPORTED:
            return self.__dict__["fields"].get(name, SUPPORTED[name])
        raise AttributeError(name)

    def __repr__(self) -> str:
        return f"GRPOConfig({', '.join(f'{k}={v!r}' for k, v in {**self.fields, **self.keys}.items())})"


@dataclass
class TrainerState:
    """What TRL's `trainer.state` holds that grpolab has: the step reached and one dict per step of metrics.jsonl."""
    global_step: int = 0
    max_steps: int = 0
    log_history: list[dict] = field(default_factory=list)


def _settings(args: Any) -> tuple[dict[str, Any], GRPOConfig | None]:
    """(grpolab's dotted keys given outright, the TRL-shaped config or None) for `args`: a GRPOConfig, a dict of
    dotted keys (or nested sections), a YAML file's path, or None (TRL's defaults)."""
    if args is None:
        return {}, GRPOConfig()
    if isinstance(args, GRPOConfig):
        return dict(args.keys), args
    if isinstance(args, dict):
        return _flatten(args), None
    if isinstance(args, (str, Path)):
        return _flatten(read_yaml(args)), None
    raise ConfigError(f"args: give a GRPOConfig, a dict of config keys or a YAML path, not {type(args).__name__}")


class GRPOTrainer:
    """GRPO (and its family: `loss_type`, `importance_sampling_level`, grpolab's algorithm.* keys) on a model.

    model: a Hugging Face model directory or hub id, "builtin", or a loaded `transformers` model (saved once
    into <output_dir>/inputs/model); reward_funcs: one or a list of functions with TRL's signature
    (prompts, completions, **columns) -> list[float | None], or grpolab reward specs ("math_accuracy",
    "file.py:fn", "verl:...", "rm:<model>"); train_dataset / eval_dataset: a `datasets.Dataset`, a list of dicts
    or a data file's path (a "prompt" column, text or a conversation; other columns reach the rewards by name);
    args: a GRPOConfig, a dict of grpolab keys or a YAML path; peft_config: a peft LoraConfig;
    processing_class: the tokenizer saved with a loaded model.
    """

    def __init__(self, model: Any, reward_funcs: Any, args: Any = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, peft_config: Any = None,
                 callbacks: list | None = None) -> None:
        if train_dataset is None:
            raise ConfigError("GRPOTrainer: train_dataset is required (prompts to sample from)")
        if callbacks:
            raise ConfigError("GRPOTrainer: callbacks are not supported yet; read trainer.state.log_history or "
                              "<output_dir>/metrics.jsonl")
        funcs = reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        if not funcs:
            raise ConfigError("GRPOTrainer: reward_funcs lists no reward")
        self.model, self.processing_class = model, processing_class
        self.funcs = list(funcs)
        reward_specs(self.funcs)   # a bad entry fails here, before any work
        self.train_rows = rows_of(train_dataset, "train_dataset")
        self.eval_rows = None if eval_dataset is None else rows_of(eval_dataset, "eval_dataset")
        self.given, self.trl = _settings(args)
        self.lora = lora_settings(peft_config)
        self.state = TrainerState()
        self.config: Config | None = None
        self.final_eval: dict | None = None

    def _config(self, resume: Any) -> Config:
        """The run's Config: TRL's fields mapped, then the inputs, then the dotted keys given outright."""
        out = Path(self.given.get("train.output_dir") or
                   (self.trl.output_dir if self.trl is not None else Config().train.output_dir))
        inputs = out / "inputs"
        train = (self.train_rows if isinstance(self.train_rows, str)
                 else write_rows(self.train_rows, inputs / "train.jsonl"))
        keys: dict[str, Any] = {}
        if self.trl is not None:
            n_train = 0 if isinstance(self.train_rows, str) else len(self.train_rows)
            n_eval = 0 if self.eval_rows is None else (len(self.eval_rows) if isinstance(self.eval_rows, list) else 1)
            if n_train == 0 and not (self.trl.max_steps and self.trl.max_steps > 0):
                raise ConfigError("GRPOConfig: with a train_dataset given as a path, set max_steps (the epochs need "
                                  "the row count)")
            keys.update(grpo_settings(self.trl.fields, n_train, n_eval))
            keys.update({"data.train_size": 0, "data.answer_key": _answer_key(self.train_rows)})
        keys.update({"data.task": "files", "data.train_path": train, "reward.functions": reward_specs(self.funcs)})
        if self.eval_rows is not None:
            keys["data.test_path"] = (self.eval_rows if isinstance(self.eval_rows, str)
                                      else write_rows(self.eval_rows, inputs / "eval.jsonl"))
            if isinstance(self.eval_rows, str) and self.trl is not None:
                keys["eval.num_problems"] = Config().eval.num_problems
        keys["model.name_or_path"] = self._model_path(inputs)
        keys.update(self.lora)
        keys.update(self.given)
        keys["train.output_dir"] = str(out)
        if resume:
            keys["train.resume"] = "auto" if resume is True else str(resume)
        return config_from_dict(keys)

    def _model_path(self, inputs: Path) -> str:
        if isinstance(self.model, (str, Path)):
            return str(self.model)
        if not hasattr(self.model, "save_pretrained") or not hasattr(self.model, "config"):
            raise ConfigError(f"model: give a path, a hub id or a transformers model, not {type(self.model).__name__}")
        if hasattr(self.model, "peft_config"):
            raise ConfigError("model: a peft model is not supported; pass its base model and the LoraConfig as "
                              "peft_config")
        tok = self.processing_class
        if tok is None:
            raise ConfigError("processing_class: a loaded model needs its tokenizer (processing_class=tokenizer)")
        target = inputs / "model"
        self.model.save_pretrained(str(target))
        tok.save_pretrained(str(target))
        return str(target)

    def train(self, resume_from_checkpoint: bool | str | None = None) -> dict:
        """Run GRPO to the last step (resume_from_checkpoint: True = the latest checkpoint in output_dir, or a
        checkpoints/step_N directory); returns the final eval's metrics ({} without an eval set)."""
        self.config = self._config(resume_from_checkpoint)
        self.final_eval = run_train(self.config)
        metrics = Path(self.config.train.output_dir) / "metrics.jsonl"
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        self.state = TrainerState(global_step=rows[-1]["step"] if rows else 0, max_steps=self.config.train.max_steps,
                                  log_history=rows)
        return self.final_eval or {}

    def save_model(self, output_dir: str | None = None) -> str:
        """The trained weights and tokenizer from the last checkpoint, copied to `output_dir` (default:
        <output_dir>/final) without the training state: a Hugging Face directory (transformers loads it), or with
        LoRA the adapter in peft's layout (peft loads it onto the base model)."""
        if self.config is None:
            raise ConfigError("save_model: call train() first")
        run = Path(self.config.train.output_dir)
        steps = sorted((run / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
        if not steps:
            raise ConfigError(f"save_model: {run}/checkpoints holds no checkpoint")
        target = Path(output_dir) if output_dir else run / "final"
        _copy_tree(steps[-1], target)
        return str(target)

    def push_to_hub(self, *args: Any, **kwargs: Any) -> None:
        raise ConfigError("push_to_hub: not supported by grpolab; upload the directory save_model() writes with "
                          "huggingface_hub")


def _answer_key(rows: Any) -> str | None:
    """TRL's prompt-only rows have no reference answer: grpolab's loader then reads none."""
    if isinstance(rows, list) and rows and "answer" not in rows[0]:
        return None
    return "answer"


# a checkpoint's training state, left out of save_model's copy
TRAINING_STATE = ("optimizer.pt", "rng.pt", "ref.safetensors", "critic.safetensors", "critic_optimizer.pt",
                  "trainer_state.json", "manifest.json", "run_config.yaml")


def _copy_tree(src: Path, dst: Path) -> None:
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst, ignore=lambda _, names: [n for n in names if n in TRAINING_STATE])

