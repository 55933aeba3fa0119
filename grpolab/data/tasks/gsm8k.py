"""GSM8K grade-school math: rows with the question, the final number, and the worked solution.

    source row: {"question": "Janet's ducks lay 16 eggs ...", "answer": "... 9 * 2 = $<<9*2=18>>18 ...\n#### 18"}
    our row:    {"prompt": "Janet's ducks lay 16 eggs ...", "answer": "18", "solution": "... #### 18"}

Reads a jsonl/parquet file, a directory with train/test files, or the hub name 'openai/gsm8k'.
"""

from __future__ import annotations

from grpolab.data.answers import extract_hash_answer, final_answer_text, format_number
from grpolab.data.loading import read_records

from ...errors import DataError

HUB_NAMES = ("openai/gsm8k", "gsm8k")


def final_answer(solution: str) -> str | None:
    """The solution's answer in canonical form ('#### 1,000' -> '1000', '#### -3.50' -> '-3.5',
    '#### 1/3' -> '1/3'): the first number on the line after the last '####', read by
    `grpolab.data.answers` (the reader gsm8k_accuracy uses); None when that line has none."""
    value = extract_hash_answer(solution)
    return None if value is None else format_number(value)


def load_gsm8k(path: str, split: str | None = None) -> list[dict]:
    """GSM8K rows {'prompt', 'answer', 'solution'} (plus any extra columns) from `path`."""
    # the hub dataset has two configs ('main', 'socratic'); local files have none
    records = read_records(path, split, dataset_config="main" if path in HUB_NAMES else None)
    where = f"{path}" + (f" ({split})" if split else "")
    if not records:
        raise DataError(f"{where}: no rows; check the file and the split")
    rows = []
    for i, record in enumerate(records, start=1):
        for column in ("question", "answer"):
            if column not in record:
                raise DataError(f"{where}: row {i}: no {column!r} column; columns are {sorted(record)}; "
                                "GSM8K rows need 'question' and 'answer' (load other formats with data.prompt_key)")
        question, solution = record["question"], record["answer"]
        if not isinstance(question, str) or not isinstance(solution, str):
            raise DataError(f"{where}: row {i}: 'question' and 'answer' must be strings")
        answer = final_answer(solution)
        if answer is None:
            line = final_answer_text(solution)
            found = "no '####'" if line is None else f"its last '####' line reads {line[:40]!r}"
            raise DataError(f"{where}: row {i}: answer has no final '#### <number>' line ({found}); "
                            "end the answer with one or drop the row")
        extra = {k: v for k, v in record.items() if k not in ("question", "answer")}
        rows.append({**extra, "prompt": question, "answer": answer, "solution": solution})
    return rows
