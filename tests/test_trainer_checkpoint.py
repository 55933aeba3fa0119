"""Checkpoints: re-saving a step never leaves a moment without a valid checkpoint, and loading
refuses anything but tensors and plain containers (torch.load weights_only=True)."""

import copy
import hashlib
import json
import shutil

import pytest
import torch
from test_grpo import make_trainer

from grpolab.errors import CheckpointError
from grpolab.models.checkpoint import _install, _stage, list_checkpoints, load_training_state
from grpolab.train.resume_checkpoint import find_resume_checkpoint


def _weights(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _same(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


def reseal(path):
    """Rewrite a checkpoint's manifest.json to match its files as they are now: what someone who
    tampers with a file can also do; the checks behind the manifest must still hold."""
    m = json.loads((path / "manifest.json").read_text())
    for rel in m["files"]:
        data = (path / rel).read_bytes()
        m["files"][rel] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (path / "manifest.json").write_text(json.dumps(m))


def test_resaving_a_step_leaves_a_valid_checkpoint_between_every_two_operations(tmp_path):
    """Stage a new step_1 over an existing one and stop after each filesystem operation of the
    swap; a copy of the directory at that moment (what a crash would leave) must resume from a
    complete step_1 holding the old or the new weights, never from nothing."""
    out = tmp_path / "run"
    tr = make_trainer(out, "sft.steps=0", "reward.functions=[length]")
    tr.train_step()
    tr.save()
    old = _weights(tr.model)
    with torch.no_grad():
        for p in tr.model.parameters():
            p.add_(1.0)
    new = _weights(tr.model)
    root = out / "checkpoints"
    tmp = _stage(root, 1, tr.model, optimizer=tr.opt, scheduler=tr.sched, rng={"torch": torch.get_rng_state()},
                 trainer_state={"sampler": tr.sampler.state()})
    probe = copy.deepcopy(tr.model)   # each crash copy is loaded into this
    seen = []

    def crash_copy(k):
        crashed = tmp_path / f"crash{k}"
        shutil.copytree(out, crashed, symlinks=True)
        ckpt = find_resume_checkpoint("auto", crashed)
        left = sorted(p.name for p in (crashed / "checkpoints").iterdir())
        assert ckpt is not None and ckpt.name == "step_1", (k, left)
        assert [p.name for p in list_checkpoints(crashed / "checkpoints")] == ["step_1"]
        load_training_state(ckpt, probe, None)
        w = _weights(probe)
        seen.append("new" if _same(w, new) else "old" if _same(w, old) else "?")

    crash_copy(0)
    for k, _ in enumerate(_install(tmp, root / "step_1"), start=1):
        crash_copy(k)
    assert len(seen) >= 4 and "?" not in seen   # before, and after each of >= 3 operations
    assert seen[0] == "old" and seen[-1] == "new" and seen == sorted(seen, key=["old", "new"].index), seen
    assert sorted(p.name for p in root.iterdir()) == ["step_1"]   # nothing left aside at the end


def test_a_crash_with_the_old_checkpoint_aside_is_recovered_by_the_next_save(tmp_path):
    out = tmp_path / "run"
    tr = make_trainer(out, "sft.steps=0", "reward.functions=[length]")
    tr.train_step()
    tr.save()
    root = out / "checkpoints"
    tmp = _stage(root, 1, tr.model, optimizer=tr.opt, scheduler=tr.sched, trainer_state={})
    swap = _install(tmp, root / "step_1")
    next(swap)   # crash right after the old step_1 was moved aside
    assert not (root / "step_1").exists()
    assert [p.name for p in list_checkpoints(root)] == [".old_step_1"]   # still found, not lost
    # an explicit train.resume=.../step_1 reads it where it is (it may be another run's directory)
    assert find_resume_checkpoint(str(root / "step_1"), out) == root / ".old_step_1"
    tr.train_step()
    tr.save()     # step_2: the save first puts the aside step_1 back
    assert sorted(p.name for p in root.iterdir()) == ["step_1", "step_2"]


def test_saved_state_loads_with_weights_only(tmp_path):
    tr = make_trainer(tmp_path, "sft.steps=0", "reward.functions=[length]", "algorithm.beta=0.04")
    tr.train_step()
    path = tr.save()
    opt = torch.load(path / "optimizer.pt", weights_only=True)
    rng = torch.load(path / "rng.pt", weights_only=True)
    assert set(opt) == {"optimizer", "scheduler"} and opt["scheduler"]["last_epoch"] == 1
    assert torch.equal(rng["generator"], tr.gen.get_state())


class _Payload:
    """Unpickling this calls open(path, 'w'): what an arbitrary pickled object can do."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


@pytest.mark.parametrize("name", ["optimizer.pt", "rng.pt"])
def test_a_checkpoint_with_a_pickled_object_is_refused(tmp_path, name):
    tr = make_trainer(tmp_path / "run", "sft.steps=0", "reward.functions=[length]")
    tr.train_step()
    path = tr.save()
    marker = tmp_path / "was_run"
    torch.save({"optimizer": _Payload(marker), "scheduler": None, "torch": _Payload(marker)}, path / name)
    reseal(path)
    with pytest.raises(CheckpointError, match=rf"{name}.*only tensors and plain containers"):
        tr.restore(path)
    assert not marker.exists()   # the payload never ran


def test_a_truncated_checkpoint_file_is_one_clear_error(tmp_path):
    tr = make_trainer(tmp_path / "run", "sft.steps=0", "reward.functions=[length]")
    tr.train_step()
    path = tr.save()
    data = (path / "optimizer.pt").read_bytes()
    (path / "optimizer.pt").write_bytes(data[:len(data) // 2])
    # the manifest finds it by size, before torch reads it
    with pytest.raises(CheckpointError, match=rf"optimizer\.pt: {len(data) // 2} bytes, but manifest\.json says "
                                              rf"{len(data)} \(truncated"):
        tr.restore(path)
    reseal(path)   # a consistent manifest (or none): torch's own failure is still one clear line
    with pytest.raises(CheckpointError, match=r"optimizer\.pt: cannot be read .*resume from an earlier checkpoint"):
        tr.restore(path)
