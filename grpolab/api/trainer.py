"""What every Python-API trainer shares: a TRL-shaped config object, the run's inputs written into the run
directory, the grpolab Config built from them, and `train()` / `save_model()` over the job `grpolab <verb>` runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from ..config import Config
from ..config.load import _flatten, check_output_dir, config_from_dict, read_yaml
from ..distributed import world_from_env
from ..errors import ConfigError
from ..train.callbacks import Hooks, TrainerState
from ..train.run import Run
from .child import run_in_child, wanted
from .field_types import check_types
from .inputs import rows_of, write_rows
from .lora_fields import lora_settings
from .saved_model import copy_model
from .trl_fields import check_fields


class TRLConfig:
    """A TRL config's fields (`FIELDS`: TRL's defaults of those grpolab implements; `UNSUPPORTED`: the others) and
    grpolab's own config keys in dotted form, applied last: `SFTConfig(learning_rate=1e-5, **{"train.threads": 1})`.
    """
    FIELDS: dict[str, Any] = {}
    UNSUPPORTED: dict[str, tuple[Any, Any, str]] = {}
    KINDS: dict[str, tuple[str, ...]] = {}   # the fields whose TRL default does not say their type (field_types.py)
    SETTINGS: Callable[..., dict[str, Any]] | None = None   # (fields, train rows, eval rows) -> grpolab's keys

    def __init__(self, **fields: Any) -> None:
        check_fields(fields, type(self).__name__, self.FIELDS, self.UNSUPPORTED)
        if "output_dir" in fields and fields["output_dir"] is None:   # TRL's None: its default
            del fields["output_dir"]
        check_types(fields, type(self).__name__, self.FIELDS, self.KINDS)
        self.fields = {k: v for k, v in fields.items() if "." not in k}
        self.keys = {k: v for k, v in fields.items() if "." in k}
        if type(self).SETTINGS is not None:   # the checks across fields now, as TRL's __post_init__ makes them (the
            type(self).SETTINGS(self.fields, 1, 0)   # row counts are the trainer's: one row passes their checks)

    def __getattr__(self, name: str) -> Any:
        if name in type(self).FIELDS:   # TRL's attribute: the value given, else TRL's default
            return self.__dict__.get("fields", {}).get(name, type(self).FIELDS[name])
        raise AttributeError(name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in {**self.fields, **self.keys}.items())})"


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
        self.output_dir = Path(self.given.get("train.output_dir") or
                               (self.trl.output_dir if self.trl is not None else Config().train.output_dir))
        check_output_dir(_dir_config(self.output_dir))   # made now, as TRL's trainer makes it: unwritable = one line

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
        out = self.output_dir
        inputs = out / "inputs"
        # the run directory is this process's before anything is written into it: a run live in another process
        # keeps its inputs (its resume reads them). The first rank writes them; the others read them in the job,
        # after its first collective (the checkpoint lookup)
        check_output_dir(_dir_config(out))
        main = world_from_env().main
        if main:
            Run(_dir_config(out)).lock()
        again = bool(resume) and any((out / "checkpoints").glob("step_*"))   # its checkpoint continues its rows
        train = (self.train_rows if isinstance(self.train_rows, str)
                 else write_rows(self.train_rows, inputs / "train.jsonl", "train_dataset", again, main))
        evals = (None if self.eval_rows is None else self.eval_rows if isinstance(self.eval_rows, str)
                 else write_rows(self.eval_rows, inputs / "eval.jsonl", "eval_dataset", again, main))
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
        if world_from_env().main:   # (the other ranks load it in the job, as the rows)
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
        job = type(self).job
        # torch imported before grpolab: the job in a process started with grpolab's OpenMP settings (api/child.py)
        try:
            self.result = (run_in_child(job, self.config, hooks) if wanted(self.config)
                           else job(self.config, hooks=hooks)) or {}
        finally:   # also after Ctrl-C (the step it saved) or an error: the steps the run logged
            rows = self.logged()
            self.state = TrainerState(global_step=rows[-1]["step"] if rows else 0, max_steps=hooks.state.max_steps,
                                      log_history=rows)
        return self.result

    def logged(self) -> list[dict]:
        """metrics.jsonl's rows, one a step."""
        metrics = Path(self.config.train.output_dir) / "metrics.jsonl"
        return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] \
            if metrics.is_file() else []

    def add_callback(self, callback: Any) -> None:
        """A TRL/transformers TrainerCallback (an instance, or a class made with no arguments), or any object with
        some of its methods: on_train_begin, on_step_end, on_log(logs=...), on_evaluate(metrics=...), on_save,
        on_train_end, each called with (args, state, control)."""
        self.callbacks.append(callback() if isinstance(callback, type) else callback)

    def save_model(self, output_dir: str | None = None) -> str:
        """The trained weights and tokenizer from the last checkpoint, copied into `output_dir` (default:
        <output_dir>/final; the run directory itself too, as in TRL) without the training state: a Hugging Face
        directory (transformers loads it), with LoRA the adapter in peft's layout (peft loads it onto the base
        model); the built-in GPT in grpolab's layout. Other files there stay (saved_model.py)."""
        last = self.last_checkpoint("save_model")
        target = Path(output_dir) if output_dir else last.parent.parent / "final"
        copy_model(last, target)
        return str(target)

    def logged_eval(self, ckpt: Path) -> dict:
        """The held-out eval the run logged at `ckpt`'s step (the final one, or a periodic one), under TRL's names
        eval_<metric>; {} when it logged none there."""
        step = int(ckpt.name.split("_")[1])
        row = next((r for r in reversed(self.logged()) if r.get("step") == step), {})
        return {f"eval_{k[len('eval/'):]}": v for k, v in row.items() if k.startswith("eval/")}

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


def _dir_config(out: Path) -> Config:
    """A config naming only the run directory `out` (what the run directory's checks and lock read)."""
    cfg = Config()
    cfg.train.output_dir = str(out)
    return cfg
