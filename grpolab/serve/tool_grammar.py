"""A forced tool call's constraint: with `tool_choice` "required" or a named function, a Hugging Face
(Hermes-format) model's reply starts inside a call's opening (tool_calls.forced_prefix) and is decoded under
a Lark grammar that spells the rest of one call: the tool's name (when not already forced), arguments that
satisfy the tool's `parameters` schema (llguidance's `%json`), and the call's closing. So a forced call always
parses into `tool_calls` with valid arguments, as vLLM's guided tool calls do; after the closing only the
stop tokens are allowed, so the reply is that one call.

The built-in GPT is not constrained: it writes a one-parameter tool's argument as bare text, the form
training taught it, which a JSON schema would forbid.
"""

from __future__ import annotations

import json

from ..rollout.structured import Constraint
from .tool_calls import HERMES_MARKS, is_builtin


def _literal(text: str) -> str:
    """`text` as a Lark string literal (JSON's escapes are Lark's)."""
    return json.dumps(text, ensure_ascii=False)


# the arguments spaced as Hermes calls are written (json.dumps' separators, as training's calls and the chat
# templates' own tool_calls are): what the model learned, and no room for endless whitespace
_HERMES_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _object_schema(params: dict | None) -> dict:
    """The arguments' schema: the tool's parameters, held to an object (the parser takes only objects),
    with llguidance's options for Hermes' spacing."""
    params = dict(params or {})
    params.setdefault("type", "object")
    params["x-guidance"] = _HERMES_JSON
    return params


def forced_call(tok, tools: list, tool_choice) -> Constraint | None:
    """The constraint of a reply whose call `tool_choice` forces (None: nothing forced, or the built-in GPT).
    `tools` and `tool_choice` are already checked (tool_calls.check_tools)."""
    named = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if is_builtin(tok) or (tool_choice != "required" and named is None):
        return None
    close = _literal("}\n" + HERMES_MARKS[1])
    rules, alternatives = [], []
    for i, fn in enumerate(t["function"] for t in tools):
        if named is not None and fn["name"] != named:
            continue
        # a named call's opening, name included, is already in the prompt (forced_prefix)
        opening = '{"name": ' + json.dumps(fn["name"], ensure_ascii=False) + ', "arguments": '
        head = "" if named is not None else _literal(opening) + " "
        schema = json.dumps(_object_schema(fn.get("parameters")))
        rules += [f"call{i}: {head}args{i} {close}", f"args{i}: %json {schema}"]
        alternatives.append(f"call{i}")
    return Constraint("grammar", "\n".join(["start: " + " | ".join(alternatives), *rules]))
