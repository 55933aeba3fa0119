"""What a resume accepts: a checkpoint of the same job, and only some config changes.

A resumed run must continue the run its checkpoint came from: the weights, optimizer state and data
position were made by that checkpoint's config, and config.yaml (rewritten at every start) must keep
describing them. So `train.resume` compares the new config with the one the checkpoint was written
with (its run_config.yaml; older checkpoints: their run directory's config.yaml) and refuses every
changed key except those below, in one line listing the keys.

Keys present in only one of the two configs (added or removed by a grpolab upgrade) are not compared; a renamed
key (config/load.py's RENAMED) is compared under its new name.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from pathlib import Path

import yaml

from ..config.load import renamed
from ..errors import CheckpointError, ConfigError
from ..models.checkpoint import RUN_CONFIG, checkpoint_job

# Safe: they change how long the run goes, when it saves, evaluates and logs, and where: never what a
# training step computes.
SAFE_KEYS: tuple[str, ...] = (
    "train.max_steps", "train.save_every", "train.keep_checkpoints", "train.eval_every", "train.log_every",
    "train.max_bad_steps", "train.resume", "train.output_dir", "train.worker_stall_timeout",
    "log.*", "eval.*",
    "reward.timeout", "reward.code_exec.max_concurrent", "reward.judges.*.concurrency",
)
# Where the numbers are computed (the device, the CPU thread count): the same algorithm, with results
# equal up to floating-point rounding only (bit-identical metrics need the same device and threads).
PLACEMENT_KEYS: tuple[str, ...] = ("model.device", "train.threads", "train.rollout_workers", "train.worker_threads")
# The length of an offline job (`grpolab sft` / dpo / rm / distill): its train.max_steps.
JOB_LENGTH_KEYS: dict[str, tuple[str, ...]] = {
    job: (f"{job}.steps", f"{job}.epochs") for job in ("sft", "dpo", "rm", "distill")
}


def flatten(d: dict, prefix: str = "") -> dict:
    """{'a': {'b': 1}} -> {'a.b': 1}."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def allowed(key: str, job: str) -> bool:
    keys = SAFE_KEYS + PLACEMENT_KEYS + JOB_LENGTH_KEYS.get(job, ())
    return any(fnmatchcase(key, pattern) for pattern in keys)


def unsafe_changes(old: dict, new: dict, job: str) -> list[str]:
    """The keys (dotted) whose value differs between two configs and that a resume of `job` does not
    accept, sorted; each as 'key (old -> new)'."""
    a, b = (dict(renamed(list(flatten(c).items()), quiet=True)) for c in (old, new))
    return [f"{k} ({a[k]!r} -> {b[k]!r})" for k in sorted(a.keys() & b.keys())
            if a[k] != b[k] and not allowed(k, job)]


def check_resume_config(new: dict, ckpt: str | Path, job: str | None = None) -> None:
    """ConfigError when `new` (a config as a plain dict, as written to config.yaml) changes a key that
    a resume from `ckpt` must keep; nothing when the checkpoint's config is unknown. `job`: the job
    resuming (None: the checkpoint's own)."""
    old = run_config_of(ckpt)
    if old is None:
        return
    changed = unsafe_changes(old, new, job or checkpoint_job(ckpt) or "grpo")
    if changed:
        raise ConfigError(f"train.resume: {ckpt} was written with a different config; these keys would change "
                          f"what it continues: {', '.join(changed)}; set them back, or start a new run in another "
                          f"train.output_dir (model.init_from={ckpt} starts from its weights)")


def run_config_of(ckpt: str | Path) -> dict | None:
    """The config a checkpoint was written with: its run_config.yaml, or (older checkpoints) the
    config.yaml of the run directory it sits in; None when neither exists."""
    p = Path(ckpt)
    for f in (p / RUN_CONFIG, p.parent.parent / "config.yaml"):
        if f.is_file():
            try:
                data = yaml.safe_load(f.read_text())
            except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
                raise CheckpointError(f"{f}: cannot be read ({_first_line(e)})") from None
            return data if isinstance(data, dict) else None
    return None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def check_resume_job(ckpt: str | Path | None, job: str) -> None:
    """A checkpoint to resume must come from the same job (grpo, sft, dpo, distill); ConfigError otherwise.
    Checkpoints without a job (older GRPO ones) count as grpo."""
    if ckpt is None:
        return
    found = checkpoint_job(ckpt)
    if found != job:
        raise ConfigError(f"train.resume: {ckpt} is a {found} checkpoint, not a {job} one; start {job} from it with "
                          f"model.init_from={ckpt}")
