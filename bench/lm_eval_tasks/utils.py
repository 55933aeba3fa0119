"""Scoring for gsm8k_local.yaml and math_local.yaml: grpolab's own answer readers, called from lm-eval.

Why not an lm-eval regex filter: grpolab reads the first number after the LAST '####' with rules no
single regex states (valid thousands separators only, exact fractions and decimals, '1/0' or '1.5/2'
giving no answer); a regex would disagree on some completions, and the comparison with `grpolab eval`
would then measure two readers instead of two generators. `strict_match` is lm-eval's stock GSM8K rule
(the first '#### <digits, dots, commas>' match, compared as text without ',' '$' and a final '.'),
reported beside it only to show how much the reader alone moves the score.
"""

from __future__ import annotations

import re

from grpolab.data.tasks.gsm8k import final_answer
from grpolab.rewards.accuracy import gsm8k_accuracy, math_accuracy

_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")


def _strict_text(text: str) -> str:
    return re.sub(r"\.$", "", text.replace(",", "").replace("$", "")).strip()


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    completion = results[0]
    reference = final_answer(doc["answer"])   # the reference exactly as grpolab's GSM8K loader reads it
    acc = gsm8k_accuracy(None, [completion], [reference])[0]
    m = _STRICT.search(completion)
    strict = float(m is not None and _strict_text(m.group(1)) == _strict_text(doc["answer"].split("####")[-1]))
    return {"acc": acc, "strict_match": strict}


def process_results_math(doc: dict, results: list[str]) -> dict[str, float]:
    # math_accuracy says None when the reference has no readable answer; grpolab's eval counts that wrong
    return {"acc": 1.0 if math_accuracy(None, [results[0]], [doc["solution"]])[0] == 1.0 else 0.0}
