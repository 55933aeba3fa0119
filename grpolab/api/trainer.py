"""What every Python-API trainer shares: a TRL-shaped config object, the run's inputs written into the run
directory, the grpolab Config built from them, and `train()` / `save_model()` over the job `grpolab <verb>` runs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

from ..config import Config
from ..config.load import _flatten, config_from_dict, read_yaml
from ..distributed import world_from_env
from ..errors import ConfigError
from ..train.callbacks import Hooks, TrainerState
from .inputs import lora_settings, rows_of, write_rows
from .trl_fields import check_fields


class TRLConfig:
    """A TRL config's fields (`FIELDS`: TRL's defaults of those grpolab implements; `UNSUPPORTED`: the others) and
    grpolab's own config keys in dotted form, applied last: `SFTConfig(learning_rate=1e-5, **{"train.threads": 1})`.
    """
    FIELDS: dict[str, Any] = {}
    UNSUPPORTED: dict[str, tuple[Any, Any, str]] = {}

    def __init__(self, **fields: Any) -> None:
        check_fields(fields, type(self).__name__, self.FIELDS, self.UNSUPPORTED)
        self.fields = {k: v for k, v in fields.items() if "." not in k}
        self.keys = {k: v for k, v in fields.items() if "." in k}

    def __getattr__(self, name: str) -> Any:
        if name in type(self).FIELDS:   # TRL's attribute: the value given, else TRL's default
            return self.__dict__.get("fields", {}).get(name, type(self).FIELDS[name])
        raise AttributeError(name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in {**self.fields, **self.keys}.items())})"


# a checkpoint's training state, left out of save_model's copy
TRAINING_STATE = ("optimizer.pt", "rng.pt", "ref.safetensors", "critic.safetensors", "critic_optimizer.pt",
                  "trainer_state.json", "manifest.json", "run_config.yaml")


class Trainer:
    """The shared part of GRPOTrainer, SFTTrainer, DPOTrainer and RewardTrainer. A subclass names its config class,
    the job that runs it, and the keys its rows and fields become (`settings`)."""
    config_class: type[TRLConfig] = TRLConfig
    job: Callable[..., dict]   # the command line's job: run_train, run_sft, ... (config, hooks=...)
    suffix = ""   # args=None: output_dir is "<model name>-<suffix>", as TRL names it

    def __init__(self, model: Any, args: Any = None, train_dataset: Any = None, eval_dataset: Any = None,
                 processing_class: Any = None, peft_config: Any = None, callbacks: list | None = None) -> None:
        name = type(self).__name__
        if train_dataset is None:
            raise ConfigError(f"{name}: train_dataset is required")
        self.model, self.processing_class = model, processing_class
        self.callbacks: list = []
        for cb in callbacks or []:
            self.add_callback(cb)
        self.train_rows = rows_of(train_dataset, "train_dataset")
        self.eval_rows = None if eval_dataset is None else rows_of(eval_dataset, "eval_dataset")
        self.given, self.trl = self._args(args)
        self.lora = lora_settings(peft_config)
        self.state = TrainerState()
        self.config: Config | None = None
        self.result: dict = {}

    def _args(self, args: Any) -> tuple[dict[str, Any], TRLConfig | None]:
        """(grpolab's dotted keys given outright, the TRL-shaped config or None) for `args`: the trainer's config
        class, a dict of grpolab keys (dotted or nested), a YAML file's path, or None (TRL's defaults)."""
        if args is None:
            name = str(self.model).rstrip("/").split("/")[-1] if isinstance(self.model, (str, Path)) else "model"
            return {}, self.config_class(output_dir=f"{name}-{self.suffix}")
        if isinstance(args, self.config_class):
            return dict(args.keys), args
        if isinstance(args, TRLConfig):
            raise ConfigError(f"args: {type(self).__name__} takes a {self.config_class.__name__}, not a "
                              f"{type(args).__name__}")
        if isinstance(args, dict):
            return _flatten(args), None
        if isinstance(args, (str, Path)):
            return _flatten(read_yaml(args)), None
        raise ConfigError(f"args: give a {self.config_class.__name__}, a dict of config keys or a YAML path, not "
                          f"{type(args).__name__}")

    def settings(self, train: str, evals: str | None, n_train: int, n_eval: int) -> dict[str, Any]:
        """The keys of this trainer's rows (`train`, `evals`: files) and, with a TRL-shaped config, its fields."""
        raise NotImplementedError

    def _config(self, resume: Any) -> Config:
        out = Path(self.given.get("train.output_dir") or
                   (self.trl.output_dir if self.trl is not None else Config().train.output_dir))
        inputs = out / "inputs"
        train = (self.train_rows if isinstance(self.train_rows, str)
                 else write_rows(self.train_rows, inputs / "train.jsonl"))
        evals = (None if self.eval_rows is None else self.eval_rows if isinstance(self.eval_rows, str)
                 else write_rows(self.eval_rows, inputs / "eval.jsonl"))
        keys = self.settings(train, evals, 0 if isinstance(self.train_rows, str) else len(self.train_rows),
                             0 if not isinstance(self.eval_rows, list) else len(self.eval_rows))
        keys.update(self._model_keys(inputs))
        keys.update(self.lora)
        keys.update(self.given)
        keys["train.output_dir"] = str(out)
        if resume:
            keys["train.resume"] = "auto" if resume is True else str(resume)
        return config_from_dict(keys)

    def _model_keys(self, inputs: Path) -> dict[str, str]:
        """model.name_or_path (a directory, hub id or GGUF file; a loaded model saved into `inputs`), or
        model.init_from for a grpolab checkpoint (…/checkpoints/step_N, built-in GPT ones too)."""
        if isinstance(self.model, (str, Path)):
            if self.processing_class is not None:
                raise ConfigError("processing_class: grpolab reads the tokenizer from the model's directory; save "
                                  "the tokenizer there, or pass the loaded model with it")
            if (Path(self.model) / "manifest.json").is_file():
                return {"model.init_from": str(self.model)}
            return {"model.name_or_path": str(self.model)}
        if not hasattr(self.model, "save_pretrained") or not hasattr(self.model, "config"):
            raise ConfigError(f"model: give a path, a hub id or a transformers model, not {type(self.model).__name__}")
        if hasattr(self.model, "peft_config"):
            raise ConfigError("model: a peft model is not supported; pass its base model and the LoraConfig as "
                              "peft_config")
        if self.processing_class is None:
            raise ConfigError("processing_class: a loaded model needs its tokenizer (processing_class=tokenizer)")
        target = inputs / "model"
        self.model.save_pretrained(str(target))
        self.processing_class.save_pretrained(str(target))
        return {"model.name_or_path": str(target)}

    def train(self, resume_from_checkpoint: bool | str | None = None) -> dict:
        """Run to the last step (resume_from_checkpoint: True = the latest checkpoint in output_dir, or a
        checkpoints/step_N directory); returns what the job returns (GRPO: the final eval's metrics; the offline
        trainers: their summary)."""
        self.config = self._config(resume_from_checkpoint)
        hooks = Hooks(self.callbacks, args=self.trl if self.trl is not None else self.config,
                      main=world_from_env().main)
        self.result = type(self).job(self.config, hooks=hooks) or {}
        metrics = Path(self.config.train.output_dir) / "metrics.jsonl"
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] \
            if metrics.is_file() else []
        self.state = TrainerState(global_step=rows[-1]["step"] if rows else 0, max_steps=hooks.state.max_steps,
                                  log_history=rows)
        return self.result

    def add_callback(self, callback: Any) -> None:
        """A TRL/transformers TrainerCallback (an instance, or a class made with no arguments), or any object with
        some of its methods: on_train_begin, on_step_end, on_log(logs=...), on_evaluate(metrics=...), on_save,
        on_train_end, each called with (args, state, control)."""
        self.callbacks.append(callback() if isinstance(callback, type) else callback)

    def save_model(self, output_dir: str | None = None) -> str:
        """The trained weights and tokenizer from the last checkpoint, copied to `output_dir` (default:
        <output_dir>/final) without the training state: a Hugging Face directory (transformers loads it), with
        LoRA the adapter in peft's layout (peft loads it onto the base model); the built-in GPT in grpolab's layout."""
        last = self.last_checkpoint("save_model")
        target = Path(output_dir) if output_dir else last.parent.parent / "final"
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(last, target, ignore=lambda _, names: [n for n in names if n in TRAINING_STATE])
        return str(target)

    def last_checkpoint(self, caller: str) -> Path:
        if self.config is None:
            raise ConfigError(f"{caller}: call train() first")
        run = Path(self.config.train.output_dir)
        steps = sorted((run / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
        if not steps:
            raise ConfigError(f"{caller}: {run}/checkpoints holds no checkpoint")
        return steps[-1]

    def evaluate(self) -> dict:
        raise ConfigError(f"evaluate: not supported by grpolab's {type(self).__name__} yet; train() returns the "
                          f"held-out eval before and after training")

    def push_to_hub(self, *args: Any, **kwargs: Any) -> None:
        raise ConfigError("push_to_hub: not supported by grpolab; upload the directory save_model() writes with "
                          "huggingface_hub")
