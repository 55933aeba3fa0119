"""code_exec: run the program in a completion against the row's tests, in a sandbox; reward = the
fraction of tests passed.

The program is the completion's last fenced ```python block, after the prompt's code (HumanEval's
imports and helpers, which the block's definitions override); without a fence, the completion
continues the prompt's code (completion-style tasks: the prompt ends where the body starts). The
prompt's code is a string prompt (or the last user message) that parses as Python, or its last
fenced block that does; the judge takes the test's helpers from it, never from the completion.

Tests, from the row's columns:
- `test` (code defining `check(candidate)`, HumanEval/MBPP style) and `entry_point` (the function's
  name): one test, passed when check(candidate) returns (HumanEval's pass/fail). The check runs in
  the judge, the program in a separate process; see grpolab.sandbox.grader.
- `test_cases`: [{"input", "output"}, ...] (APPS / CodeContests), or {"inputs": [...], "outputs": [...]},
  or either as a JSON string; verl's code rows keep them in reward_model.ground_truth, which reaches
  this function as `answer`. Each case is one test: the program reads the input on stdin and passes
  when it exits 0 and prints the output (trailing whitespace ignored).
A row with no tests gets None (not applicable). Programs run `reward.code_exec.max_concurrent` at a
time (the settings come in the `runtime` argument), each confined in PID, IPC and mount namespaces of
its own (its own /tmp and shared memory: nothing one leaves reaches another); each is killed at
`reward.code_exec.timeout`, and the tests it had not passed by then fail.
"""

from __future__ import annotations

import ast
import json
import re
from collections import Counter

from ..sandbox import run_programs
from .calling import completion_text
from .runtime import RewardRuntime

FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:```|$)", re.S | re.I)


def prompt_code(prompt) -> str:
    """The code a prompt gives (HumanEval's signature, docstring and helpers): a string prompt, or the
    last user message's content, when it parses as Python; else its last fenced block that does; else ''."""
    if isinstance(prompt, list):
        users = [m.get("content") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        prompt = users[-1] if users else None
    if not isinstance(prompt, str):
        return ""
    if _parses(prompt):
        return prompt
    blocks = [b for b in FENCE.findall(prompt) if _parses(b)]
    return blocks[-1] if blocks else ""


def extract_program(completion: str, prompt=None) -> str:
    """The program a completion gives: the prompt's code (imports, helpers) followed by the
    completion's last fenced code block, whose definitions override the prompt's; without a fence,
    the prompt's code continued by the completion."""
    code = prompt_code(prompt)
    blocks = FENCE.findall(completion)
    if blocks:
        return (code + "\n" if code else "") + blocks[-1]
    return code + completion


def _parses(code: str) -> bool:
    try:
        ast.parse(code)
        return True
    except (SyntaxError, ValueError):
        return False


def stdio_cases(value) -> list[dict] | None:
    """[{'input', 'output'}] from any accepted form of `test_cases` (or verl's ground truth); None if not one."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if isinstance(value, dict) and isinstance(value.get("inputs"), list) and isinstance(value.get("outputs"), list) \
            and "fn_name" not in value:
        value = [{"input": i, "output": o} for i, o in zip(value["inputs"], value["outputs"])]
    if isinstance(value, list) and value and all(isinstance(c, dict) and "input" in c and "output" in c for c in value):
        return [{"input": _text(c["input"]), "output": _text(c["output"])} for c in value]
    return None


def _text(x) -> str:
    return "\n".join(map(str, x)) if isinstance(x, list) else str(x)


def tests_of(row: dict, prompt=None) -> dict | None:
    """The judge's tests for one row (see grpolab.sandbox.run_program), or None when it has none."""
    if isinstance(row.get("test"), str) and row["test"].strip():
        prefix = prompt_code(prompt)
        return {"mode": "check", "test": row["test"], "entry_point": row.get("entry_point") or None,
                "prefix": prefix}
    for key in ("test_cases", "answer"):
        cases = stdio_cases(row.get(key))
        if cases:
            return {"mode": "stdio", "cases": cases}
    return None


def code_exec(prompts, completions, test=None, entry_point=None, test_cases=None, answer=None,
              log_metric=None, runtime: RewardRuntime | None = None, **kwargs) -> list[float | None]:
    """Fraction of the row's tests each completion's program passes (None for rows without tests).
    `runtime`: the sandbox's settings (reward.code_exec; `combine.score` passes the run's), None = the defaults."""
    runtime = runtime if runtime is not None else RewardRuntime()
    n = len(completions)
    col = lambda v: v if isinstance(v, list) else [v] * n   # noqa: E731
    test, entry_point, test_cases, answer = col(test), col(entry_point), col(test_cases), col(answer)
    prompts = prompts if prompts is not None else [None] * n
    jobs, where = [], []
    for i in range(n):
        row = {"test": test[i], "entry_point": entry_point[i], "test_cases": test_cases[i], "answer": answer[i]}
        tests = tests_of(row, prompts[i])
        if tests is None:
            continue
        jobs.append((extract_program(completion_text(completions[i]), prompts[i]), tests))
        where.append(i)
    verdicts = run_programs(jobs, runtime.limits, max_concurrent=runtime.max_concurrent, unsafe=runtime.unsafe)
    out: list[float | None] = [None] * n
    for i, v in zip(where, verdicts):
        out[i] = v.score
    if log_metric is not None and verdicts:
        counts = Counter(v.status for v in verdicts)
        for status in ("timeout", "load_error", "crashed"):
            log_metric(f"code_exec/{status}_rate", counts.get(status, 0) / len(verdicts))
    return out
