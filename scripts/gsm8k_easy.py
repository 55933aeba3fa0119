"""Write GSM8K's easiest problems, by the number of calculations in the reference solution, as a
dataset directory (train.jsonl, test.jsonl) for small models.

    python scripts/gsm8k_easy.py [SRC_DIR] [OUT_DIR]   # `make gsm8k-easy` runs it with the defaults

train: every train problem whose solution has at most MAX_TRAIN_STEPS '<<...>>' calculations.
test: the TEST_SIZE test problems with the fewest calculations (ties: shorter question first, then
file order). Rows are copied unchanged; only the selection is ours. Nothing from the test split
enters train.
"""

from __future__ import annotations

import sys
from pathlib import Path

from dataset_dir import read_rows, write_dataset  # scripts/: run as files, this folder is on sys.path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SRC = ROOT.parent / "shared" / "data" / "gsm8k"
DEFAULT_OUT = ROOT / "data" / "gsm8k_easy"
MAX_TRAIN_STEPS = 2
TEST_SIZE = 500


def steps(row: dict) -> int:
    """Calculations in a GSM8K reference solution (its '<<a*b=c>>' annotations)."""
    return row["answer"].count("<<")


def select(train: list[dict], test: list[dict]) -> tuple[list[dict], list[dict]]:
    easy_train = [r for r in train if steps(r) <= MAX_TRAIN_STEPS]
    order = sorted(range(len(test)), key=lambda i: (steps(test[i]), len(test[i]["question"]), i))
    return easy_train, [test[i] for i in sorted(order[:TEST_SIZE])]



def main(src: Path = DEFAULT_SRC, out: Path = DEFAULT_OUT) -> None:
    train, test = select(read_rows(src / "train.jsonl"), read_rows(src / "test.jsonl"))
    write_dataset(out, {"train": train, "test": test})
    print(f"{out}: {len(train)} train, {len(test)} test problems "
          f"(max {max(map(steps, test))} calculations in test)")


if __name__ == "__main__":
    main(*(Path(a) for a in sys.argv[1:3]))
