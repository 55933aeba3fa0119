"""`GRPOTrainer(model=..., reward_funcs=..., train_dataset=..., args=GRPOConfig(...)).train()`: TRL's shape over
`grpolab train`: the same run directory, metrics, checkpoints, resume, Ctrl-C handling and bits."""

from __future__ import annotations

from typing import Any

from ..config import Config
from ..errors import ConfigError
from ..jobs.eval import run_eval
from ..jobs.train import run_train
from .field_types import GRPO_KINDS
from .grpo_fields import GRPO, GRPO_UNSUPPORTED, grpo_settings
from .inputs import reward_specs
from .trainer import Trainer, TRLConfig


class GRPOConfig(TRLConfig):
    """TRL's GRPOConfig fields (docs/python-api.md: each with its grpolab key, or why it is refused) and grpolab's
    own keys in dotted form: `GRPOConfig(learning_rate=1e-5, **{"rollout.top_k": 20})`. Fields not given take
    TRL's defaults; dotted keys are applied last and win."""
    FIELDS = GRPO
    UNSUPPORTED = GRPO_UNSUPPORTED
    KINDS = GRPO_KINDS
    SETTINGS = staticmethod(grpo_settings)


class GRPOTrainer(Trainer):
    """GRPO (and its family: `loss_type`, `importance_sampling_level`, grpolab's algorithm.* keys) on a model.

    model: a Hugging Face model directory or hub id, "builtin", or a loaded `transformers` model (saved once
    into <output_dir>/inputs/model with `processing_class`, its tokenizer); reward_funcs: one or a list of
    functions with TRL's signature (prompts, completions, **columns) -> list[float | None], or grpolab reward specs
    ("math_accuracy", "file.py:fn", "verl:...", "rm:<model>"); train_dataset / eval_dataset: a `datasets.Dataset`,
    a list of dicts or a data file's path (a "prompt" column, text or a conversation; other columns reach the
    rewards by name); args: a GRPOConfig, a dict of grpolab keys or a YAML path; peft_config: a peft LoraConfig.
    """
    config_class = GRPOConfig
    suffix = "GRPO"
    job = staticmethod(run_train)

    def __init__(self, model: Any, reward_funcs: Any, args: Any = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, peft_config: Any = None,
                 callbacks: list | None = None) -> None:
        funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        if not funcs:
            raise ConfigError("GRPOTrainer: reward_funcs lists no reward")
        reward_specs(funcs)   # a bad entry fails here, before any work
        self.funcs = funcs
        super().__init__(model, args, train_dataset, eval_dataset, processing_class, peft_config, callbacks)

    def settings(self, train: str, evals: str | None, n_train: int, n_eval: int) -> dict[str, Any]:
        keys: dict[str, Any] = {}
        if self.trl is not None:
            keys.update(grpo_settings(self.trl.fields, n_train, n_eval if evals else 0))
            if evals and not n_eval:   # an eval set given as a path: grpolab's eval size
                keys["eval.num_problems"] = Config().eval.num_problems
            keys.update({"data.train_size": 0, "data.answer_key": _answer_key(self.train_rows)})
        keys.update({"data.task": "files", "data.train_path": train, "reward.functions": reward_specs(self.funcs)})
        if evals:
            keys["data.test_path"] = evals
        return keys

    def evaluate(self) -> dict:
        """The last checkpoint's held-out eval, as `grpolab eval` runs it (greedy accuracy, pass@k and maj@k on the
        eval rows, scored against their `answer` column by eval.reward), under TRL's names: eval_<metric>. The run's
        own eval when it logged one at that checkpoint's step (right after train(): the final eval); else it is run,
        into <output_dir>/evaluate/eval.json."""
        last = self.last_checkpoint("evaluate")
        if not self.config.eval.num_problems:
            raise ConfigError("evaluate: no held-out rows; give an eval_dataset with `prompt` and `answer` columns")
        logged = self.logged_eval(last)
        if logged:
            return logged
        res = run_eval(str(last), self.config, out=str(last.parent.parent / "evaluate"))
        return {f"eval_{k}": v for k, v in res.items()}


def _answer_key(rows: Any) -> str | None:
    """TRL's prompt-only rows have no reference answer: grpolab's loader then reads none."""
    if isinstance(rows, list) and rows and "answer" not in rows[0]:
        return None
    return "answer"
