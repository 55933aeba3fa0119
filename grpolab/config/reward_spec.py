"""The call at the end of a custom reward spec, 'module:factory(max_len=64, scale=0.5)': split here, as
plain text, so that config validation reads it without importing the rewards (and torch).
grpolab/rewards/custom.py calls the factory with these arguments; verl_style passes them as reward_kwargs.
"""

from __future__ import annotations

import ast
import re

from ..errors import RewardError


def parse_call(spec: str) -> tuple[str, tuple, dict]:
    """(spec without the call, positional args, keyword args) of 'target:fn(...)'; a spec without a
    call comes back as it is with no arguments. Arguments must be Python literals."""
    if not spec.endswith(")"):
        return spec, (), {}
    # the call starts at the first ':name(' whose rest parses as one call expression
    for m in re.finditer(r":([A-Za-z_]\w*)\(", spec):
        try:
            call = ast.parse(spec[m.start(1):], mode="eval").body
        except SyntaxError:
            continue
        if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name):
            continue
        try:
            if any(k.arg is None for k in call.keywords) or any(isinstance(a, ast.Starred) for a in call.args):
                raise ValueError("no * or ** unpacking")
            args = tuple(ast.literal_eval(a) for a in call.args)
            kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
        except ValueError as e:
            raise RewardError(f"reward {spec!r}: the arguments must be Python literals (numbers, strings, lists, "
                              f"dicts, True/False/None), as in 'module:factory(max_len=64)' ({e})") from None
        return spec[:m.end(1)], args, kwargs
    raise RewardError(f"reward {spec!r}: cannot read the call at the end; write 'module:function(key=value, ...)' "
                      f"with literal values")
