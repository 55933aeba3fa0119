"""`grpolab generate MODEL --in PROMPTS --out OUT`: offline batch generation, resumable, optionally scored."""

from __future__ import annotations

from argparse import Namespace

from ..config import Config
from ..serve.generate import run_generate, sampling_settings


def split_overrides(overrides: list[str]) -> tuple[dict, list[str]]:
    """(sampling settings from the plain `key=value` pairs, the dotted config overrides for --score)."""
    settings = sampling_settings([o for o in overrides if "." not in o.split("=", 1)[0]])
    return settings, [o for o in overrides if "." in o.split("=", 1)[0]]


def run(cfg: Config | None, args: Namespace) -> None:
    """`grpolab generate MODEL --in PROMPTS --out OUT`: --n completions per prompt into OUT (rows already
    there are skipped); cfg: the config that scores them (--score), else None."""
    settings, _ = split_overrides(args.overrides)
    run_generate(args.model, args.inp, args.out, n=args.n, settings=settings, max_batch=args.max_batch,
                 score_cfg=cfg, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len)
