"""Tool calling in the chat API: a request's `tools` and `tool_choice` checked, the conversation (with
assistant `tool_calls` and `tool` results) rendered as training renders it, and the model's output
split into OpenAI `tool_calls` and content, whole or as it streams.

The formats are training's (rollout/tool_formats.py): the built-in GPT writes `<|call|>NAME ARGS<|/call|>`
and reads `<|out|>RESULT<|/out|>` (it never sees the tools' schemas: training shows it none); a Hugging
Face chat model gets the schemas through its chat template's `tools` (a ChatML template without them gets
grpolab's prelude, `chatml_tools_template`) and writes Hermes `<tool_call>{"name", "arguments"}</tool_call>`.
A call that does not parse, or names a tool the request did not give, stays in the content as written.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from ..errors import ConfigError, ToolCallError
from ..rollout.tool_formats import builtin_call, hermes_calls, tool_format

# (opening, closing) of a call in the text the model writes
BUILTIN_MARKS = ("<|call|>", "<|/call|>")
HERMES_MARKS = ("<tool_call>", "</tool_call>")
_PROBE_TOOL = {"type": "function", "function": {"name": "grpolab_probe", "description": "probe",
                                                "parameters": {"type": "object", "properties": {}}}}


class ToolRequestError(ValueError):
    """A request's tools, tool_choice or tool messages are wrong; `param` names the field (the server's 400)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def is_builtin(tok) -> bool:
    return hasattr(tok, "call_id")


def tool_support(tok) -> str | None:
    """Why the model's tokenizer cannot carry tools (a 400's message), or None when it can. For an HF
    tokenizer this runs training's start-up checks once on a stand-in tool; a ChatML template without
    tools keeps grpolab's prelude installed afterwards (it renders exactly as before without tools)."""
    if is_builtin(tok):
        return None
    try:
        tool_format(tok, [_PROBE_TOOL], getattr(tok.tok, "name_or_path", "") or "the model")
    except ConfigError as e:
        return "tools: " + str(e).removeprefix("rollout.tools: ")
    finally:
        tok.tools = None   # tools come with each request, never from the tokenizer
    return None


def check_tools(tools: list, tool_choice) -> dict[str, list[str]]:
    """{name: parameter names} of a request's `tools` (OpenAI's function tools); ToolRequestError naming
    the field when a tool or `tool_choice` is malformed or names no given tool."""
    out: dict[str, list[str]] = {}
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ToolRequestError(f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., '
                                   f'"parameters": {{...}}}}}}', f"tools[{i}]")
        name, params = fn.get("name"), fn.get("parameters", {})
        if not isinstance(name, str) or not name:
            raise ToolRequestError(f"tools[{i}].function.name must be a non-empty string", f"tools[{i}].function.name")
        if name in out:
            raise ToolRequestError(f"tools[{i}]: two tools are called {name!r}; names must be unique",
                                   f"tools[{i}].function.name")
        if not isinstance(params, dict) or not isinstance(params.get("properties", {}), dict):
            raise ToolRequestError(f"tools[{i}].function.parameters must be a JSON schema object "
                                   f'({{"type": "object", "properties": {{...}}}})', f"tools[{i}].function.parameters")
        out[name] = list(params.get("properties", {}))
    if tool_choice is None or tool_choice in ("none", "auto", "required"):
        return out
    name = (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice, dict) else None
    if not isinstance(name, str):
        raise ToolRequestError('tool_choice must be "none", "auto", "required" or {"type": "function", '
                               '"function": {"name": ...}}', "tool_choice")
    if name not in out:
        raise ToolRequestError(f"tool_choice names {name!r}, which is not among the tools "
                               f"({', '.join(out) or 'none given'})", "tool_choice")
    return out


def call_arguments(args: object, params: list[str]) -> str | None:
    """A parsed call's arguments as OpenAI's JSON string: an object as it is; the bare text the built-in
    model writes for a one-parameter tool (`calculator 2+3`) as that parameter. None: not representable."""
    if isinstance(args, str) and len(params) == 1:
        args = {params[0]: args}
    if not isinstance(args, dict):
        return None
    return json.dumps(args, ensure_ascii=False)


def _loads_args(arguments: object, where: str) -> dict:
    """An assistant message's tool_calls[].function.arguments (a JSON string of an object, or the object)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            raise ToolRequestError(f"{where}.function.arguments is not valid JSON ({e.msg} at char {e.pos})",
                                   f"{where}.function.arguments") from None
    if not isinstance(arguments, dict):
        raise ToolRequestError(f"{where}.function.arguments must be a JSON object", f"{where}.function.arguments")
    return arguments


def history_calls(messages: list[dict]) -> tuple[list[list[tuple[str, str, dict]] | None], list[str | None]]:
    """Per message: an assistant message's calls as (id, name, arguments), and a tool message's tool name
    (found by its tool_call_id among the calls before it). ToolRequestError for a malformed call or a
    tool message that answers no call."""
    calls: list = []
    names: list = []
    known: dict[str, str] = {}
    for i, m in enumerate(messages):
        mine, name = None, None
        if m.get("role") == "assistant" and m.get("tool_calls"):
            if not isinstance(m["tool_calls"], list):
                raise ToolRequestError(f"messages[{i}].tool_calls must be a list", f"messages[{i}].tool_calls")
            mine = []
            for j, c in enumerate(m["tool_calls"]):
                where = f"messages[{i}].tool_calls[{j}]"
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise ToolRequestError(f'{where} must be {{"id": ..., "type": "function", "function": '
                                           f'{{"name": ..., "arguments": "..."}}}}', where)
                cid = str(c.get("id") or f"{i}.{j}")
                known[cid] = fn["name"]
                mine.append((cid, fn["name"], _loads_args(fn.get("arguments", "{}"), where)))
        elif m.get("role") == "tool":
            cid = m.get("tool_call_id")
            if cid not in known:
                raise ToolRequestError(f"messages[{i}]: a tool message needs the tool_call_id of an assistant "
                                       f"tool call before it (got {cid!r}; known: {', '.join(known) or 'none'})",
                                       f"messages[{i}].tool_call_id")
            name = known[cid]
        calls.append(mine)
        names.append(name)
    return calls, names


def hermes_call_text(name: str, args: dict) -> str:
    """A call as a Hermes-format model writes it (and as the chat template's own tool_calls render it)."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}, ensure_ascii=False) + "\n</tool_call>"


def builtin_call_text(name: str, args: dict, params: list[str]) -> str:
    """A call as the built-in model writes it: a one-parameter tool's argument as bare text (training's form)."""
    if len(args) == 1 and list(args) == params[:1] == params and isinstance(args[params[0]], str):
        return f"{name} {args[params[0]]}"
    return f"{name} {json.dumps(args, ensure_ascii=False)}"


def builtin_prompt(tok, messages: list[dict], calls: list, tools: dict[str, list[str]]) -> list[int]:
    """Prompt ids for the built-in model, as rollouts lay it out: <|bos|>, each run of system/user
    messages as one <|user|> turn (as `render_conversation`), and an assistant turn holding its text and
    each call followed by its result (`<|call|>NAME ARGS<|/call|><|out|>RESULT<|/out|>`, the result
    encoded without markers, as the engine writes it). A turn whose last call has its result is left open
    for the model to go on (no <|end|>); otherwise a new <|assistant|> is opened."""
    results = {m.get("tool_call_id"): m["content"] for m in messages if m["role"] == "tool"}
    ids, user, open_turn = [tok.bos_id], [], False
    for m, mine in zip(messages, calls):
        role = m["role"]
        if role == "tool":   # written right after its call
            continue
        if role != "assistant":
            if open_turn:   # a turn left open, then a user message: it ended there
                ids.append(tok.eos_id)
                open_turn = False
            user.append(m["content"])
            continue
        if user:
            ids += [tok.user_id, *tok.encode("\n".join(user))]
            user = []
        if not open_turn:
            ids.append(tok.assistant_id)
        ids += tok.encode(m["content"])
        for cid, name, args in mine or ():
            ids += [tok.call_id, *tok.encode(builtin_call_text(name, args, tools.get(name, [])), tool_tokens=False),
                    tok.call_end_id]
            if cid in results:
                ids += [tok.out_id, *tok.encode(results[cid], tool_tokens=False), tok.out_end_id]
        open_turn = bool(mine)
        if not open_turn:   # an assistant message without calls ends its turn
            ids.append(tok.eos_id)
    if user:
        ids += [tok.user_id, *tok.encode("\n".join(user))]
    if not open_turn:
        ids.append(tok.assistant_id)
    return ids


def hf_messages(tok, messages: list[dict], calls: list, names: list) -> list[dict]:
    """Messages for an HF chat template: an assistant's calls as the template's own `tool_calls` (arguments
    as objects, as templates expect) where the template reads them, else written into its content the way
    the model writes them; a tool message with its tool's name, as rollouts render results."""
    reads_calls = "tool_calls" in (getattr(tok.tok, "chat_template", None) or "")
    out = []
    for m, mine, name in zip(messages, calls, names):
        m = {"role": m["role"], "content": m["content"]}
        if mine and reads_calls:
            m["tool_calls"] = [{"id": cid, "type": "function", "function": {"name": n, "arguments": a}}
                               for cid, n, a in mine]
        elif mine:
            m["content"] = "\n".join(([m["content"]] if m["content"] else []) +
                                     [hermes_call_text(n, a) for _, n, a in mine])
        if name is not None:
            m["name"] = name
        out.append(m)
    return out


def forced_prefix(tok, tool_choice) -> str:
    """What the model's turn is made to start with: a call's opening for `required`, and the name too for a
    named function (then the model writes the arguments); '' otherwise."""
    named = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if tool_choice != "required" and named is None:
        return ""
    if is_builtin(tok):
        return BUILTIN_MARKS[0] + (f"{named} " if named else "")
    return HERMES_MARKS[0] + "\n" + ('{"name": ' + json.dumps(named) + ', "arguments": ' if named else "")


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class Call:
    name: str
    arguments: str   # JSON text

    def openai(self, call_id: str) -> dict:
        return {"id": call_id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class CallParser:
    """One choice's text, fed as it grows (`feed(text_so_far, done)`), split into events: ("content", str)
    and ("call", Call). A call's text never reaches the content unless it fails to parse (bad JSON,
    arguments that are not an object, a tool the request did not give, never closed): then it is content
    as written. Text that could still become a call's opening is held back, so the streamed pieces join
    to the whole reply's content. Whitespace is content too (the built-in model's newline before a call
    is part of its turn, and goes back into the prompt with the call)."""

    def __init__(self, marks: tuple[str, str], tools: dict[str, list[str]]) -> None:
        self.open, self.close = marks
        self.tools = tools
        self.builtin = marks == BUILTIN_MARKS
        self.pos = 0             # chars of the text consumed
        self.n_calls = 0

    def _parse(self, raw: str) -> list[Call] | None:
        body = raw[len(self.open):-len(self.close)]
        found = [builtin_call(body)] if self.builtin else hermes_calls(body)
        calls = []
        for c in found:
            if isinstance(c, ToolCallError) or c[0] not in self.tools:
                return None
            args = call_arguments(c[1], self.tools[c[0]])
            if args is None:
                return None
            calls.append(Call(c[0], args))
        return calls or None

    @staticmethod
    def _content(text: str, out: list) -> None:
        if text:
            out.append(("content", text))

    def feed(self, text: str, done: bool = False) -> list[tuple[str, object]]:
        out: list = []
        while True:
            start = text.find(self.open, self.pos)
            if start < 0:
                end = len(text) if done else len(text) - _partial(text, self.open, self.pos)
                self._content(text[self.pos:end], out)
                self.pos = max(self.pos, end)
                break
            self._content(text[self.pos:start], out)
            self.pos = start
            stop = text.find(self.close, start + len(self.open))
            if stop < 0:
                if done:   # never closed: what was written is content
                    self._content(text[start:], out)
                    self.pos = len(text)
                break
            raw = text[start:stop + len(self.close)]
            calls = self._parse(raw)
            if calls is None:
                self._content(raw, out)
            else:
                out += [("call", c) for c in calls]
                self.n_calls += len(calls)
            self.pos = stop + len(self.close)
        return out


def _partial(text: str, mark: str, start: int) -> int:
    """How many trailing chars of text[start:] begin `mark` (held back: they may become a call's opening)."""
    for n in range(min(len(mark) - 1, len(text) - start), 0, -1):
        if text.endswith(mark[:n]):
            return n
    return 0


def parse_reply(marks: tuple[str, str], tools: dict[str, list[str]], text: str) -> tuple[str | None, list[Call]]:
    """(content or None, calls) of a whole reply: the same parser a stream uses, fed everything at once."""
    events = CallParser(marks, tools).feed(text, done=True)
    content = "".join(e[1] for e in events if e[0] == "content")
    return content or None, [e[1] for e in events if e[0] == "call"]


@dataclass
class ToolPlan:
    """How one chat request uses tools: the tools' parameter names, the call format's marks, whether the
    reply is parsed for calls (not with tool_choice "none"), the text its turn is made to start with, and
    the stop strings generation needs (the built-in model's call end: the server answers at a call)."""
    tools: dict[str, list[str]]
    marks: tuple[str, str]
    parse: bool
    prefix: str = ""
    stop: tuple[str, ...] = ()

    def parser(self) -> CallParser:
        return CallParser(self.marks, self.tools)


def plan_tools(tok, tools: list | None, tool_choice, problem: str | None) -> ToolPlan:
    """The request's ToolPlan; ToolRequestError for bad tools or tool_choice, or tools on a model whose
    tokenizer cannot carry them (`problem`, from `tool_support`)."""
    if tool_choice is not None and not tools and tool_choice != "none":
        raise ToolRequestError("tool_choice needs tools: give the functions the model may call in `tools`",
                               "tool_choice")
    specs = check_tools(tools or [], tool_choice)
    marks = BUILTIN_MARKS if is_builtin(tok) else HERMES_MARKS
    use = bool(specs) and tool_choice != "none"
    if use and problem:
        raise ToolRequestError(problem, "tools")
    return ToolPlan(specs, marks, use, forced_prefix(tok, tool_choice) if use else "",
                    (BUILTIN_MARKS[1],) if use and is_builtin(tok) else ())
