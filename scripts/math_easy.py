"""Write MATH's two easiest levels as a dataset directory (train.jsonl, test.jsonl) for small models.

    python scripts/math_easy.py [SRC_DIR] [OUT_DIR]   # `make easy-data` runs it with the defaults

train: every train problem of Level 1 or 2. test: TEST_SIZE test problems of Level 1 or 2, a seeded
draw kept in file order (the file is grouped by subject; the first 500 would be mostly algebra).
Rows are copied unchanged. MATH-500 is drawn from MATH's test split, so nothing here trains on it.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

from dataset_dir import read_rows, write_dataset  # scripts/: run as files, this folder is on sys.path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SRC = ROOT.parent / "shared" / "data" / "math"
DEFAULT_OUT = ROOT / "data" / "math_easy"
LEVELS = ("Level 1", "Level 2")
TEST_SIZE = 520   # a few prompts are longer than 512 tokens: eval.num_problems=500 still finds 500
SEED = 0


def select(train: list[dict], test: list[dict]) -> tuple[list[dict], list[dict]]:
    easy_test = [r for r in test if r["level"] in LEVELS]
    keep = sorted(random.Random(SEED).sample(range(len(easy_test)), TEST_SIZE))
    return [r for r in train if r["level"] in LEVELS], [easy_test[i] for i in keep]



def main(src: Path = DEFAULT_SRC, out: Path = DEFAULT_OUT) -> None:
    train, test = select(read_rows(src / "train.jsonl"), read_rows(src / "test.jsonl"))
    write_dataset(out, {"train": train, "test": test})
    print(f"{out}: {len(train)} train, {len(test)} test problems ({' and '.join(LEVELS)})")


if __name__ == "__main__":
    main(*(Path(a) for a in sys.argv[1:3]))
