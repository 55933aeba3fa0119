"""scripts/gsm8k_easy.py and scripts/math_easy.py: the easy subsets the real-model configs train on,
checked against the shared data files read plainly here."""

import json
import subprocess
import sys

from conftest import ROOT

SHARED = ROOT.parent / "shared" / "data"


def _rows(path):
    return [json.loads(line) for line in open(path) if line.strip()]


def _make(script, tmp_path):
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / script), str(SHARED / script.split("_")[0]), str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert not list(out.glob("*.partial"))
    return _rows(out / "train.jsonl"), _rows(out / "test.jsonl")


def test_gsm8k_easy(tmp_path):
    train, test = _make("gsm8k_easy.py", tmp_path)
    all_train, all_test = _rows(SHARED / "gsm8k" / "train.jsonl"), _rows(SHARED / "gsm8k" / "test.jsonl")
    calcs = lambda r: r["answer"].count("<<")   # noqa: E731
    assert train == [r for r in all_train if calcs(r) <= 2] and len(train) > 2000
    assert len(test) == 500
    # the 500 with the fewest calculations, shorter questions first among equals, in file order
    left_out = [r for r in all_test if r not in test]
    worst_kept = max((calcs(r), len(r["question"])) for r in test)
    assert all((calcs(r), len(r["question"])) >= worst_kept for r in left_out)
    assert test == [r for r in all_test if r in test]
    assert not {r["question"] for r in train} & {r["question"] for r in test}


def test_math_easy(tmp_path):
    train, test = _make("math_easy.py", tmp_path)
    all_train, all_test = _rows(SHARED / "math" / "train.jsonl"), _rows(SHARED / "math" / "test.jsonl")
    easy = ("Level 1", "Level 2")
    assert train == [r for r in all_train if r["level"] in easy]
    assert len(test) == 520 and len({r["unique_id"] for r in test}) == 520
    assert all(r["level"] in easy for r in test)
    assert test == [r for r in all_test if r in test]                      # file order kept
    assert len({r["type"] for r in test}) == 7                             # a draw over all subjects
    assert not {r["problem"] for r in train} & {r["problem"] for r in test}
    assert _make("math_easy.py", tmp_path / "again")[1] == test            # seeded: the same draw
