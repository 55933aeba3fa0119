"""The one reader of 'the answer after the last ####' (grpolab/data/answers.py) and everything
built on it: gsm8k_accuracy, the `format` reward, math_accuracy's plain-number path, the GSM8K loader.

ROWS is the answer table of docs/hf.md (between <!-- answer-table --> and <!-- /answer-table -->);
test_docs_table_is_rows keeps the two equal, and every row is checked by test_row.
"""

import json
import re
from decimal import Decimal
from fractions import Fraction

import pytest
from conftest import ROOT

from grpolab.data.answers import (
    extract_hash_answer,
    final_answer_text,
    format_number,
    parse_number,
    plain_number,
    reference_answer,
)
from grpolab.data.math_answers import _plain_equal
from grpolab.data.tasks.gsm8k import load_gsm8k
from grpolab.errors import DataError
from grpolab.rewards.accuracy import gsm8k_accuracy, math_accuracy
from grpolab.rewards.format import answer_format

SOLD = "She sold 48/2 = 24 in May.\n48 + 24 = 72 in all.\n#### 72"

# (completion, reference, read as (None: no answer), gsm8k_accuracy, format, math_accuracy);
# math_accuracy is '0'/'1', with ' (math-verify)' where math-verify decides rather than the reader
ROWS = [
    ("#### 18", "18", "18", 1, 1, "1"),
    ("She makes 9 * 2 = $18.\n#### 18", "18", "18", 1, 1, "1"),
    ("#### +18", "18", "18", 1, 1, "1"),
    ("#### -7", "-7", "-7", 1, 1, "1"),
    ("#### −7", "-7", "-7", 1, 1, "1"),                       # unicode minus
    ("#### 7", "-7", "7", 0, 1, "0"),
    ("#### 3.50", "3.5", "3.5", 1, 1, "1"),
    ("#### 5.0", "5", "5", 1, 1, "1"),
    ("#### .5", "0.5", "0.5", 1, 1, "1"),
    ("#### 18.", "18", "18", 1, 1, "1"),                       # trailing period
    ("#### 1,234,567", "1234567", "1234567", 1, 1, "1"),
    ("#### 1234567", "1,234,567", "1234567", 1, 1, "1"),
    ("#### 1,000", "1000.00", "1000", 1, 1, "1"),
    ("#### 1,23", "123", "1", 0, 1, "0 (math-verify)"),        # not a thousands separator: ends the number
    ("#### 1234,567", "1234567", "1234", 0, 1, "0 (math-verify)"),
    ("#### $1,234.50", "1234.5", "1234.5", 1, 1, "1"),
    ("#### -$5", "-5", "-5", 1, 1, "1"),
    ("#### $-5", "-5", "-5", 1, 1, "1"),
    ("#### 18 dollars", "18", "18", 1, 1, "1"),
    ("#### 50%", "50", "50", 1, 1, "1"),
    ("#### 50%", "0.5", "50", 0, 1, "0"),
    ("#### 0.5", "1/2", "0.5", 1, 1, "1"),
    ("#### 1/2", "0.5", "0.5", 1, 1, "1"),
    ("#### 1", "1/2", "1", 0, 1, "0"),                         # the whole reference is 1/2, not 1
    ("#### 0.333", "1/3", "0.333", 0, 1, "0"),
    ("#### 1/3", "1/3", "1/3", 1, 1, "1"),
    ("#### 1/0", "0", None, 0, 0, "0 (math-verify)"),
    ("#### 1.5/2", "0.75", None, 0, 0, "1 (math-verify)"),
    ("#### 5\n#### 6", "6", "6", 1, 1, "1"),                   # the last '####' counts
    ("#### 5\n#### 6", "5", "6", 0, 1, "0"),
    ("#### 5\n#### none", "5", None, 0, 0, "0 (math-verify)"),  # ... even without a number
    ("#### 18 is the answer", "18", "18", 1, 1, "1"),
    ("#### 18 because 9 * 2 = 18", "18", "18", 1, 1, "1 (math-verify)"),
    ("#### 18\nShe earns $18 a day.", "18", "18", 1, 1, "1"),  # later lines are ignored
    ("#### 17\nor maybe 18", "18", "17", 0, 1, "0"),
    ("so the answer #### 5", "5", "5", 1, 1, "1"),             # '####' mid-line
    ("the answer is 5", "5", None, 0, 0, "1 (math-verify)"),   # no '####'
    ("####", "5", None, 0, 0, "0 (math-verify)"),
    ("", "0", None, 0, 0, "0 (math-verify)"),
    ("#### 72", SOLD, "72", 1, 1, "1"),
    ("#### 24", SOLD, "24", 0, 1, "0"),
    ("#### 5", "#### 5\n#### five", "5", 0, 1, "0 (math-verify)"),
    ("#### 0.5", "\\frac12", "0.5", 0, 1, "1 (math-verify)"),   # gsm8k_accuracy reads '\frac12' as 12
    # not plain, so math-verify decides; its plain-text parser reads '4x' and '2 i' as lone numbers
    ("#### 4", "4x", "4", 1, 1, "1 (math-verify)"),             # letters in the reference: algebra
    ("#### 4x", "4", "4", 1, 1, "1 (math-verify)"),             # a letter touching the number
    ("#### 2 i", "2", "2", 1, 1, "1 (math-verify)"),            # a one-letter word is a variable
    ("#### - 5", "-5", "5", 0, 1, "0 (math-verify)"),           # a sign must touch its number
]


def _row_id(row) -> str:
    return f"{row[0]!r}~{row[1][:20]!r}"


@pytest.mark.parametrize("row", ROWS, ids=[_row_id(r) for r in ROWS])
def test_row(row, tmp_path):
    completion, reference, read_as, accuracy, fmt, math = row
    got = extract_hash_answer(completion)
    assert (None if got is None else format_number(got)) == read_as
    assert gsm8k_accuracy(None, [completion], [reference]) == [float(accuracy)]
    assert answer_format(None, [completion]) == [float(fmt)]
    assert fmt == (read_as is not None)                        # format 1 exactly when the reader finds a number

    # math_accuracy: exact, and equal to gsm8k_accuracy, when both sides are plain numbers
    plain = _plain_equal(completion, reference) is not None   # the product's own routing
    value, _, how = math.partition(" ")
    assert plain == (how != "(math-verify)")
    assert math_accuracy(None, [completion], [reference]) == [float(value)]
    if plain:
        assert int(value) == accuracy

    # the GSM8K loader: the completion as a row's worked answer gives 'read as', or no row at all
    path = tmp_path / "row.jsonl"
    path.write_text(json.dumps({"question": "Q", "answer": completion}) + "\n")
    if read_as is None:
        with pytest.raises(DataError, match=r"row\.jsonl: row 1: answer has no final '#### <number>' line"):
            load_gsm8k(str(path))
    else:
        assert load_gsm8k(str(path)) == [{"prompt": "Q", "answer": read_as, "solution": completion}]
        # and the loader's canonical answer is the same reference as the text it came from
        assert gsm8k_accuracy(None, [f"#### {read_as}"], [read_as]) == [1.0]


def _cell(text: str) -> str:
    """A table cell's text: `code` with '\\n' for a line break, or '(empty)'."""
    if text == "(empty)":
        return ""
    assert len(text) >= 2 and text[0] == text[-1] == "`", f"expected a `code` cell, got {text!r}"
    return text[1:-1].replace("\\n", "\n")


def table_rows(markdown: str, name: str) -> list[tuple]:
    """The rows of the table between the answer-table markers, in ROWS' form."""
    start, end = "<!-- answer-table -->", "<!-- /answer-table -->"
    assert start in markdown and end in markdown, f"{name} has no {start} ... {end} table"
    lines = markdown.split(start, 1)[1].split(end, 1)[0].strip().splitlines()
    assert [c.strip() for c in lines[0].strip().strip("|").split("|")] == \
        ["completion", "reference", "read as", "gsm8k_accuracy", "format", "math_accuracy"]
    assert re.fullmatch(r"\|( --- \|){6}", lines[1].strip())
    rows = []
    for line in lines[2:]:
        assert "\\|" not in line, line
        completion, reference, read_as, accuracy, fmt, math = [c.strip() for c in line.strip().strip("|").split("|")]
        rows.append((_cell(completion), _cell(reference), None if read_as == "no answer" else read_as,
                     int(accuracy), int(fmt), math))
    return rows


def test_docs_table_is_rows():
    # fails until the docs page has the table: every row there is one of ROWS, in order, and none is missing
    assert table_rows((ROOT / "docs" / "hf.md").read_text(), "docs/hf.md") == ROWS


# ---- the reader's parts ----------------------------------------------------------------------------

@pytest.mark.parametrize("text,want", [
    ("18", Fraction(18)),
    ("-3.5", Fraction(-7, 2)),
    ("−5", Fraction(-5)),
    ("+5", Fraction(5)),
    ("$-5", Fraction(-5)),
    ("-$5", Fraction(-5)),
    ("1,234,567", Fraction(1234567)),
    ("1,23", Fraction(1)),
    ("1,234,56", Fraction(1234)),        # the second comma is not followed by three digits
    ("1,2345", Fraction(1)),
    ("0,5", Fraction(0)),
    (".5", Fraction(1, 2)),
    ("-.25", Fraction(-1, 4)),
    ("1/2", Fraction(1, 2)),
    ("-3/4", Fraction(-3, 4)),
    ("6/4", Fraction(3, 2)),
    ("1/1,000", Fraction(1, 1000)),
    ("3.50.", Fraction(7, 2)),
    ("about 7 apples and 3 pears", Fraction(7)),
    ("x7", Fraction(7)),
    ("1/0", None),
    ("1.5/2", None),
    ("1/2/3", None),
    ("1.2.3", None),
    ("1/0 or 5", None),                  # only the first number counts
    ("", None),
    ("five", None),
    ("-", None),
    ("٣", None),                         # only ASCII digits
    ("1" * 5000, None),                  # beyond Python's int() digit limit: no answer, no crash
])
def test_parse_number(text, want):
    assert parse_number(text) == want


@pytest.mark.parametrize("text,want", [
    ("18", Fraction(18)),
    ("$1,234.50.", Fraction(2469, 2)),
    ("7 apples", Fraction(7)),
    ("(50%)", Fraction(50)),
    ("**18**", Fraction(18)),
    ("1/2", Fraction(1, 2)),
    ("3 + 4", None),
    ("1,23", None),
    ("2^10", None),
    ("\\frac12", None),
    ("\\$18", None),
    ("x - 5", None),
    ("5!", None),
    ("4x", None),
    ("x4", None),
    ("2 i", None),
    ("3 pi", 3),
    ("1e3", None),
    ("none", None),
])
def test_plain_number(text, want):
    assert plain_number(text) == want


@pytest.mark.parametrize("text,want", [
    ("a\n#### 5", "5"),
    ("####5", "5"),
    ("#### 5 \nmore text", "5"),
    ("so the answer #### 5", "5"),
    ("#### 5\n#### 6 apples\n", "6 apples"),
    ("#### 5\n####", ""),
    ("no marker", None),
    ("", None),
])
def test_final_answer_text(text, want):
    assert final_answer_text(text) == want


@pytest.mark.parametrize("answer,want", [
    (72, Fraction(72)),
    (2.5, Fraction(5, 2)),
    (0.1, Fraction(1, 10)),              # the float's shortest repr, not its binary value
    (Decimal("1.50"), Fraction(3, 2)),
    (Fraction(1, 3), Fraction(1, 3)),
    (float("nan"), None),
    (float("inf"), None),
    (True, None),
    ("1/2", Fraction(1, 2)),
    ("1,000", Fraction(1000)),
    ("#### 1/2", Fraction(1, 2)),
    ("so 5 apples\n#### 6", Fraction(6)),
    ("#### 5\n#### x", None),
    ("abc", None),
])
def test_reference_answer(answer, want):
    assert reference_answer(answer) == want


@pytest.mark.parametrize("value,want", [
    (Fraction(18), "18"),
    (Fraction(-7, 2), "-3.5"),
    (Fraction(1, 3), "1/3"),
    (Fraction(-2, 3), "-2/3"),
    (Fraction(1, 20), "0.05"),
    (Fraction(-1, 8), "-0.125"),
    (Fraction(1, 1024), "0.0009765625"),
    (Fraction(0), "0"),
    (Fraction(1, 6), "1/6"),             # a factor of 3: not a terminating decimal
    (Fraction(10 ** 30), "1" + "0" * 30),
])
def test_format_number(value, want):
    assert format_number(value) == want


def test_format_number_reads_back_exactly():
    values = {Fraction(n, d) for n in range(-60, 61) for d in (1, 2, 3, 4, 5, 7, 8, 16, 20, 25, 40, 125, 1000)}
    for v in values:
        text = format_number(v)
        assert parse_number(text) == v and plain_number(text) == v, text
        assert re.fullmatch(r"-?[0-9]+(\.[0-9]*[1-9])?|-?[0-9]+/[0-9]+", text), text


def test_batches_mix_rows():
    completions = [r[0] for r in ROWS]
    references = [r[1] for r in ROWS]
    assert gsm8k_accuracy(None, completions, references) == [float(r[3]) for r in ROWS]
    assert answer_format(None, completions) == [float(r[4]) for r in ROWS]
