"""Fault injection into real checkpoints of a tiny run: files copied between steps, truncated, missing
or broken; a torn metrics line; a full disk; a resume with a changed config. Each is one line naming
the file (or the keys), exit 2, nothing lost; train.resume=auto falls back to the previous complete
checkpoint and continues exactly."""

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, run_cli
from safetensors.torch import save_file
from test_grpo import TINY

from grpolab.config.load import load_config
from grpolab.errors import CheckpointError, ConfigError
from grpolab.models import GPT, GPTConfig, checkpoint
from grpolab.models.checkpoint import (
    load_model,
    load_training_state,
    verify_checkpoint,
)
from grpolab.train.resume_checkpoint import find_resume_checkpoint
from grpolab.train.resume_rules import unsafe_changes
from grpolab.train.run import Run
from grpolab.train.run_logs import cut_logs

ARGS = ["train", *TINY, "reward.functions=[length]", "train.save_every=1", "train.keep_checkpoints=0"]


def _strip(path):
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(("time/", "perf/"))}
            for line in open(path)]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A finished 3-step run with checkpoints step_1..step_3 (never modified: tests work on copies)."""
    out = tmp_path_factory.mktemp("base") / "run"
    r = run_cli(*ARGS, "train.max_steps=3", f"train.output_dir={out}")
    assert r.returncode == 0, r.stderr
    return out


def _copy(base, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(base, run)
    return run


def _one_line(r):
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and len(lines) == 1, r.stderr
    return lines[0]


def _make_legacy(ckpt):
    """What a checkpoint written before manifests looks like: no manifest.json, no run_config.yaml,
    no "format" in trainer_state.json."""
    (ckpt / "manifest.json").unlink()
    (ckpt / "run_config.yaml").unlink()
    state = json.loads((ckpt / "trainer_state.json").read_text())
    del state["format"]
    (ckpt / "trainer_state.json").write_text(json.dumps(state))


def _reseal(ckpt):
    """Rewrite the manifest to match the files as they are (a tamperer can): the checks behind it must hold."""
    m = json.loads((ckpt / "manifest.json").read_text())
    for rel in m["files"]:
        data = (ckpt / rel).read_bytes()
        m["files"][rel] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / "manifest.json").write_text(json.dumps(m))


# ---------------------------------------------------------------- the manifest

@pytest.mark.slow
def test_every_checkpoint_has_a_manifest_of_its_files(base):
    ckpt = base / "checkpoints" / "step_2"
    m = json.loads((ckpt / "manifest.json").read_text())
    assert m["step"] == 2
    on_disk = sorted(p.name for p in ckpt.iterdir() if p.name != "manifest.json")
    assert sorted(m["files"]) == on_disk
    assert {"model.safetensors", "optimizer.pt", "rng.pt", "trainer_state.json", "run_config.yaml"} <= set(on_disk)
    for name, info in m["files"].items():   # an independent hash of each file
        data = (ckpt / name).read_bytes()
        assert info == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert (ckpt / "run_config.yaml").read_text() == (base / "config.yaml").read_text()


@pytest.mark.parametrize("name", ["trainer_state.json", "optimizer.pt", "model.safetensors"])
def test_a_file_copied_from_another_step_is_refused_by_name(base, tmp_path, name):
    run = _copy(base, tmp_path)
    step3 = run / "checkpoints" / "step_3"
    shutil.copyfile(run / "checkpoints" / "step_2" / name, step3 / name)
    with pytest.raises(CheckpointError, match=rf"step_3/{name}: .*(checksum|bytes, but manifest\.json says)"):
        find_resume_checkpoint(str(step3), run)
    with pytest.raises(CheckpointError, match=rf"step_3/{name}"):
        load_training_state(step3)


def test_the_cli_refuses_a_mixed_checkpoint_in_one_line_and_keeps_config_yaml(base, tmp_path):
    run = _copy(base, tmp_path)
    step3 = run / "checkpoints" / "step_3"
    shutil.copyfile(run / "checkpoints" / "step_2" / "optimizer.pt", step3 / "optimizer.pt")
    before = (run / "config.yaml").read_text()
    r = run_cli(*ARGS, "train.max_steps=4", f"train.output_dir={run}", f"train.resume={step3}")
    line = _one_line(r)
    assert line.startswith("grpolab: checkpoint error: ") and "step_3/optimizer.pt" in line, line
    assert (run / "config.yaml").read_text() == before
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_1", "step_2", "step_3"]


def test_a_missing_or_unlisted_file_and_a_renamed_step_are_refused(base, tmp_path):
    run = _copy(base, tmp_path)
    ckpts = run / "checkpoints"
    (ckpts / "step_3" / "rng.pt").unlink()
    with pytest.raises(CheckpointError, match=r"step_3/rng\.pt: missing \(listed in manifest\.json\)"):
        find_resume_checkpoint(str(ckpts / "step_3"), run)
    (ckpts / "step_2" / "eval.json").write_text("{}")   # what `grpolab eval CKPT` writes there: not read by a load
    assert find_resume_checkpoint(str(ckpts / "step_2"), run) == ckpts / "step_2"
    shutil.copyfile(ckpts / "step_1" / "optimizer.pt", ckpts / "step_2" / "ref.safetensors")
    with pytest.raises(CheckpointError, match=r"step_2/ref\.safetensors: not in manifest\.json"):
        find_resume_checkpoint(str(ckpts / "step_2"), run)
    (ckpts / "step_1" / "manifest.json").unlink()   # a new checkpoint that lost its manifest: incomplete
    with pytest.raises(CheckpointError, match=r"step_1/manifest\.json: missing"):
        load_model(ckpts / "step_1")
    shutil.copytree(base / "checkpoints" / "step_1", ckpts / "step_7")
    with pytest.raises(CheckpointError, match=r"written for step 1, but the directory is step_7"):
        find_resume_checkpoint(str(ckpts / "step_7"), run)


@pytest.mark.slow
def test_resume_auto_falls_back_to_the_previous_checkpoint_and_continues_exactly(base, tmp_path):
    """step_3 holds step_2's optimizer state, and the crash tore metrics.jsonl's last line: resume=auto
    says so, moves step_3 aside, resumes from step_2 and writes the uninterrupted run's records and weights."""
    run = _copy(base, tmp_path)
    ckpts = run / "checkpoints"
    shutil.copyfile(ckpts / "step_2" / "optimizer.pt", ckpts / "step_3" / "optimizer.pt")
    text = (run / "metrics.jsonl").read_text()
    (run / "metrics.jsonl").write_text(text[:len(text) - 40])   # step 3's line cut mid-write
    r = run_cli(*ARGS, "train.max_steps=3", f"train.output_dir={run}", "train.resume=auto")
    assert r.returncode == 0, r.stderr
    assert "warning: train.resume=auto: step_3 is unusable" in r.stderr and "step_3/optimizer.pt" in r.stderr
    assert "resuming from step_2" in r.stderr
    assert _strip(run / "metrics.jsonl") == _strip(base / "metrics.jsonl")
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_1", "step_2", "step_3", "unusable_step_3"]
    for name in ("model.safetensors", "optimizer.pt"):   # bit-identical to the run that never broke
        assert (ckpts / "step_3" / name).read_bytes() == (base / "checkpoints" / "step_3" / name).read_bytes()


def test_resume_auto_with_no_usable_checkpoint_refuses_and_moves_nothing(base, tmp_path):
    run = _copy(base, tmp_path)
    for n in (1, 2, 3):
        (run / "checkpoints" / f"step_{n}" / "rng.pt").unlink()
    with pytest.raises(CheckpointError, match=r"no usable checkpoint .*step_3/rng\.pt: missing"):
        find_resume_checkpoint("auto", run)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_1", "step_2", "step_3"]


# ---------------------------------------------------------------- checkpoints written before manifests

def test_a_checkpoint_without_a_manifest_still_resumes(base, tmp_path):
    run = _copy(base, tmp_path)
    ckpt = run / "checkpoints" / "step_2"
    _make_legacy(ckpt)
    assert find_resume_checkpoint(str(ckpt), run) == ckpt
    state = load_training_state(ckpt, load_model(ckpt)[0])
    assert state["trainer"]["step"] == 2


@pytest.mark.parametrize("legacy", [False, True])
def test_a_truncated_weights_file_is_one_line_naming_it(base, tmp_path, legacy):
    run = _copy(base, tmp_path)
    ckpt = run / "checkpoints" / "step_2"
    if legacy:
        _make_legacy(ckpt)
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[:len(data) - 1000])
    with pytest.raises(CheckpointError, match=rf"step_2/model\.safetensors: {len(data) - 1000} bytes, but"):
        load_model(ckpt)


def test_truncated_weights_under_init_from_are_one_line(base, tmp_path):
    run = _copy(base, tmp_path)
    ckpt = run / "checkpoints" / "step_2"
    _make_legacy(ckpt)
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[:20])   # not even the whole header
    r = run_cli(*ARGS, "train.max_steps=1", f"train.output_dir={tmp_path / 'new'}", f"model.init_from={ckpt}")
    line = _one_line(r)
    assert "step_2/model.safetensors: not a complete safetensors file" in line, line


def test_a_truncated_reference_is_refused_by_name(base, tmp_path):
    from grpolab.models.checkpoint import load_ref_weights
    run = _copy(base, tmp_path)
    ckpt = run / "checkpoints" / "step_2"
    _make_legacy(ckpt)
    model, _ = load_model(ckpt)
    shutil.copyfile(ckpt / "model.safetensors", ckpt / "ref.safetensors")
    load_ref_weights(ckpt, model)   # whole: loads
    data = (ckpt / "ref.safetensors").read_bytes()
    (ckpt / "ref.safetensors").write_bytes(data[:-8])
    with pytest.raises(CheckpointError, match=r"step_2/ref\.safetensors: \d+ bytes, but its header describes"):
        load_ref_weights(ckpt, model)


def test_weights_of_another_model_size_are_one_line_naming_a_tensor(base, tmp_path):
    run = _copy(base, tmp_path)
    ckpt = run / "checkpoints" / "step_2"
    cfg = json.loads((ckpt / "model_config.json").read_text())
    cfg.pop("type")
    wide = GPT(GPTConfig(**{**cfg, "n_embd": 64}))
    save_file({k: v.contiguous() for k, v in wide.state_dict().items()}, str(ckpt / "model.safetensors"))
    _reseal(ckpt)
    with pytest.raises(CheckpointError, match=r"step_2/model\.safetensors: tensor '[\w.]+' has shape \[\d+, 64\], "
                                              r"but the model needs \[\d+, 32\] \(weights of another model size\)"):
        load_model(ckpt)


def test_a_broken_trainer_state_or_missing_rng_in_an_old_checkpoint_is_one_line(base, tmp_path):
    run = _copy(base, tmp_path)
    ckpts = run / "checkpoints"
    for n in (1, 2, 3):
        _make_legacy(ckpts / f"step_{n}")
    (ckpts / "step_3" / "trainer_state.json").write_text('{"step": 3, "sampler"')
    with pytest.raises(CheckpointError, match=r"step_3/trainer_state\.json: cannot be read"):
        find_resume_checkpoint(str(ckpts / "step_3"), run)
    (ckpts / "step_2" / "rng.pt").unlink()
    with pytest.raises(CheckpointError, match=r"step_2/rng\.pt: missing"):
        load_training_state(ckpts / "step_2")
    r = run_cli(*ARGS, "train.max_steps=3", f"train.output_dir={run}", f"train.resume={ckpts / 'step_3'}")
    assert "step_3/trainer_state.json: cannot be read" in _one_line(r)


# ---------------------------------------------------------------- metrics.jsonl

def test_cut_logs_drops_a_torn_last_line_and_names_a_broken_one_before_it(tmp_path):
    lines = [json.dumps({"step": s, "reward": s / 10}) for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n" + '{"step": 4, "rew')
    cut_logs(tmp_path, 2)
    assert (tmp_path / "metrics.jsonl").read_text() == lines[0] + "\n" + lines[1] + "\n"
    (tmp_path / "metrics.jsonl").write_text(lines[0] + "\n" + '{"step": 2, "rew' + "\n" + lines[2] + "\n")
    with pytest.raises(CheckpointError, match=r"metrics\.jsonl: line 2 is not a log record"):
        cut_logs(tmp_path, 3)


# ---------------------------------------------------------------- resume with a changed config

def test_unsafe_changes_follow_the_documented_list():
    old = {"train": {"seed": 0, "max_steps": 3, "threads": 0}, "rollout": {"num_generations": 4},
           "log": {"samples_every": 10}, "sft": {"steps": 10}, "model": {"lora_rank": 0}}
    new = {"train": {"seed": 1, "max_steps": 9, "threads": 2}, "rollout": {"num_generations": 8},
           "log": {"samples_every": 1}, "sft": {"steps": 20}, "model": {"lora_rank": 8}, "added": {"key": 1}}
    assert unsafe_changes(old, new, "grpo") == ["model.lora_rank (0 -> 8)", "rollout.num_generations (4 -> 8)",
                                                "sft.steps (10 -> 20)", "train.seed (0 -> 1)"]
    assert "sft.steps (10 -> 20)" not in unsafe_changes(old, new, "sft")   # the sft job's length


@pytest.mark.parametrize("change", [["train.seed=5", "rollout.num_generations=8", "algorithm.beta=0.04"],
                                    ["model.lora_rank=4"]])
def test_resume_with_a_changed_config_is_refused_listing_the_keys(base, tmp_path, change):
    run = _copy(base, tmp_path)
    before = (run / "config.yaml").read_text()
    cfg = load_config(None, ARGS[1:] + ["train.max_steps=5", f"train.output_dir={run}", "train.resume=auto",
                                         *change])
    keys = sorted(c.split("=")[0] for c in change)
    with pytest.raises(ConfigError, match=r"train\.resume: .*step_3 was written with a different config; .*"
                                          + r".*".join(k.replace(".", r"\.") for k in keys)):
        Run(cfg).start()
    assert (run / "config.yaml").read_text() == before   # a refused resume leaves config.yaml as it was


@pytest.mark.slow
def test_resume_with_safe_changes_goes_on_and_updates_config_yaml(base, tmp_path):
    run = _copy(base, tmp_path)
    r = run_cli(*ARGS, "train.max_steps=4", "log.samples_every=2", "eval.k=4", f"train.output_dir={run}",
                "train.resume=auto")
    assert r.returncode == 0, r.stderr
    assert [m["step"] for m in _strip(run / "metrics.jsonl")] == [1, 2, 3, 4]
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["train"]["max_steps"] == 4 and saved["eval"]["k"] == 4
    assert yaml.safe_load((run / "checkpoints" / "step_4" / "run_config.yaml").read_text()) == saved
    r = run_cli(*ARGS, "train.max_steps=4", "train.seed=1", f"train.output_dir={run}", "train.resume=auto")
    assert "train.seed (0 -> 1)" in _one_line(r)


# ---------------------------------------------------------------- a full disk

def _in_tiny_tmpfs(size: str, mnt, script: str) -> subprocess.CompletedProcess:
    """Run `script` (sh) in a private mount namespace with a tmpfs of `size` at `mnt`; skip when this
    machine cannot (not root, no unshare)."""
    mnt.mkdir()
    if shutil.which("unshare") is None:
        pytest.skip("no unshare here")
    probe = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=64k none {mnt}"],
                           capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {probe.stderr.strip()}")
    return subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size={size} none {mnt} && {script}"],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)


@pytest.mark.slow
def test_a_full_disk_is_one_line_that_names_the_checkpoint_kept(base, tmp_path):
    """A tmpfs that holds step_1 but not step_2 (its optimizer.pt: torch's writer fails 'unexpected pos')."""
    mnt, saved = tmp_path / "mnt", tmp_path / "saved"
    cli = " ".join([sys.executable, "-m", "grpolab.cli", *ARGS, "train.max_steps=3", "train.keep_checkpoints=1",
                    f"train.output_dir={mnt}/run"])
    r = _in_tiny_tmpfs("420k", mnt, f"{cli}; rc=$?; cp -a {mnt}/run {saved}; exit $rc")
    line = _one_line(r)
    assert line == (f"grpolab: checkpoint error: cannot write checkpoint {mnt}/run/checkpoints/step_2 (at "
                    f"optimizer.pt): the disk is full; kept {mnt}/run/checkpoints/step_1 (complete); "
                    f"free space and continue with train.resume=auto"), line
    assert sorted(p.name for p in (saved / "checkpoints").iterdir()) == ["step_1"]   # no half-written staging
    verify_checkpoint(saved / "checkpoints" / "step_1")
    for name in ("model.safetensors", "optimizer.pt"):   # the kept one is the uninterrupted run's step_1
        assert ((saved / "checkpoints" / "step_1" / name).read_bytes()
                == (base / "checkpoints" / "step_1" / name).read_bytes())


SAVE_ON_FULL_DISK = """
import sys, torch
from grpolab.models import GPT, GPTConfig
from grpolab.models.checkpoint import CheckpointError, save_checkpoint
torch.manual_seed(0)
model = GPT(GPTConfig(vocab_size=64, n_layer=1, n_head=2, n_embd=64, block_size=32))
save_checkpoint(sys.argv[1], 1, model, trainer_state={})
try:
    save_checkpoint(sys.argv[1], 2, model, trainer_state={})
except CheckpointError as e:
    print(e)
    print(type(e.__context__).__name__, e.__context__)   # what the writer raised
"""


def test_a_full_disk_while_writing_the_weights_is_a_checkpoint_error(tmp_path):
    """The safetensors writer's failure ('No space left on device'), from the model file itself."""
    mnt = tmp_path / "mnt"
    (tmp_path / "save.py").write_text(SAVE_ON_FULL_DISK)
    model = GPT(GPTConfig(vocab_size=64, n_layer=1, n_head=2, n_embd=64, block_size=32))
    size = sum(p.numel() for p in model.parameters()) * 4   # bytes of model.safetensors, about
    r = _in_tiny_tmpfs(f"{size * 3 // 2 // 1024}k", mnt,
                       f"{sys.executable} {tmp_path / 'save.py'} {mnt}/ckpts && ls -a {mnt}/ckpts")
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    assert out[0] == (f"cannot write checkpoint {mnt}/ckpts/step_2: the disk is full; kept {mnt}/ckpts/step_1 "
                      f"(complete); free space and continue with train.resume=auto"), r.stdout
    assert out[1].startswith("SafetensorError ") and "No space left on device" in out[1], out[1]
    assert sorted(out[2:]) == [".", "..", "step_1"]


# ---------------------------------------------------------------- pruning

def test_a_kill_mid_prune_leaves_no_half_checkpoint_and_the_next_save_clears_it(base, tmp_path, monkeypatch):
    """A kill lands while pruning deletes step_1, after it removed trainer_state.json: the half
    directory must not stay as step_1 (no longer a complete checkpoint, pruning never saw it again)."""
    root = _copy(base, tmp_path) / "checkpoints"
    real_rmtree = shutil.rmtree

    def killed_part_way(path, *a, **k):
        if (Path(path) / "trainer_state.json").exists():
            (Path(path) / "trainer_state.json").unlink()
            raise KeyboardInterrupt
        real_rmtree(path, *a, **k)

    monkeypatch.setattr(checkpoint.shutil, "rmtree", killed_part_way)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.prune_checkpoints(root, keep=2)
    monkeypatch.setattr(checkpoint.shutil, "rmtree", real_rmtree)
    assert not (root / "step_1").exists()
    assert [p.name for p in checkpoint.list_checkpoints(root)] == ["step_2", "step_3"]
    checkpoint.recover_checkpoints(root)   # what the next save and a resume call first
    assert sorted(p.name for p in root.iterdir()) == ["step_2", "step_3"]
