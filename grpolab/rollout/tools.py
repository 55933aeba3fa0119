"""Tools a rollout can call: the registry, the built-in tools, and running calls safely.

A tool is a Python function; what it returns (as text) is fed back to the model. Built in:
`calculator` (arithmetic on numbers: + - * /, parentheses) and `python` (a program run in the
code-execution sandbox; its printed output comes back). Users add `module:function` or
`file.py:function`; its JSON schema (for chat templates' `tools=`) comes from its signature and
Google-style docstring via transformers' `get_json_schema`.

Nothing a tool does can stop a rollout: an exception, a timeout, an unparsable call or a call over
the limit all become an `error: ...` text the model reads, and the call is counted as an error.
"""

from __future__ import annotations

import ast
import concurrent.futures as cf
import functools
import operator
import warnings
from dataclasses import dataclass, field
from typing import Callable

from ..errors import ConfigError, RewardError, ToolCallError
from ..rewards.custom import load_function
from ..rewards.runtime import RewardRuntime
from ..sandbox.runner import run_program

# ------------------------------------------------------------------ built-in tools
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_CALC_CHARS = 200


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: numbers, + - * / (× and ÷ also accepted) and parentheses, e.g. "(12+7)*3".
    """
    text = str(expression).strip().replace("×", "*").replace("÷", "/")
    if len(text) > _MAX_CALC_CHARS:
        raise ToolCallError(f"expression longer than {_MAX_CALC_CHARS} characters")
    try:
        with warnings.catch_warnings():   # '3a' and the like warn before failing; the model is told instead
            warnings.simplefilter("ignore")
            tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ToolCallError(f"not an arithmetic expression: {expression!r}") from None

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            return _BINOPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](ev(node.operand))
        # names, calls, attributes, **, comparisons ...: nothing but arithmetic is evaluated
        raise ToolCallError(f"only numbers, + - * / and parentheses are allowed, not {ast.unparse(node)!r}")
    try:
        value = ev(tree)
    except ZeroDivisionError:
        raise ToolCallError("division by zero") from None
    if isinstance(value, float) and value.is_integer() and abs(value) < 2 ** 53:
        value = int(value)
    return str(round(value, 6) if isinstance(value, float) else value)


def python(code: str) -> str:
    """Run a Python program and return what it prints (stdout and stderr).

    Args:
        code: the program; use print() to show results.
    """
    return run_python(code, RewardRuntime())


def run_python(code: str, runtime: RewardRuntime) -> str:
    """The python tool in the sandbox `runtime` sets (reward.code_exec's limits)."""
    v = run_program(str(code), {"mode": "output"}, runtime.limits, unsafe=runtime.unsafe)
    if v.status == "timeout":
        raise ToolCallError(f"the program ran longer than {runtime.limits.timeout}s")
    if v.status not in ("passed", "failed"):
        raise ToolCallError(f"the sandbox could not run the program ({v.status}: {v.detail})")
    return v.detail


BUILTIN: dict[str, Callable[..., str]] = {"calculator": calculator, "python": python}


@dataclass
class Tool:
    name: str
    fn: Callable
    schema: dict                      # OpenAI-style {"type": "function", "function": {...}}
    params: list[str] = field(default_factory=list)

    def call(self, args) -> str:
        """Run the tool on parsed arguments: a dict (keyword arguments) or a string (a tool with one
        parameter takes it whole, e.g. the calculator's expression)."""
        if isinstance(args, str):
            if len(self.params) != 1:
                raise ToolCallError(f"{self.name} takes {len(self.params)} arguments; give them as a JSON object")
            return str(self.fn(args))
        if not isinstance(args, dict):
            raise ToolCallError(f"{self.name}: arguments must be a JSON object, got {type(args).__name__}")
        unknown = sorted(set(args) - set(self.params))
        if unknown:
            raise ToolCallError(f"{self.name} has no argument {', '.join(unknown)} (it takes {', '.join(self.params)})")
        return str(self.fn(**args))


def load_tool(spec: str, runtime: RewardRuntime | None = None) -> Tool:
    """A built-in tool by name, or a user function `module:function` / `file.py:function`. `runtime`: the
    sandbox the python tool runs programs in (reward.code_exec); None = the defaults."""
    from transformers.utils import get_json_schema
    if spec in BUILTIN:
        fn = BUILTIN[spec]
    elif ":" in spec:
        try:
            fn = load_function(spec)
        except RewardError as e:
            raise ConfigError(f"rollout.tools: {str(e).replace('reward ', 'tool ', 1)}") from None
    else:
        raise ConfigError(f"rollout.tools: unknown tool {spec!r}; built in: {', '.join(BUILTIN)}, or give your own "
                          f"as 'module:function' or 'path/to/file.py:function'")
    try:
        schema = get_json_schema(fn)
    except Exception as e:   # noqa: BLE001 - transformers says what the docstring lacks
        raise ConfigError(f"rollout.tools: {spec!r}: cannot describe it for the model ({e}); give the function "
                          f"type hints and a Google-style docstring with an Args: section") from None
    params = list(schema["function"].get("parameters", {}).get("properties", {}))
    if fn is python and runtime is not None:   # the schema is python's; the programs run in the run's sandbox
        fn = functools.partial(run_python, runtime=runtime)
    return Tool(schema["function"]["name"] if spec in BUILTIN else spec.rsplit(":", 1)[1], fn, schema, params)


def load_tools(specs: list[str], runtime: RewardRuntime | None = None) -> dict[str, Tool]:
    """The tools `specs` name (rollout.tools), by name; `runtime`: as for `load_tool`."""
    tools = [load_tool(s, runtime) for s in specs]
    names = [t.name for t in tools]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"rollout.tools: two tools are called {dup[0]!r}; tool names must be unique")
    return {t.name: t for t in tools}


# ------------------------------------------------------------------ running calls
@dataclass
class CallRecord:
    """One call as it happened: what the model asked for and what it was told."""
    name: str | None
    arguments: object
    output: str
    error: bool

    def to_dict(self) -> dict:
        return {"name": self.name, "arguments": self.arguments, "output": self.output, "error": self.error}


def truncate(text: str, max_chars: int) -> str:
    """At most about max_chars characters; a longer text keeps its start and says how much was cut."""
    if len(text) <= max_chars:
        return text
    return text[:max_chars] + f"...[truncated {len(text) - max_chars} chars]"


class ToolRunner:
    """Runs parsed calls in parallel threads with a per-call timeout, turning every failure into an
    error text. A timed-out call's thread is abandoned (Python threads cannot be killed); the python
    tool's program is killed by the sandbox's own timeout."""

    def __init__(self, tools: dict[str, Tool], *, timeout: float, max_output_chars: int, workers: int = 8) -> None:
        self.tools, self.timeout, self.max_output_chars = tools, timeout, max_output_chars
        self.pool = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grpolab-tool")

    def run(self, calls: list[tuple[str | None, object] | ToolCallError]) -> list[CallRecord]:
        """Records for `calls` in order: (name, arguments) pairs, or the parse error of a call."""
        futures = []
        for c in calls:
            if isinstance(c, ToolCallError) or c[0] not in self.tools:
                futures.append(None)
            else:
                futures.append(self.pool.submit(self.tools[c[0]].call, c[1]))
        out = []
        for c, fut in zip(calls, futures):
            if isinstance(c, ToolCallError):
                out.append(CallRecord(None, None, f"error: {c}", True))
                continue
            name, args = c
            if fut is None:
                out.append(CallRecord(name, args, f"error: unknown tool {name!r}; tools: {', '.join(self.tools)}",
                                      True))
                continue
            try:
                text, err = fut.result(timeout=self.timeout), False
            except cf.TimeoutError:
                text, err = f"error: {name} timed out after {self.timeout}s", True
            except ToolCallError as e:
                text, err = f"error: {e}", True
            except (Exception, SystemExit) as e:   # noqa: BLE001 - a tool that raises tells the model why
                # (sys.exit() in a tool too: re-raised here it would end the whole run with its exit code)
                text, err = f"error: {type(e).__name__}: {e}", True
            out.append(CallRecord(name, args, truncate(text, self.max_output_chars), err))
        return out

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
