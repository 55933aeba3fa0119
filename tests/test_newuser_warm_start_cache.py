"""The warm start's cache (grpolab/train/warm_start_cache.py): a run leaves its warm start where a later
run with the same key reuses it, and the reusing run is bit-identical to one that recomputes it."""

import hashlib
import json
import os
import subprocess
import sys

from conftest import ROOT

from grpolab.train.warm_start_cache import prune

RUN = ["model.n_layer=1", "model.n_head=2", "model.n_embd=32", "model.block_size=96", "sft.steps=100",
       "sft.batch_size=4", "sft.bare_steps=0", "rollout.prompts_per_step=2", "rollout.num_generations=2",
       "rollout.max_new_tokens=8", "train.max_steps=2", "eval.num_problems=4", "eval.k=2", "train.threads=1"]


def _train(out, cache, *extra):
    env = {**os.environ, "GRPOLAB_WARM_START_CACHE": str(cache)}
    r = subprocess.run([sys.executable, "-m", "grpolab.cli", "train", *RUN, *extra, f"train.output_dir={out}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr
    return r.stdout


def _result(out):
    metrics = [{k: v for k, v in json.loads(line).items() if not k.startswith(("time/", "perf/"))}
               for line in open(out / "metrics.jsonl")]
    weights = hashlib.sha256((out / "checkpoints" / "step_2" / "model.safetensors").read_bytes()).hexdigest()
    return metrics, weights, json.loads((out / "eval.json").read_text())


def test_a_second_run_reuses_the_warm_start_bit_identically(tmp_path):
    cache = tmp_path / "cache"
    first = _train(tmp_path / "first", cache)
    assert "warm start: cached in" in first and "warm start: sft step" in first
    entries = [p for p in cache.iterdir()]
    assert len(entries) == 1 and (entries[0] / "warm_start.pt").is_file()
    assert json.loads((entries[0] / "key.json").read_text())["sft"]["steps"] == 100

    # another train.max_steps, same warm start: reused, and nothing new in the cache
    second = _train(tmp_path / "second", cache)
    assert f"warm start: reused {entries[0]}" in second and "warm start: sft step" not in second
    assert list(cache.iterdir()) == entries

    # the cache off: recomputed, nothing written; the reusing run gave the same bits
    plain = _train(tmp_path / "plain", "0")
    assert "warm start: sft step" in plain and "cached" not in plain and "reused" not in plain
    assert _result(tmp_path / "second") == _result(tmp_path / "plain") == _result(tmp_path / "first")


def test_a_changed_warm_start_setting_is_a_new_entry(tmp_path):
    cache = tmp_path / "cache"
    _train(tmp_path / "a", cache)
    out = _train(tmp_path / "b", cache, "sft.lr=1e-3")
    assert "reused" not in out and len(list(cache.iterdir())) == 2
    out = _train(tmp_path / "c", cache, "train.seed=1")
    assert "reused" not in out and len(list(cache.iterdir())) == 3
    # what the warm start does not read (the RL steps) keeps the key
    out = _train(tmp_path / "d", cache, "train.max_steps=1", "rollout.temperature=0.7")
    assert "reused" in out and len(list(cache.iterdir())) == 3


def test_a_damaged_entry_is_recomputed(tmp_path):
    cache = tmp_path / "cache"
    _train(tmp_path / "a", cache)
    entry = next(cache.iterdir())
    (entry / "warm_start.pt").write_bytes(b"not a checkpoint")
    out = _train(tmp_path / "b", cache)
    assert "reused" not in out and "warm start: sft step" in out
    assert _result(tmp_path / "a") == _result(tmp_path / "b")


def test_short_warm_starts_are_not_cached(tmp_path):
    """A smoke run's warm start (under 100 steps) costs seconds: no entry for it."""
    cache = tmp_path / "cache"
    out = _train(tmp_path / "a", cache, "sft.steps=3")
    assert "cached" not in out and not cache.exists()


def test_prune_keeps_the_most_recently_used_entries(tmp_path):
    for i in range(5):
        (tmp_path / f"e{i}").mkdir()
        os.utime(tmp_path / f"e{i}", (1000 + i, 1000 + i))
    (tmp_path / ".tmp-e9-1").mkdir()   # another process's entry being written
    prune(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-e9-1", "e3", "e4"]
