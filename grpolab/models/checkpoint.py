"""Checkpoint directories: atomic save (temp dir, fsync, rename), verify, load, list, prune, and the
clean-up after a crash mid-save. Which checkpoint a resume continues from, and what it accepts, is the
run's business (train/run.py).

Layout of checkpoints/step_N/:
    model.safetensors      weights
    model_config.json      built-in GPT: architecture ({"type": "builtin-gpt", ...GPTConfig}); a reward
                           model of it (`grpolab rm`): type "builtin-rm", weights with the score head
    config.json, tokenizer Hugging Face models: the `save_pretrained` layout, so
    files, ...             `AutoModelForCausalLM.from_pretrained(step_N)` loads it (reward models:
                           AutoModelForSequenceClassification, LoRA merged; the adapter in adapter/)
    optimizer.pt           optimizer and scheduler state (present for training checkpoints), and the
                           float32 master weights of a bfloat16/float16 model
    rng.pt                 torch and sampler RNG states
    ref.safetensors        the reference model (when algorithm.beta > 0)
    critic.safetensors,    PPO's critic (algorithm.adv_estimator=gae): weights with the value head, and
    critic_optimizer.pt    its optimizer and scheduler state
    trainer_state.json     step, data position (and the wandb run id)
    run_config.yaml        the run's config.yaml when the checkpoint was written (resume compares it with
                           the new config: train/resume_rules.py)
    manifest.json          written last: the step and every other file's size and sha256

optimizer.pt and rng.pt hold tensors and plain containers only and are loaded with
torch.load(weights_only=True): a checkpoint cannot run code when it is loaded.

Every load checks the manifest first (verify_checkpoint): a file missing, truncated, or copied in from
another checkpoint is refused with one line naming it (CheckpointError). Checkpoints written before
manifests existed (trainer_state.json without "format") still load, checked as before (plus a
truncation check of every .safetensors file's header against its size); a new checkpoint whose
manifest.json was deleted is refused.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import re
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file, save_model
from safetensors.torch import load_model as load_safetensors_model

from ..errors import CheckpointError
from . import GPT, CharTokenizer, GPTConfig
from .hf import HFPolicy, gguf_file, load_hf, load_hf_adapter
from .lora import add_lora

TMP = ".tmp_"     # a checkpoint being written (.tmp_step_N) or pruned (.tmp_pruned_step_N)
ASIDE = ".old_"   # an existing step_N moved aside while its re-save is swapped in: .old_step_N
UNUSABLE = "unusable_"   # train.resume=auto moved a checkpoint that failed its check out of the way
MANIFEST = "manifest.json"
RUN_CONFIG = "run_config.yaml"
FORMAT = 2        # trainer_state.json's "format": 2 = the checkpoint has a manifest (absent: older ones)
TRAINING_ONLY = ("optimizer.pt", "rng.pt", "critic_optimizer.pt")   # not read when only the model is loaded
# unlisted files a load would read are refused; others (e.g. the eval.json `grpolab eval` writes) are not
_LOADED_SUFFIXES = (".safetensors", ".pt", ".bin")
_LOADED_NAMES = ("trainer_state.json", "model_config.json", "config.json", "adapter_config.json", RUN_CONFIG)



def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(ckpt_root: str | Path, step: int, model, *, tokenizer=None, optimizer=None, scheduler=None,
                    trainer_state: dict | None = None, rng: dict | None = None, ref_model=None,
                    full_states: dict | None = None, master_weights: list | None = None, extra=None) -> Path:
    """Write checkpoints/step_N atomically; an interrupted write never leaves a half checkpoint, and
    re-saving an existing step never leaves a moment without a complete one.

    full_states: for sharded models (train.strategy=fsdp), the gathered full 'model', 'ref' and
    'optimizer' state dicts, written in place of the modules' own (sharded) ones.
    extra: a callable that writes more files (e.g. PPO's critic) into the directory being staged."""
    root = Path(ckpt_root)
    final = root / f"step_{step}"
    try:
        tmp = _stage(root, step, model, tokenizer=tokenizer, optimizer=optimizer, scheduler=scheduler,
                     trainer_state=trainer_state, rng=rng, ref_model=ref_model, full_states=full_states,
                     master_weights=master_weights, extra=extra)
    except (OSError, SafetensorError, RuntimeError) as e:
        staging = root / f"{TMP}step_{step}"
        writing = _newest_file(staging)
        shutil.rmtree(staging, ignore_errors=True)   # no half-written staging dir left
        if isinstance(e, RuntimeError) and not _is_write_failure(e):
            raise
        if isinstance(e, (FileNotFoundError, PermissionError)):
            raise
        kept = list_checkpoints(root)
        kept_msg = f"kept {kept[-1]}" if kept else "no earlier checkpoint was kept"
        what = "the disk is full" if _is_disk_full(e, root) else f"write failed ({_first_line(e)})"
        raise CheckpointError(f"cannot write checkpoint {final}{f' (at {writing})' if writing else ''}: {what}; "
                              f"{kept_msg} (complete); free space and continue with train.resume=auto") from None
    for _ in _install(tmp, final):
        pass
    return final


def _newest_file(d: Path) -> str | None:
    """The file last written in a staging dir (the one a failed write was in), relative to it."""
    try:
        files = [f for f in d.rglob("*") if f.is_file()]
        return max(files, key=lambda f: f.stat().st_mtime_ns).relative_to(d).as_posix() if files else None
    except OSError:
        return None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _is_write_failure(e: RuntimeError) -> bool:
    """torch.save's writer reports a failed write (e.g. disk full) as 'unexpected pos N vs M' or
    'PytorchStreamWriter failed writing file'."""
    return any(s in str(e) for s in ("unexpected pos", "PytorchStreamWriter failed", "No space left"))


def _is_disk_full(e: BaseException, root: Path) -> bool:
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    if "No space left" in str(e) or "os error 28" in str(e):
        return True
    try:   # torch's writer says only 'unexpected pos': look at the disk itself
        return shutil.disk_usage(root).free < 64 * 2**20
    except OSError:
        return False


def _stage(root: Path, step: int, model, *, tokenizer=None, optimizer=None, scheduler=None,
           trainer_state: dict | None = None, rng: dict | None = None, ref_model=None,
           full_states: dict | None = None, master_weights: list | None = None, extra=None) -> Path:
    """Write the complete checkpoint to root/.tmp_step_N, fsynced; nothing else is touched."""
    root.mkdir(parents=True, exist_ok=True)
    recover_checkpoints(root)   # an earlier crash may have left a checkpoint aside, or a half-written one
    tmp = root / f"{TMP}step_{step}"
    tmp.mkdir()
    full_states = full_states or {}
    full = full_states.get("model")
    if hasattr(model, "save_checkpoint_files"):   # a reward model (models/reward_head.py) writes its own layout
        model.save_checkpoint_files(tmp)
    elif isinstance(model, HFPolicy):
        model.save(tmp, state_dict=_hf_keys(full) if full is not None else None)
        if tokenizer is not None:
            tokenizer.save(tmp)
    else:
        state = {k: v.detach().contiguous() for k, v in (full if full is not None else model.state_dict()).items()}
        save_file(state, str(tmp / "model.safetensors"))
        lora = {"lora": model.lora} if getattr(model, "lora", None) else {}   # its adapters' settings
        (tmp / "model_config.json").write_text(json.dumps({"type": "builtin-gpt", **model.config.to_dict(),
                                                           **lora}, indent=2))
    # optimizer.pt and rng.pt hold only tensors and plain containers: they load with weights_only=True
    if optimizer is not None:
        torch.save({"optimizer": full_states.get("optimizer") or optimizer.state_dict(),
                    "scheduler": scheduler.state_dict() if scheduler is not None else None,
                    **({"master": master_weights} if master_weights is not None else {})}, tmp / "optimizer.pt")
    if rng is not None:
        torch.save(rng, tmp / "rng.pt")
    if full_states.get("ref") is not None:   # gathered, one name per tied weight (as save_model writes it)
        ref = full_states["ref"]
        save_file(_hf_keys(ref) if isinstance(ref_model, HFPolicy) else ref, str(tmp / "ref.safetensors"))
    elif ref_model is not None:
        ref = ref_model.hf if isinstance(ref_model, HFPolicy) else ref_model
        save_model(ref, str(tmp / "ref.safetensors"))   # save_model handles tied (shared) weights
    if extra is not None:
        extra(tmp)
    (tmp / "trainer_state.json").write_text(json.dumps({"step": step, **(trainer_state or {}), "format": FORMAT},
                                                       indent=2))
    run_config = root.parent / "config.yaml"   # written by the job at its start (train/run.py)
    if run_config.is_file():
        shutil.copyfile(run_config, tmp / RUN_CONFIG)
    files = {}
    for f in sorted(tmp.rglob("*")):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
            files[f.relative_to(tmp).as_posix()] = {"size": f.stat().st_size, "sha256": _sha256(f)}
    # last: a checkpoint with a manifest is complete, and the manifest says what complete is
    with open(tmp / MANIFEST, "w") as fh:
        fh.write(json.dumps({"format": FORMAT, "step": step, "files": files}, indent=2))
        fh.flush()
        os.fsync(fh.fileno())
    _fsync_dir(tmp)
    return tmp


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


_verified: dict[str, tuple] = {}   # checkpoint dir -> the files' (name, size, mtime, inode) when last verified


def _signature(p: Path) -> tuple:
    out = []
    for f in sorted(p.rglob("*")):
        if f.is_file():
            st = f.stat()
            out.append((f.relative_to(p).as_posix(), st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(out)


def _read_json(path: Path) -> dict:
    """A checkpoint's JSON file as a dict; a missing, unreadable or broken one is a CheckpointError naming it."""
    if not path.is_file():
        raise CheckpointError(f"{path}: missing")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CheckpointError(f"{path}: cannot be read ({_first_line(e)}); the checkpoint is damaged") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: cannot be read (a JSON object expected); the checkpoint is damaged")
    return data


def verify_checkpoint(path: str | Path, skip: tuple[str, ...] = ()) -> None:
    """Check a checkpoint directory against its manifest.json: every listed file present, of its
    size and sha256, and no unlisted file a load would read; the manifest's step matches the
    directory's name. One CheckpointError naming the first file that fails. `skip`: files not
    checked (those the caller will not read). Checkpoints without a manifest (written before
    manifests existed) pass, unless their trainer_state.json says they should have one; their
    .safetensors files get a truncation check from their headers."""
    p = Path(path)
    manifest = p / MANIFEST
    if not manifest.is_file():
        state = p / "trainer_state.json"
        if state.is_file() and _read_json(state).get("format", 1) >= FORMAT:
            raise CheckpointError(f"{manifest}: missing (the checkpoint is incomplete); resume from an earlier "
                                  f"checkpoint")
        for f in sorted(p.glob("*.safetensors")):
            check_safetensors(f)
        return
    key, whole = f"{p.resolve()}|{','.join(skip)}", f"{p.resolve()}|"
    sig = _signature(p)
    if sig in (_verified.get(key), _verified.get(whole)):   # unchanged since this process last checked it
        return                                               # (e.g. the resume's check, then the model's load)
    m = _read_json(manifest)
    files = m.get("files")
    if not isinstance(files, dict) or not isinstance(m.get("step"), int):
        raise CheckpointError(f"{manifest}: cannot be read (no 'step' and 'files'); the checkpoint is damaged")
    name = p.name.removeprefix(ASIDE)
    if is_step_name(name) and int(name[5:]) != m["step"]:
        raise CheckpointError(f"{manifest}: written for step {m['step']}, but the directory is {p.name} (moved or "
                              f"copied from another step); resume from a checkpoint left where it was written")
    listed = [(rel, info) for rel, info in files.items() if rel not in skip]
    for rel, info in listed:   # sizes first: a truncated or missing file is found without reading anything
        f = p / rel
        if not f.is_file():
            raise CheckpointError(f"{f}: missing (listed in {MANIFEST}): the checkpoint is incomplete; resume from "
                                  f"an earlier checkpoint")
        size = f.stat().st_size
        if size != info.get("size"):
            raise CheckpointError(f"{f}: {size} bytes, but {MANIFEST} says {info.get('size')} (truncated, or "
                                  f"copied from another checkpoint); resume from an earlier checkpoint")
    for f in sorted(p.rglob("*")):
        rel = f.relative_to(p).as_posix()
        if (f.is_file() and rel != MANIFEST and rel not in files and rel not in skip
                and (f.name.endswith(_LOADED_SUFFIXES) or f.name in _LOADED_NAMES)):
            raise CheckpointError(f"{f}: not in {MANIFEST} (added after the checkpoint was written); remove it "
                                  f"or resume from an earlier checkpoint")
    for rel, info in listed:
        f = p / rel
        if _sha256(f) != info.get("sha256"):
            raise CheckpointError(f"{f}: its contents differ from {MANIFEST}'s checksum (changed after the "
                                  f"checkpoint was written, e.g. copied from another step); resume from an "
                                  f"earlier checkpoint")
    _verified[key] = sig


def check_safetensors(path: Path) -> None:
    """A .safetensors file is whole: its header parses and its tensors' data ends exactly at the end
    of the file (a truncated copy fails here, by name, before any loader sees it)."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0] if size >= 8 else None
            header = json.loads(fh.read(n)) if n is not None and 8 + n <= size else None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, struct.error):
        header = None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: not a complete safetensors file (its header is cut or damaged); the "
                              f"file is truncated or not a weights file")
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__" and isinstance(t, dict)
               and "data_offsets" in t), default=0)
    if 8 + n + end != size:
        raise CheckpointError(f"{path}: {size} bytes, but its header describes {8 + n + end} (truncated or "
                              f"damaged)")


def _hf_keys(state: dict) -> dict:
    """An HFPolicy's state dict in the Hugging Face model's own names (without the 'hf.' prefix)."""
    return {k.removeprefix("hf."): v for k, v in state.items()}


def read_ref_state(path: str | Path, ref_model) -> dict | None:
    """ref.safetensors of a checkpoint, named as `ref_model`'s state dict (None when absent)."""
    f = Path(path) / "ref.safetensors"
    if not f.is_file():
        return None
    check_safetensors(f)
    try:
        sd = load_file(str(f))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{f}: cannot be read ({_first_line(e)})") from None
    return {f"hf.{k}": v for k, v in sd.items()} if isinstance(ref_model, HFPolicy) else sd


def _install(tmp: Path, final: Path) -> Iterator[None]:
    """Move the staged `tmp` to `final`, one filesystem operation at a time, yielding after each
    (a crash can only fall between two of them; the tests stop there). An existing `final` is
    renamed aside first (.old_step_N) and deleted last, so at every moment a complete checkpoint
    for the step exists: `final`, or the aside copy that recover_checkpoints puts back."""
    root = final.parent
    if final.exists():
        aside = root / f"{ASIDE}{final.name}"
        if aside.exists():
            shutil.rmtree(aside)
        os.rename(final, aside)
        _fsync_dir(root)
        yield
        os.rename(tmp, final)
        _fsync_dir(root)
        yield
        shutil.rmtree(aside)
    else:
        os.rename(tmp, final)
        _fsync_dir(root)
    yield


def recover_checkpoints(ckpt_root: str | Path) -> None:
    """Clean up after a crash mid-save (called before a save and a resume; one writer per run
    directory): an aside .old_step_N goes back to step_N when step_N is missing and is deleted
    when the new step_N made it in; half-written .tmp_ directories are deleted."""
    root = Path(ckpt_root)
    if not root.is_dir():
        return
    for p in sorted(root.iterdir()):
        if p.name.startswith(TMP) and p.is_dir():
            shutil.rmtree(p)
        elif p.name.startswith(ASIDE) and is_step_name(p.name[len(ASIDE):]):
            final = root / p.name[len(ASIDE):]
            if is_complete(final):
                shutil.rmtree(p)
            elif is_complete(p):
                if final.exists():
                    shutil.rmtree(final)
                os.rename(p, final)
                _fsync_dir(root)


def load_model(path: str | Path, dtype: str = "float32", device: str = "cpu"):
    """(model, tokenizer) from a checkpoint directory: a built-in GPT checkpoint, or any
    Hugging Face model directory (ours or one saved elsewhere)."""
    p = Path(path)
    cfg_file = p / "model_config.json"
    if p.is_dir():
        verify_checkpoint(p, skip=TRAINING_ONLY)
    if not cfg_file.is_file():
        try:
            if (p / "config.json").is_file():
                return load_hf(str(p), dtype=dtype, device=device)
            if (p / "adapter_config.json").is_file():   # a LoRA checkpoint of a Hugging Face model
                return load_hf_adapter(str(p), dtype=dtype, device=device)
            if gguf_file(p) is not None:   # a GGUF file, or a directory holding one
                return load_hf(str(p), dtype=dtype, device=device)
        except SafetensorError as e:   # a damaged weights file the header check did not catch
            raise CheckpointError(f"{p}: its weights cannot be read ({_first_line(e)})") from None
        raise FileNotFoundError(f"{str(p)!r} is not a checkpoint: no model_config.json (built-in GPT), "
                                f"config.json (Hugging Face model) or adapter_config.json (LoRA adapter)")
    meta = _read_json(cfg_file)
    meta.pop("type", None)
    lora = meta.pop("lora", None)
    try:
        model = GPT(GPTConfig(**meta))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{cfg_file}: not a model description ({_first_line(e)})") from None
    if lora:
        add_lora(model, lora)
    load_weights(model, p / "model.safetensors")
    model.to(device).eval()
    return model, CharTokenizer()


def load_weights(model, path: Path) -> None:
    """A .safetensors file into `model` (strict): a missing, damaged or mismatched file (weights of
    another model size, or with LoRA adapters turned on/off) is one CheckpointError naming the file
    and a tensor."""
    if not path.is_file():
        raise CheckpointError(f"{path}: missing")
    check_safetensors(path)
    try:
        state = load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path}: cannot be read ({_first_line(e)})") from None
    check_shapes(path, state, model.state_dict())
    model.load_state_dict(state)


def check_shapes(path: Path, got: dict, want: dict) -> None:
    """The tensors of a weights file match a model's state dict by name and shape; else one line."""
    for k, v in want.items():
        if k in got and tuple(got[k].shape) != tuple(v.shape):
            raise CheckpointError(f"{path}: tensor {k!r} has shape {list(got[k].shape)}, but the model needs "
                                  f"{list(v.shape)} (weights of another model size)")
    missing = [k for k in want if k not in got]
    extra = [k for k in got if k not in want]
    if missing or extra:
        what = f"lacks {missing[0]!r}" if missing else f"has {extra[0]!r}, which the model does not"
        n = len(missing) + len(extra)
        raise CheckpointError(f"{path}: {what}{f' ({n} tensors differ)' if n > 1 else ''}: weights of another "
                              f"model (a different architecture, or LoRA adapters turned on/off)")


def _step_of(p: Path) -> int:
    return int(p.name.rsplit("_", 1)[1])


def is_step_name(name: str) -> bool:
    """A checkpoint directory's name: step_N."""
    return name.startswith("step_") and name[5:].isdigit()


def is_complete(p: Path) -> bool:
    """A checkpoint directory whose save got as far as trainer_state.json."""
    return p.is_dir() and (p / "trainer_state.json").is_file()


def list_checkpoints(ckpt_root: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first: step_N, or the .old_step_N a crash mid-re-save left aside
    when step_N is missing (recover_checkpoints renames it back); never the .tmp_ ones."""
    root = Path(ckpt_root)
    if not root.is_dir():
        return []
    found = {}
    for p in root.iterdir():
        name = p.name[len(ASIDE):] if p.name.startswith(ASIDE) else p.name
        if is_step_name(name) and is_complete(p) and (p.name == name or name not in found):
            found[name] = p
    return sorted(found.values(), key=_step_of)


def prune_checkpoints(ckpt_root: str | Path, keep: int) -> None:
    """Delete all but the newest `keep` checkpoints (keep 0 = keep all). Each is first renamed to a
    .tmp_ name, so a kill mid-delete leaves what recover_checkpoints removes, never a half step_N."""
    if keep > 0:
        for p in list_checkpoints(ckpt_root)[:-keep]:
            doomed = p.parent / f"{TMP}pruned_{p.name}"
            shutil.rmtree(doomed, ignore_errors=True)   # what an earlier kill left
            os.rename(p, doomed)
            _fsync_dir(p.parent)
            shutil.rmtree(doomed)


def checkpoint_at(p: Path) -> Path:
    """Where the checkpoint `p` (a step_N path) is: `p`, or the .old_step_N a crash mid-re-save left
    aside when `p` is missing (read there: it may be another run's directory, so it is not moved back)."""
    aside = p.parent / f"{ASIDE}{p.name}"
    if is_step_name(p.name) and not p.exists() and is_complete(aside):
        return aside
    return p


def set_aside(p: Path) -> Path:
    """Rename a checkpoint that failed its check out of the checkpoints' way (never deleted: it may
    hold what someone wants to look at); pruning and the next resume no longer see it."""
    n, dest = 0, p.parent / f"{UNUSABLE}{p.name.removeprefix(ASIDE)}"
    while dest.exists():
        n += 1
        dest = p.parent / f"{UNUSABLE}{p.name.removeprefix(ASIDE)}.{n}"
    os.rename(p, dest)
    _fsync_dir(p.parent)
    return dest


def check_training_checkpoint(p: Path) -> None:
    """Everything a resume reads is there and whole: the manifest check, optimizer.pt, rng.pt and a
    trainer_state.json with a step (CheckpointError naming the file otherwise)."""
    verify_checkpoint(p)
    state = _read_json(p / "trainer_state.json")
    if not isinstance(state.get("step"), int):
        raise CheckpointError(f"{p / 'trainer_state.json'}: has no step; the checkpoint is damaged")
    for name in ("optimizer.pt", "rng.pt"):
        if not (p / name).is_file():
            raise CheckpointError(f"{p / name}: missing; the checkpoint is incomplete: resume from an earlier one")


def load_ref_weights(path: str | Path, ref_model) -> None:
    """A checkpoint's ref.safetensors into `ref_model`, in place (nothing when the file is absent);
    save_model wrote one name per tied weight, and load_model reads it back that way."""
    f = Path(path) / "ref.safetensors"
    if f.is_file():
        check_safetensors(f)
        module = ref_model.hf if isinstance(ref_model, HFPolicy) else ref_model
        try:
            missing, extra = load_safetensors_model(module, str(f), strict=False)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{f}: cannot be read ({_first_line(e)})") from None
        except RuntimeError as e:   # size mismatch: name the tensor
            found = re.search(r"size mismatch for ([\w.]+): copying a param with shape (\S+ \S+) from "
                              r"checkpoint, the shape in current model is (\S+ \S+)", str(e))
            what = (f"tensor {found.group(1)!r} has {found.group(2)}, but the model needs {found.group(3)}"
                    if found else _first_line(e))
            raise CheckpointError(f"{f}: {what} (weights of another model size)") from None
        if missing or extra:
            raise CheckpointError(f"{f}: {'lacks ' + repr(missing[0]) if missing else 'has ' + repr(extra[0])} "
                                  f"({len(missing) + len(extra)} tensors differ): the reference of another model")


def checkpoint_job(path: str | Path) -> str | None:
    """The job that wrote a checkpoint (grpo, sft, dpo, rm, distill; older GRPO ones name none: grpo),
    or None when the directory has no trainer_state.json."""
    f = Path(path).expanduser() / "trainer_state.json"
    return _read_json(f).get("job", "grpo") if f.is_file() else None


def load_training_state(path: str | Path, model=None, ref_model=None) -> dict:
    """Load a checkpoint's weights into `model` (skipped when None, e.g. a model just loaded from
    this checkpoint) and its reference into `ref_model`, in place; return optimizer, scheduler,
    RNG and trainer state."""
    p = Path(path)
    check_training_checkpoint(p)
    if model is not None:
        loaded, _ = load_model(p, device=str(next(model.parameters()).device))
        check_shapes(p / "model.safetensors", loaded.state_dict(), model.state_dict())
        model.load_state_dict(loaded.state_dict())
    if ref_model is not None:
        load_ref_weights(p, ref_model)
    opt = load_plain(p / "optimizer.pt")
    rng = load_plain(p / "rng.pt")
    trainer = _read_json(p / "trainer_state.json")
    if not isinstance(opt, dict) or "optimizer" not in opt or not isinstance(rng, dict) or "torch" not in rng:
        bad = "optimizer.pt" if not isinstance(opt, dict) or "optimizer" not in opt else "rng.pt"
        raise CheckpointError(f"{p / bad}: not a grpolab checkpoint file (its keys are missing)")
    return {"optimizer": opt["optimizer"], "scheduler": opt.get("scheduler"), "rng": rng, "trainer": trainer,
            "master": opt.get("master")}


def load_plain(path: Path) -> object:
    """torch.load with weights_only=True: tensors and plain containers only, so loading a
    checkpoint can never run code pickled into it."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(e))
        what = f"it holds {found.group(1)}" if found else str(e).strip().splitlines()[0]
        raise CheckpointError(f"{path}: refusing to load it: {what}, but it must hold only tensors and plain "
                              f"containers (loaded with torch.load(weights_only=True), so loading can never run "
                              f"code); grpolab writes no such file: resume only from checkpoints you trust") from None
    except (RuntimeError, EOFError, OSError) as e:   # truncated or not a torch file at all
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path}: cannot be read ({why}); "
                              f"resume from an earlier checkpoint") from None
