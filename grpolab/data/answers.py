"""The one reader of GSM8K-style answers ('... #### 18'), and the gsm8k_accuracy reward.

Rules (shared by gsm8k_accuracy, the `format` reward, math_accuracy's plain-number path and
the GSM8K loader):
  - the answer line is the text after the LAST '####' up to the end of that line; several
    '####' lines: the last counts, even when it holds no number; no '####': no answer;
  - the answer is the FIRST number on that line; words, units, '$' (before or after the
    sign), '%' and a trailing period around it are ignored;
  - a number: optional sign ('-', '+', unicode minus '−'), ASCII digits with valid thousands
    separators ('1,234,567'; a comma not followed by exactly three digits ends the number, so
    '1,23' reads 1), an optional decimal part ('3.50', '.5'), or a fraction of integers
    ('1/2', '-3/4'); '1/0', and a number running on into '/' or '.' plus a digit ('1.5/2',
    '1/2/3', '1.2.3'), are not numbers and give no answer;
  - values are exact Fractions, so '0.5' == '1/2', '1,000' == '1000', '5.0' == '5'.
"""

from __future__ import annotations

import re
from decimal import Decimal
from fractions import Fraction

_INT = r"[0-9]{1,3}(?:,[0-9]{3})+(?![0-9])|[0-9]+"
# sign, an optional '$' after it, then an integer with a decimal part or '/denominator', or '.5'
_NUMBER = re.compile(
    rf"(?P<sign>[-+−]?)\$?(?:(?P<int>{_INT})(?:\.(?P<dec>[0-9]+)|/(?P<den>{_INT}))?|\.(?P<dec_only>[0-9]+))")
# what must not follow a number, or it is something else: '/2', '.3' ('1.5/2', '1.2.3')
_RUNS_ON = re.compile(r"[/.][0-9]")
# besides its one number, a plain answer holds only words, spaces and this punctuation
_PLAIN_REST = re.compile(r"[A-Za-z\s$%.,:;?()*'\"]*")


def _value(m: re.Match) -> Fraction | None:
    """The exact value of one `_NUMBER` match, or None ('1/0', digits past Python's int limit)."""
    sign = -1 if m["sign"] in ("-", "−") else 1
    try:
        if m["dec_only"] is not None:
            return sign * Fraction(f"0.{m['dec_only']}")
        whole = int(m["int"].replace(",", ""))
        if m["den"] is not None:
            den = int(m["den"].replace(",", ""))
            return sign * Fraction(whole, den) if den else None
        return sign * (Fraction(f"{whole}.{m['dec']}") if m["dec"] is not None else Fraction(whole))
    except ValueError:  # more digits than int() accepts
        return None


def _first_number(text: str) -> tuple[Fraction | None, re.Match | None]:
    """The first number in `text` (None when it is not a valid number) and its match."""
    m = _NUMBER.search(text)
    if m is None or _RUNS_ON.match(text, m.end()):
        return None, m
    return _value(m), m


def parse_number(text: str) -> Fraction | None:
    """The first number in `text` as an exact Fraction ('$1,234.50.' -> 2469/2), else None.

    Only the first number counts: when it is not a number ('1/0', '1.5/2') the result is None.
    """
    return _first_number(text)[0]


def last_number(text: str) -> Fraction | None:
    """The last number in `text` ('so 8 - 2 is 6.' -> 6), read as `parse_number` reads one; None without one."""
    found = None
    for m in _NUMBER.finditer(text):
        found = m
    if found is None or _RUNS_ON.match(text, found.end()):
        return None
    return _value(found)


def plain_number(text: str) -> Fraction | None:
    """The value of `text` when it is plainly one number ('$18.', '7 apples', '50%', '1/2').

    Plain: exactly one number, and besides it only words of two or more ASCII letters that do
    not touch the number, whitespace and the punctuation $ % . , : ; ? ( ) * ' ". Anything else
    (LaTeX '\\frac12', '2^10', 'x - 5', '4x', '2 i', a second number as in '3 + 4' or '1,23')
    is not plain: None.
    """
    value, m = _first_number(text)
    if value is None:
        return None
    before, after = text[:m.start()], text[m.end():]
    if before[-1:].isalpha() or after[:1].isalpha():   # '4x', 'x4': algebra, not a unit
        return None
    rest = before + " " + after
    plain = (_PLAIN_REST.fullmatch(rest) and _NUMBER.search(rest) is None
             and all(len(w) > 1 for w in re.findall(r"[A-Za-z]+", rest)))   # 'x', 'i' are variables
    return value if plain else None


def plain_hash_answer(text: str) -> Fraction | None:
    """The plain number on the last '####' line of `text` (see `plain_number`), else None."""
    line = final_answer_text(text)
    return None if line is None else plain_number(line)


def final_answer_text(text: str) -> str | None:
    """The text after the last '####' up to the end of that line, stripped; None without '####'."""
    if "####" not in text:
        return None
    return text.rsplit("####", 1)[1].split("\n", 1)[0].strip()


def extract_hash_answer(text: str) -> Fraction | None:
    """The first number on the line after the last '####' in `text`, or None when it has none."""
    line = final_answer_text(text)
    return None if line is None else parse_number(line)


def reference_answer(answer: object) -> Fraction | None:
    """The reference as a Fraction: a number (72, 2.5), a bare numeric string ('1/2', '1,000'),
    or a full GSM8K solution ('... #### 72', read like a completion); None when it has no number."""
    if isinstance(answer, bool):
        return None
    if isinstance(answer, (int, Fraction)):
        return Fraction(answer)
    if isinstance(answer, float):  # via the shortest repr: 0.1 is 1/10, not the binary float's value
        answer = Decimal(repr(answer))
    if isinstance(answer, Decimal):
        return Fraction(answer) if answer.is_finite() else None
    text = str(answer)
    return extract_hash_answer(text) if "####" in text else parse_number(text)


def format_number(value: Fraction) -> str:
    """Canonical text of a value: integers '18', terminating decimals '-3.5', others '1/3'."""
    value = Fraction(value)
    num, den = value.numerator, value.denominator
    if den == 1:
        return str(num)
    twos = fives = 0
    while den % 2 == 0:
        den, twos = den // 2, twos + 1
    while den % 5 == 0:
        den, fives = den // 5, fives + 1
    if den != 1:
        return f"{value.numerator}/{value.denominator}"
    places = max(twos, fives)
    digits = str(abs(num) * 10 ** places // value.denominator).rjust(places + 1, "0")
    return f"{'-' if num < 0 else ''}{digits[:-places]}.{digits[-places:]}"
