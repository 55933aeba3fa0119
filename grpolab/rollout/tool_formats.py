"""How a model writes a tool call and reads the result, per model family.

A format tells the engine three things: after which sampled tokens a call may have ended
(`triggers`), which calls (if any) the tokens the model wrote since the last tool output hold
(`calls_in`), and the token ids that carry the results back (`render`). Everything is token ids:
what the engine appends is exactly what the trainer re-scores.

- Built-in GPT (nanochat style): the model samples `<|call|>NAME ARGS<|/call|>` (ARGS: the text a
  one-parameter tool takes whole, or a JSON object); the engine appends `<|out|>RESULT<|/out|>`.
- Hugging Face chat models whose template renders `tools=` with Hermes-style calls (Qwen2.5, Qwen3,
  Hermes, ...): the model ends its turn after `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
  the engine appends the results as `tool` messages rendered by the template, then the template's
  generation prompt, and the model goes on.
- ChatML templates that never read `tools` (SmolLM2-Instruct, ...): the same Hermes format, given to
  them by a prelude grpolab adds to the template (`chatml_tools_template`): the tools at the end of
  the system message, results in a `user` turn of <tool_response> blocks, as Qwen2.5 renders them.

Every template check runs when the format is built (`tool_format`, at start-up), never at a call.
"""

from __future__ import annotations

import json
import re

from ..errors import ConfigError, ToolCallError
from ..models.chat_turns import AfterTurn
from .tools import CallRecord


def _args(text: str) -> object:
    """A call's arguments: a JSON object when the text is one, else the text itself."""
    text = text.strip()
    if text.startswith("{"):
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise ToolCallError(f"arguments are not valid JSON ({e.msg} at char {e.pos})") from None
    return text


def builtin_call(body: str) -> tuple | ToolCallError:
    """(name, arguments) of the text between <|call|> and <|/call|>: NAME, a space or newline, ARGUMENTS."""
    body = body.strip()
    name, _, rest = body.partition(" ")
    if "\n" in name:
        name, _, more = name.partition("\n")
        rest = more + rest
    if not name:
        return ToolCallError("empty call: write <|call|>NAME ARGUMENTS<|/call|>")
    try:
        return name, _args(rest)
    except ToolCallError as e:
        return e


class BuiltinFormat:
    """<|call|>NAME ARGS<|/call|> sampled by the model; <|out|>RESULT<|/out|> written by the engine."""

    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer
        self.triggers = (tokenizer.call_end_id,)

    def calls_in(self, segment: list[int]) -> list:
        """The call that `segment` (ending with <|/call|>) closes."""
        starts = [i for i, t in enumerate(segment[:-1]) if t == self.tok.call_id]
        if not starts:
            return [ToolCallError("a call was closed but never opened")]
        return [builtin_call(self.tok.decode(segment[starts[-1] + 1:-1]))]

    def render(self, records: list[CallRecord]) -> list[int]:
        text = "\n".join(r.output for r in records)
        return [self.tok.out_id, *self.tok.encode(text, tool_tokens=False), self.tok.out_end_id]


_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)

# Stand-in outputs rendered once at start-up: if the template drops or mangles them, the model would never see
# its results, so the run stops there instead of training on blind turns.
_PROBE = ("GRPOLAB-RESULT-1", "GRPOLAB-RESULT-2")


def _call(obj) -> tuple | ToolCallError:
    """(name, arguments) of one parsed Hermes call, or the error the model reads."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCallError('a call is {"name": ..., "arguments": {...}}')
    args = obj.get("arguments", {})
    if isinstance(args, str):   # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            return ToolCallError(f"the arguments are not valid JSON ({e.msg} at char {e.pos})")
    return obj["name"], args


def hermes_calls(block: str) -> list:
    """The calls of one <tool_call> block's text: (name, arguments) pairs or errors. One JSON object per
    block (Hermes, Qwen); SmolLM2 was trained to write a JSON list of them in one block."""
    try:
        obj = json.loads(block)
    except json.JSONDecodeError as e:
        return [ToolCallError(f"the call is not valid JSON ({e.msg} at char {e.pos})")]
    return [_call(c) for c in (obj if isinstance(obj, list) else [obj])]


class HermesFormat:
    """<tool_call>{"name": ..., "arguments": ...}</tool_call> then end of turn; results as `tool` messages.

    Everything that can go wrong with the template is found here, when the format is built (start-up):
    a stand-in conversation with two results is rendered once and checked, so `render` does not fail
    mid-rollout (short of a template whose layout depends on what the results say)."""

    def __init__(self, tokenizer, model_name: str = "the model") -> None:
        self.tok = tokenizer            # an HFTokenizer, its `tools` already set
        self.triggers = tuple(tokenizer.stop_ids)
        fix = "use a model whose chat template renders tools Hermes-style (e.g. Qwen2.5-Instruct) or the built-in model"

        def fail(why: str) -> ConfigError:
            return ConfigError(f"rollout.tools: the chat template of {model_name} {why}; {fix}")

        probe = [{"role": "tool", "name": "f", "content": o} for o in _PROBE]
        self._after = AfterTurn(tokenizer, probe, "tool results", fail, tools=tokenizer.tools)
        names = [s.get("function", s).get("name", "") for s in tokenizer.tools or []]
        missing = [n for n in names if n not in self._after.prompt]
        if missing:
            raise fail(f"does not list the tools in the prompt (no {missing[0]!r} in it)")

    def calls_in(self, segment: list[int]) -> list | None:
        text = self.tok.tok.decode(segment, skip_special_tokens=False)
        blocks = _HERMES.findall(text)
        if not blocks:
            if "<tool_call>" in text:
                return [ToolCallError("<tool_call> without </tool_call>")]
            return None   # an ordinary end of turn
        calls = [c for b in blocks for c in hermes_calls(b)]
        return calls or [ToolCallError("<tool_call>[]</tool_call> names no call")]

    def render(self, records: list[CallRecord]) -> list[int]:
        """What the template puts after an assistant turn that ended with the calls (its end-of-turn
        token sampled), up to the next assistant turn: the results as `tool` messages."""
        return self._after.render([{"role": "tool", "name": r.name or "", "content": r.output} for r in records])


# ChatML (<|im_start|>role\n...<|im_end|>) templates that never read `tools` (SmolLM2-Instruct, many fine-tunes)
# get tools the way Qwen2.5's and NousResearch Hermes' templates give them: the schemas inside <tools></tools> at
# the end of the system message, calls as <tool_call>{json}</tool_call>, results inside <tool_response></tool_response>.
# The wording is grpolab's own (such templates define no tool prompt to match); `calls_in` also reads the JSON list
# of calls in one <tool_call> block that SmolLM2-Instruct was trained to write.
_IM_START, _IM_END = "<|im_start|>", "<|im_end|>"
_TOOLS_INTRO = "# Tools\n\nYou can call the functions whose JSON schemas are listed inside <tools></tools>:\n<tools>"
_TOOLS_OUTRO = ("\n</tools>\n\nTo call one, write its name and arguments as a JSON object inside "
                "<tool_call></tool_call> and end your turn:\n"
                "<tool_call>\n{\"name\": <function name>, \"arguments\": <arguments object>}\n"
                "</tool_call>\nEach result comes back inside <tool_response></tool_response>.")


def _jinja_str(s: str) -> str:
    """`s` as a Jinja string literal (Jinja reads backslash escapes in literals)."""
    return "'" + s.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"


def is_chatml(hf_tokenizer, template: str) -> bool:
    """Whether a template writes ChatML turns: both markers in the template and special tokens of the vocabulary."""
    vocab = hf_tokenizer.get_vocab()
    return all(t in template and t in vocab for t in (_IM_START, _IM_END))


def chatml_tools_template(template: str, default_system: str = "") -> str:
    """`template` with Hermes-style tools: when `tools` is given, a Jinja prelude rewrites `messages` (the tools
    block appended to the system message, or to `default_system` when there is none; each run of `tool` messages
    made one `user` turn of <tool_response> blocks) and the model's own template renders them. Without `tools`
    it renders exactly as `template` does (the prelude outputs nothing; its last newline is eaten by
    transformers' trim_blocks, so the template starts at a line start as before).

    Results go in a `user` turn, as Qwen2.5's and Qwen3's templates put them (NousResearch's Hermes templates use
    a `tool` role): user is a role every ChatML model was trained on, a `tool` role these models never saw."""
    def merge_results():
        return ("{%- if grpolab.results %}{%- set grpolab.msgs = grpolab.msgs + "
                "[{'role': 'user', 'content': grpolab.results}] %}{%- set grpolab.results = '' %}{%- endif %}")
    return (
        "{%- if tools %}"
        "{%- set grpolab = namespace(msgs=[], system=" + _jinja_str(default_system) + ", results='', block='') %}"
        "{%- for m in messages %}"
        "{%- if m['role'] == 'tool' %}"
        "{%- set grpolab.results = grpolab.results + ('\\n' if grpolab.results else '') + '<tool_response>\\n' + "
        "m['content'] + '\\n</tool_response>' %}"
        "{%- else %}" + merge_results() +
        "{%- if loop.first and m['role'] == 'system' %}{%- set grpolab.system = m['content'] %}"
        "{%- else %}{%- set grpolab.msgs = grpolab.msgs + [m] %}{%- endif %}"
        "{%- endif %}"
        "{%- endfor %}" + merge_results() +
        "{%- set grpolab.block = " + _jinja_str(_TOOLS_INTRO) + " %}"
        "{%- for t in tools %}{%- set grpolab.block = grpolab.block + '\\n' + (t | tojson) %}{%- endfor %}"
        "{%- set messages = [{'role': 'system', 'content': (grpolab.system + '\\n\\n' if grpolab.system else '') + "
        "grpolab.block + " + _jinja_str(_TOOLS_OUTRO) + "}] + grpolab.msgs %}"
        "{%- endif %}\n" + template)


def _default_system(hf_tokenizer) -> str:
    """The system message a ChatML template writes when a conversation has none ('' when it writes none):
    kept in front of the tools, as Qwen2.5 keeps its own."""
    try:
        text = hf_tokenizer.apply_chat_template([{"role": "user", "content": "q"}], tokenize=False)
    except Exception:   # noqa: BLE001 - a template that wants more than one message: HermesFormat's checks say why
        return ""
    head = f"{_IM_START}system\n"
    return text[len(head):text.index(_IM_END)] if text.startswith(head) and _IM_END in text else ""


def tool_format(tokenizer, schemas: list[dict], model_name: str = "the model"):
    """The format for `tokenizer`: the built-in one for the character tokenizer, else the chat
    template's. A ChatML template without tool support is given Hermes-style tools (installed as the
    tokenizer's chat template, so prompts, results and saved checkpoints all render them the same way).
    Every check runs here, at start-up: a ConfigError with the fix when the template cannot do tool calls."""
    if hasattr(tokenizer, "call_id"):
        return BuiltinFormat(tokenizer)
    hf = tokenizer.tok
    if model_name == "the model":   # a caller that did not say: the tokenizer knows where it came from
        model_name = getattr(hf, "name_or_path", "") or model_name
    template = getattr(hf, "chat_template", None) or ""
    if not isinstance(template, str):
        raise ConfigError(f"rollout.tools: {model_name} has several named chat templates; grpolab renders tools "
                          f"with one: save the tokenizer with the template to use as its chat_template")
    if "tools" not in template:
        if not is_chatml(hf, template):
            raise ConfigError(f"rollout.tools: the chat template of {model_name} has no tool support (it never reads "
                              f"`tools`) and is not ChatML (<|im_start|>role ... <|im_end|>), so grpolab cannot add "
                              f"Hermes-style tools to it; use a model whose template has them (e.g. "
                              f"Qwen2.5-Instruct), a ChatML one (e.g. SmolLM2-Instruct) or the built-in model")
        hf.chat_template = chatml_tools_template(template, _default_system(hf))
    elif "<tool_call>" not in template:
        raise ConfigError(f"rollout.tools: {model_name}'s chat template uses a tool-call syntax grpolab does not parse "
                          f"yet; supported: Hermes-style <tool_call>{{json}}</tool_call> (Qwen2.5, Qwen3, Hermes) "
                          f"and ChatML templates without tools (SmolLM2)")
    tokenizer.tools = schemas
    try:
        return HermesFormat(tokenizer, model_name)
    except ConfigError:
        hf.chat_template, tokenizer.tools = template, None   # leave the tokenizer as it was
        raise
