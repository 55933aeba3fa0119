"""Math answer checking with the math-verify library (LaTeX, \\boxed{}, fractions, '#### N').

A completion's candidate answer is its '####' line (`answers.final_answer_text`: the text
after the last '####', to the end of that line) when that parses, else whatever math-verify
extracts from the whole completion (\\boxed{} first). The reference is the '####' line of a
full GSM8K solution, else the whole string.

When both the completion's '####' line and the reference are plain numbers
(`answers.plain_number`: '18', '$1,234.50', '1/2', '7 apples'), equality is exact Fraction
equality, the same as gsm8k_accuracy's; otherwise it is math-verify's `verify(gold, pred)`.
"""

from __future__ import annotations

import re
import threading
from decimal import Decimal
from fractions import Fraction

from .answers import final_answer_text, plain_hash_answer, plain_number, reference_answer

# math-verify times out with signal.alarm: whole seconds, main thread only
TIMEOUT_S = 5


def _timeout() -> int | None:
    # signal.signal raises ValueError outside the main thread, so run without a timeout there
    return TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _parse_short(text: str) -> list:
    """math-verify parse of a short answer string ('#### ...' line or a bare reference).

    Bare LaTeX ('\\frac12', '\\sqrt 2') is parsed inside $...$: the plain parser misses it
    or picks out a lone number ('\\sqrt 2' -> 2). Escaped currency '\\$18' is read as 18.
    """
    from math_verify import parse

    text = text.replace("\\$", "").strip()
    if not text:
        return []
    tries = [text] if "$" in text else [f"${text}$", text] if "\\" in text else [text, f"${text}$"]
    for t in tries:
        parsed = parse(t, parsing_timeout=_timeout())
        if parsed:
            return parsed
    return []


def _reference_text(answer) -> str:
    """The reference's answer text: the '####' line of a GSM8K solution, else the whole string."""
    text = str(answer)
    hashed = final_answer_text(text)
    return hashed if hashed is not None else text.strip()


def _plain_equal(completion: str, answer: object) -> bool | None:
    """Exact Fraction equality when the completion's '####' line and the reference are both
    plain numbers (a number reference, 2.5, counts as one; a reference with any letter does not,
    so '4x' and '3 pi' go to math-verify); None when either is not."""
    got = plain_hash_answer(completion)
    if got is None:
        return None
    if isinstance(answer, (int, float, Fraction, Decimal)) and not isinstance(answer, bool):
        want = reference_answer(answer)
    else:
        ref = _reference_text(answer)
        want = None if re.search(r"[A-Za-z]", ref) else plain_number(ref)
    return None if want is None else got == want


def parse_reference(answer) -> list:
    """Parsed gold answer from a bare number/LaTeX string or a GSM8K solution ending '#### N'."""
    return _parse_short(_reference_text(answer))


def parse_completion(completion: str) -> list:
    """Parsed final answer of a completion: its last '#### N' if that parses, else math-verify's extraction."""
    from math_verify import parse

    hashed = final_answer_text(completion)
    if hashed:
        parsed = _parse_short(hashed)
        if parsed:
            return parsed
    return parse(completion, parsing_timeout=_timeout())


def is_correct(completion: str, answer) -> bool | None:
    """True/False when the completion's answer equals the reference; None when the reference does not parse.

    A plain-number '####' line against a plain-number reference compares as exact Fractions
    (as gsm8k_accuracy does); everything else goes through math-verify.
    Never raises: a sample that errors or times out counts as wrong.
    """
    from math_verify import verify

    try:
        exact = _plain_equal(completion, answer)
        if exact is not None:
            return exact
        gold = parse_reference(answer)
        if not gold:
            return None
        pred = parse_completion(completion)
        return bool(pred) and verify(gold, pred, timeout_seconds=_timeout())
    except Exception:  # noqa: BLE001 - one bad sample (or a timeout) must not stop training
        return False
