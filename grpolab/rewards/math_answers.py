"""Math answer checking with the math-verify library (LaTeX, \\boxed{}, fractions, '#### N').

A completion's candidate answer is the text after its last '####' when that parses
(GSM8K convention), else whatever math-verify extracts from the whole completion
(\\boxed{} first). The reference is the text after the last '####' when present (a full
GSM8K solution), else the whole string. Equality is math-verify's `verify(gold, pred)`.
"""

from __future__ import annotations

import threading

# math-verify times out with signal.alarm: whole seconds, main thread only
TIMEOUT_S = 5


def _timeout() -> int | None:
    # signal.signal raises ValueError outside the main thread, so run without a timeout there
    return TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _after_last_hash(text: str) -> str | None:
    """The line after the last '####' in `text`, or None when there is no '####'."""
    if "####" not in text:
        return None
    return text.rsplit("####", 1)[1].split("\n", 1)[0].strip()


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


def parse_reference(answer) -> list:
    """Parsed gold answer from a bare number/LaTeX string or a GSM8K solution ending '#### N'."""
    text = str(answer)
    hashed = _after_last_hash(text)
    return _parse_short(hashed if hashed is not None else text.strip())


def parse_completion(completion: str) -> list:
    """Parsed final answer of a completion: its last '#### N' if that parses, else math-verify's extraction."""
    from math_verify import parse

    hashed = _after_last_hash(completion)
    if hashed:
        parsed = _parse_short(hashed)
        if parsed:
            return parsed
    return parse(completion, parsing_timeout=_timeout())


def is_correct(completion: str, answer) -> bool | None:
    """True/False when the completion's answer equals the reference; None when the reference does not parse.

    Never raises: a sample that errors or times out counts as wrong.
    """
    from math_verify import verify

    try:
        gold = parse_reference(answer)
        if not gold:
            return None
        pred = parse_completion(completion)
        return bool(pred) and verify(gold, pred, timeout_seconds=_timeout())
    except Exception:  # noqa: BLE001 - one bad sample (or a timeout) must not stop training
        return False


def math_accuracy(prompts, completions, answer, **_) -> list[float | None]:
    """1.0 when the completion's final answer equals `answer` (math-verify), else 0.0.

    None (not applicable) for a sample whose reference answer cannot be parsed.
    """
    out: list[float | None] = []
    for completion, ref in zip(completions, answer):
        ok = is_correct(completion, ref)
        out.append(None if ok is None else float(ok))
    return out
