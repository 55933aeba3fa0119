"""Answer-checking rewards for GSM8K-style '#### <number>' answers."""

from __future__ import annotations

import re
from fractions import Fraction

# '#### ' then everything to the end of that line
_HASH_LINE = re.compile(r"####[ \t]*([^\n]*)")
# a signed number with optional thousands separators and decimals, e.g. -1,234.50
_NUMBER = re.compile(r"[-+−]?\s*(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+−]?\s*\.\d+")


def parse_number(text: str) -> Fraction | None:
    """First number in `text` as an exact Fraction ('$1,234.50.' -> 2469/2), or None."""
    m = _NUMBER.search(text)
    if not m:
        return None
    s = re.sub(r"[\s,]", "", m.group(0)).replace("−", "-")
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def extract_hash_answer(text: str) -> Fraction | None:
    """Number after the last '####' in `text`, or None when there is no such number."""
    found = _HASH_LINE.findall(text)
    return parse_number(found[-1]) if found else None


def reference_answer(answer) -> Fraction | None:
    """Reference from a full GSM8K solution ('...#### 72') or from a bare number ('72', 72)."""
    if isinstance(answer, (int, float)):
        return Fraction(answer)
    text = str(answer)
    return extract_hash_answer(text) if "####" in text else parse_number(text)


def gsm8k_accuracy(prompts, completions, answer, **_) -> list[float]:
    """1.0 when the completion's last '#### N' equals the reference numerically, else 0.0."""
    out = []
    for completion, ref in zip(completions, answer):
        got, want = extract_hash_answer(completion), reference_answer(ref)
        out.append(1.0 if got is not None and want is not None and got == want else 0.0)
    return out
