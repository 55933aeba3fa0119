"""docs/architecture.md's two worked examples, installed as written there: a new advantage estimator and a
new rollout source, each trained with; the estimator checked against ranks counted here."""

import ast
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT
from test_grpo import make_trainer

from grpolab.config import names

DOC = (ROOT / "docs" / "architecture.md").read_text()


def block_after(marker: str) -> str:
    """The first ```python block after `marker` in the page."""
    start = DOC.index(marker)
    return re.search(r"```python\n(.*?)```", DOC[start:], re.S).group(1)


def install(module: str, file: str, tmp_path: Path, monkeypatch) -> None:
    """The page's code for `file`, imported as the package module `module` (its relative imports resolve), for
    this test only."""
    path = tmp_path / Path(file).name
    path.write_text(block_after(f"`{file}`:"))
    spec = importlib.util.spec_from_file_location(module, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setitem(sys.modules, module, mod)


def declare(registry: str, monkeypatch) -> str:
    """The page's one line for `registry` in config/names.py, added to it for this test: its name."""
    ((name, entry),) = ast.literal_eval("{" + block_after(f"In `{registry}`") + "}").items()
    monkeypatch.setitem(getattr(names, registry), name, entry)
    return name


def test_the_documented_estimator_trains_and_ranks_within_groups(tmp_path, monkeypatch):
    install("grpolab.algorithms.rank_advantages", "grpolab/algorithms/rank_advantages.py", tmp_path, monkeypatch)
    name = declare("ADV_ESTIMATORS", monkeypatch)
    tr = make_trainer(tmp_path / "run", "sft.steps=0", "reward.functions=[length]", f"algorithm.adv_estimator={name}")
    batch, _ = tr.collect()
    tr.advantages(batch, None)
    for i in range(len(batch)):   # mid-ranks counted by hand, scaled to [-1, 1]
        peers = [float(batch.rewards[j]) for j in range(len(batch)) if batch.group_ids[j] == batch.group_ids[i]]
        r, n = float(batch.rewards[i]), len(peers)
        rank = sum(p < r for p in peers) + (sum(p == r for p in peers) - 1) / 2
        assert float(batch.advantages[i]) == pytest.approx((2 * rank - (n - 1)) / max(n - 1, 1), abs=1e-6)
    assert any(float(a) != 0 for a in batch.advantages)
    before = [p.detach().clone() for p in tr.model.parameters()]
    assert tr.update(batch)["grad_norm"] > 0
    assert any(not torch.equal(a, p) for a, p in zip(before, tr.model.parameters()))


def test_the_documented_source_records_what_it_samples_and_trains_as_the_builtin_one(tmp_path, monkeypatch):
    install("grpolab.rollout.recording_source", "grpolab/rollout/recording_source.py", tmp_path, monkeypatch)
    name = declare("SOURCES", monkeypatch)
    args = ["sft.steps=0", "reward.functions=[length]", "train.max_steps=2", "eval.num_problems=0"]
    rows = {}
    for source in ("builtin", name):
        tr = make_trainer(tmp_path / source, *args, f"rollout.source={source}")
        assert type(tr.source).__name__ == ("BuiltinSource" if source == "builtin" else "RecordingSource")
        history = tr.train()
        rows[source] = [{k: v for k, v in m.items() if not k.startswith(("time/", "perf/"))} for m in history]
    assert rows[name] == rows["builtin"]   # the same completions, so the same run
    recorded = [json.loads(line) for line in open(tmp_path / name / "rollouts.jsonl")]
    assert [(r["step"], r["group"]) for r in recorded] == [(s, g) for s in (1, 2) for g in (0, 1) for _ in range(4)]
    assert all(r["version"] == r["step"] - 1 for r in recorded)   # sampled by the policy before the step
    samples = [json.loads(line) for line in open(tmp_path / name / "samples.jsonl")]
    assert [s["completion"] for s in samples if s["step"] == 1] == \
        [r["completion"] for r in recorded if r["step"] == 1][:len([s for s in samples if s["step"] == 1])]
