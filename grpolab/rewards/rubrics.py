"""Rubric retrieval for LLM judges: the rubric rows whose questions are most like a new question
(TF-IDF cosine similarity over lower-cased word tokens), to show the judge as worked examples.

A few dozen lines rather than scikit-learn: the index is small (one row per rubric) and this is
all of TF-IDF that retrieval needs."""

from __future__ import annotations

import math
import re
from collections import Counter

from ..data.loading import read_records
from ..errors import DataError

_WORD = re.compile(r"[a-z0-9]+")


def _tokens(text: str) -> list[str]:
    return _WORD.findall(str(text).lower())


class RubricIndex:
    """rows: {'question', 'rubric'} dicts. `top(question, k)` returns the k most similar rows, most
    similar first; ties (and rows sharing no word) keep file order."""

    def __init__(self, rows: list[dict]) -> None:
        self.rows = rows
        docs = [Counter(_tokens(r["question"])) for r in rows]
        df = Counter(w for d in docs for w in d)
        n = len(docs)
        # smoothed idf, as scikit-learn's default: a word in every row still counts a little
        self.idf = {w: math.log((1 + n) / (1 + c)) + 1 for w, c in df.items()}
        self.vectors = [self._unit(d) for d in docs]

    def _unit(self, counts: Counter) -> dict[str, float]:
        v = {w: c * self.idf[w] for w, c in counts.items() if w in self.idf}
        norm = math.sqrt(sum(x * x for x in v.values())) or 1.0
        return {w: x / norm for w, x in v.items()}

    def similarity(self, question: str) -> list[float]:
        q = self._unit(Counter(_tokens(question)))
        return [sum(x * v.get(w, 0.0) for w, x in q.items()) for v in self.vectors]

    def top(self, question: str, k: int) -> list[dict]:
        sims = self.similarity(question)
        order = sorted(range(len(self.rows)), key=lambda i: (-sims[i], i))
        return [self.rows[i] for i in order[:k]]


def load_rubrics(path: str, where: str) -> RubricIndex:
    """A RubricIndex of a jsonl/json/parquet file of {question, rubric} rows; DataError naming the row."""
    records = read_records(path, "train", None)
    if not records:
        raise DataError(f"{where}: {path} has no rows")
    for i, r in enumerate(records, start=1):
        for key in ("question", "rubric"):
            if not isinstance(r, dict) or not isinstance(r.get(key), str) or not r[key].strip():
                raise DataError(f"{where}: {path} row {i}: needs a non-empty {key!r} text")
    return RubricIndex(records)
