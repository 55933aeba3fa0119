"""`grpolab generate MODEL --in PROMPTS --out OUT`: offline batch generation, resumable, optionally scored."""

from __future__ import annotations

from ..config import Config
from ..serve.generate import run_generate, sampling_settings


def split_overrides(overrides: list[str]) -> tuple[dict, list[str]]:
    """(sampling settings from the plain `key=value` pairs, the dotted config overrides for --score)."""
    settings = sampling_settings([o for o in overrides if "." not in o.split("=", 1)[0]])
    return settings, [o for o in overrides if "." in o.split("=", 1)[0]]


def run(model: str, inp: str, out: str, *, n: int, settings: dict, max_batch: int, score_cfg: Config | None,
        dtype: str, device: str, max_model_len: int | None) -> None:
    """Generate n completions per prompt of `inp` into `out` (rows already there are skipped)."""
    run_generate(model, inp, out, n=n, settings=settings, max_batch=max_batch, score_cfg=score_cfg, dtype=dtype,
                 device=device, max_model_len=max_model_len)
