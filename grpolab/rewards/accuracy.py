"""The accuracy rewards: 1.0 when a completion's final answer equals the row's `answer`.

gsm8k_accuracy reads '#### N' answers exactly (data/answers.py); math_accuracy checks LaTeX and
plain answers with math-verify (data/math_answers.py).
"""

from __future__ import annotations

from ..data.answers import extract_hash_answer, reference_answer
from ..data.math_answers import is_correct
from .calling import completion_texts


def gsm8k_accuracy(prompts, completions, answer, **_) -> list[float]:
    """1.0 when the completion's answer (first number after its last '####') equals the
    reference read by `reference_answer`, exactly as Fractions; else 0.0."""
    out = []
    for completion, ref in zip(completion_texts(completions), answer):
        got, want = extract_hash_answer(completion), reference_answer(ref)
        out.append(1.0 if got is not None and want is not None and got == want else 0.0)
    return out


def math_accuracy(prompts, completions, answer, **_) -> list[float | None]:
    """1.0 when the completion's final answer equals `answer` (see `is_correct`), else 0.0.

    None (not applicable) for a sample whose reference answer cannot be parsed.
    """
    out: list[float | None] = []
    for completion, ref in zip(completion_texts(completions), answer):
        ok = is_correct(completion, ref)
        out.append(None if ok is None else float(ok))
    return out
