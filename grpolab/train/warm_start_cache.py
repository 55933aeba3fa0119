"""The warm start's cache: the built-in model's weights (and torch's RNG state) after the warm start,
in a directory named by a hash of everything they depend on, so that a later run with the same hash
loads them instead of training again, bit for bit what it would have computed.

The hash covers: the starting weights and torch's RNG state (so model.*, train.seed and the code that
builds the model), the SFT rows themselves, the sft section, data.task (the guesses' mixer),
optim.logprob_chunk, train.undo_nonfinite_updates / max_bad_steps, the grpolab sources, the torch
build, the thread count, the device and the CPU model (docs/determinism.md: what bit-identity needs).
Anything else (train.max_steps, rollout.*, eval.*, ...) may change and the warm start is still reused.

Where: $GRPOLAB_WARM_START_CACHE when it names a directory, else $XDG_CACHE_HOME/grpolab/warm_start
(~/.cache/grpolab/warm_start); GRPOLAB_WARM_START_CACHE=0 (or off/false/no) turns it off. Entries are
written atomically (a temporary directory renamed into place) and never overwritten; an unreadable
entry is recomputed; the KEEP most recently used entries are kept. Not cached: warm starts of fewer
than MIN_STEPS steps (smoke runs and tests: seconds to recompute, a file each to keep) and LoRA warm
starts (the adapters change the model's structure).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import platform
import shutil
from pathlib import Path

import torch

from .. import __version__
from ..models import set_gradient_checkpointing
from .offline_trainer import total_steps

ENV = "GRPOLAB_WARM_START_CACHE"
OFF = ("0", "off", "false", "no")
FILE = "warm_start.pt"
MIN_STEPS = 100   # the demo's warm start is 600 steps (4.5 min on the 2-core machine); a smoke run's is a few
KEEP = 8          # entries kept, the most recently used (the demo's: 3.3 MB each)


def cache_root() -> Path | None:
    """The cache's directory, or None when GRPOLAB_WARM_START_CACHE turns it off."""
    value = os.environ.get(ENV, "").strip()
    if value.lower() in OFF:
        return None
    if value and value.lower() not in ("1", "on", "true", "yes"):
        return Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "grpolab" / "warm_start"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _sources_digest() -> str:
    """The grpolab package's Python sources: a change to the code is a new key (the version string
    stays the same between releases)."""
    h = hashlib.sha256()
    pkg = Path(__file__).resolve().parents[1]
    for p in sorted(pkg.rglob("*.py")):
        h.update(str(p.relative_to(pkg)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def _rng_states(device: torch.device) -> dict:
    states = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def _set_rng_states(states: dict, device: torch.device) -> None:
    torch.set_rng_state(states["cpu"])
    if "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"], device)


def warm_start_key(cfg, model, rows: list[dict]) -> tuple[str, dict]:
    """(hex key, the readable part of what it hashes) of a warm start about to run on `model`."""
    device = next(model.parameters()).device
    about = {"grpolab": __version__, "sources": _sources_digest(), "torch": torch.__version__,
             "threads": torch.get_num_threads(), "device": str(device), "cpu": _cpu_model(),
             "sft": dataclasses.asdict(cfg.sft), "task": cfg.data.task, "seed": cfg.train.seed,
             "logprob_chunk": cfg.optim.logprob_chunk, "undo_nonfinite_updates": cfg.train.undo_nonfinite_updates,
             "max_bad_steps": cfg.train.max_bad_steps, "model": dataclasses.asdict(cfg.model), "rows": len(rows)}
    h = hashlib.sha256(json.dumps(about, sort_keys=True, default=str).encode())
    h.update(json.dumps(rows, sort_keys=True, default=str).encode())
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode() + str(t.dtype).encode() + str(tuple(t.shape)).encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    for t in _rng_states(device).values():
        h.update(t.numpy().tobytes())
    return h.hexdigest()[:32], about


class WarmStartCache:
    """One warm start's entry: `load` it into the model (True when it was there), or `save` it after
    training. `open` gives None when the cache is off or the warm start is not cacheable."""

    def __init__(self, path: Path, about: dict, cfg) -> None:
        self.path, self.about, self.cfg = path, about, cfg
        self.losses: list[float] = []

    @classmethod
    def open(cls, cfg, model, rows: list[dict]) -> WarmStartCache | None:
        root = cache_root()
        if root is None or cfg.model.lora_rank or total_steps(cfg.sft, len(rows)) < MIN_STEPS:
            return None
        key, about = warm_start_key(cfg, model, rows)
        return cls(root / key, about, cfg)

    def load(self, model) -> bool:
        """The cached weights and RNG state into `model` and torch; False when there is no readable entry."""
        f = self.path / FILE
        if not f.is_file():
            return False
        device = next(model.parameters()).device
        try:
            saved = torch.load(f, map_location="cpu", weights_only=True)
            model.load_state_dict(saved["model"], strict=True)
        except Exception:   # a damaged entry (a full disk, a hand edit): removed, recomputed and written again
            shutil.rmtree(self.path, ignore_errors=True)
            return False
        if self.cfg.model.gradient_checkpointing:   # as the warm start's trainer leaves the model
            set_gradient_checkpointing(model, True)
        _set_rng_states(saved["rng"], device)
        self.losses = [float(x) for x in saved["losses"]]
        model.eval()
        with contextlib.suppress(OSError):   # recently used: kept by prune()
            os.utime(self.path)
        return True

    def save(self, model, losses: list[float]) -> str | None:
        """Writes the entry (a temporary directory renamed into place); None, or why it was not written."""
        device = next(model.parameters()).device
        tmp = self.path.with_name(f".tmp-{self.path.name}-{os.getpid()}")
        try:
            tmp.mkdir(parents=True, exist_ok=True)
            state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
            torch.save({"model": state, "rng": {k: v.clone() for k, v in _rng_states(device).items()},
                        "losses": [float(x) for x in losses]}, tmp / FILE)
            (tmp / "key.json").write_text(json.dumps(self.about, indent=2, default=str))
            os.rename(tmp, self.path)
        except OSError as e:   # the cache is a convenience: a full or read-only disk costs the next run time only
            shutil.rmtree(tmp, ignore_errors=True)
            if (self.path / FILE).is_file():   # another process wrote the same entry first
                return None
            return f"{e.strerror or type(e).__name__} ({self.path.parent})"
        prune(self.path.parent)
        return None


def prune(root: Path, keep: int = KEEP) -> None:
    """Removes all but the `keep` most recently used entries of the cache at `root`."""
    with contextlib.suppress(OSError):   # (another process pruning at the same time)
        entries = sorted((p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")),
                         key=lambda p: p.stat().st_mtime, reverse=True)
        for p in entries[keep:]:
            shutil.rmtree(p, ignore_errors=True)
