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
"""

from __future__ import annotations

import json
import re

from ..config import ConfigError
from .tools import CallRecord, ToolCallError


def _args(text: str) -> object:
    """A call's arguments: a JSON object when the text is one, else the text itself."""
    text = text.strip()
    if text.startswith("{"):
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise ToolCallError(f"arguments are not valid JSON ({e.msg} at char {e.pos})") from None
    return text


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
        body = self.tok.decode(segment[starts[-1] + 1:-1]).strip()
        name, _, rest = body.partition(" ")
        if "\n" in name:
            name, _, more = name.partition("\n")
            rest = more + rest
        if not name:
            return [ToolCallError("empty call: write <|call|>NAME ARGUMENTS<|/call|>")]
        try:
            return [(name, _args(rest))]
        except ToolCallError as e:
            return [e]

    def render(self, records: list[CallRecord]) -> list[int]:
        text = "\n".join(r.output for r in records)
        return [self.tok.out_id, *self.tok.encode(text, tool_tokens=False), self.tok.out_end_id]


_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


class HermesFormat:
    """<tool_call>{"name": ..., "arguments": ...}</tool_call> then end of turn; results as `tool` messages."""

    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer            # an HFTokenizer
        self.triggers = tuple(tokenizer.stop_ids)
        self._eos_text = tokenizer.tok.decode([tokenizer.eos_id])

    def calls_in(self, segment: list[int]) -> list | None:
        text = self.tok.tok.decode(segment, skip_special_tokens=False)
        blocks = _HERMES.findall(text)
        if not blocks:
            if "<tool_call>" in text:
                return [ToolCallError("<tool_call> without </tool_call>")]
            return None   # an ordinary end of turn
        calls = []
        for b in blocks:
            try:
                obj = json.loads(b)
                if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                    raise ToolCallError('a call is {"name": ..., "arguments": {...}}')
                args = obj.get("arguments", {})
                calls.append((obj["name"], json.loads(args) if isinstance(args, str) else args))
            except json.JSONDecodeError as e:
                calls.append(ToolCallError(f"the call is not valid JSON ({e.msg} at char {e.pos})"))
            except ToolCallError as e:
                calls.append(e)
        return calls

    def render(self, records: list[CallRecord]) -> list[int]:
        """What the template puts after an assistant turn that ended with the calls (its end-of-turn
        token sampled), up to the next assistant turn: the difference of a stand-in conversation
        rendered with and without the results."""
        hf = self.tok.tok
        stand_in = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
        before = hf.apply_chat_template(stand_in, tokenize=False, tools=self.tok.tools)
        cut = before.rindex(self._eos_text) + len(self._eos_text)
        msgs = [{"role": "tool", "name": r.name or "", "content": r.output} for r in records]
        after = hf.apply_chat_template(stand_in + msgs, tokenize=False, add_generation_prompt=True,
                                       tools=self.tok.tools)
        if not after.startswith(before[:cut]):
            raise ConfigError("the chat template renders tool results by rewriting the turns before them; "
                              "grpolab cannot append them to a rollout")
        return list(hf(after[cut:], add_special_tokens=False)["input_ids"])


def tool_format(tokenizer, schemas: list[dict], model_name: str = "the model"):
    """The format for `tokenizer`: the built-in one for the character tokenizer, else the chat
    template's (a ConfigError with the fix when the template cannot do tool calls)."""
    if hasattr(tokenizer, "call_id"):
        return BuiltinFormat(tokenizer)
    template = getattr(tokenizer.tok, "chat_template", None) or ""
    if "tools" not in template:
        raise ConfigError(f"rollout.tools: the chat template of {model_name} has no tool support (it never reads "
                          f"`tools`); use a model whose template has it (e.g. Qwen2.5-Instruct) or the built-in model")
    if "<tool_call>" not in template:
        raise ConfigError(f"rollout.tools: {model_name}'s chat template uses a tool-call syntax grpolab does not parse "
                          f"yet; supported: Hermes-style <tool_call>{{json}}</tool_call> (Qwen2.5, Qwen3, Hermes)")
    tokenizer.tools = schemas
    return HermesFormat(tokenizer)
