"""What a chat template writes after the model's turn (tool results, an environment's reply), as token ids.

A rollout is never re-tokenized: the model's turn stays the tokens it sampled, its end-of-turn token last.
What follows it is found on a stand-in conversation (a user message, an assistant message, then the new
messages) rendered with the generation prompt, less everything up to the assistant's end-of-turn token. The
template is checked once, when the renderer is built (start-up): one that rewrites earlier turns when more
follow, drops the assistant's text, does not end a turn with a stop token or does not reopen an assistant turn
is refused there, never mid-rollout.
"""

from __future__ import annotations

from typing import Callable

from ..errors import ConfigError

_ANSWER = "GRPOLAB-TURN"   # the stand-in assistant turn's text


class AfterTurn:
    """`render(messages) -> ids`: `messages` after an assistant turn, then the next assistant turn's opening.

    `tokenizer`: models/hf.HFTokenizer; `probe`: stand-in messages of the kind that will be rendered, whose
    contents must all show in what follows the turn; `what`: those messages in the errors ("tool results");
    `fail(why) -> ConfigError`: the caller's one line; `template_kwargs` go to every apply_chat_template call
    (`tools=`). After building, `prompt` is the stand-in user turn with the generation prompt."""

    def __init__(self, tokenizer, probe: list[dict], what: str, fail: Callable[[str], ConfigError],
                 **template_kwargs) -> None:
        self.tok, self.kwargs, self.what = tokenizer, template_kwargs, what
        hf = tokenizer.tok
        user = [{"role": "user", "content": "q"}]
        self._stand_in = [*user, {"role": "assistant", "content": _ANSWER}]
        try:
            prompt = hf.apply_chat_template(user, tokenize=False, add_generation_prompt=True, **template_kwargs)
            bare = hf.apply_chat_template(user, tokenize=False, **template_kwargs)
            after = self._text(probe)
        except Exception as e:   # noqa: BLE001 - a template error (jinja's, or the template's raise_exception)
            raise fail(f"cannot render a conversation with {what} ({type(e).__name__}: "
                       f"{str(e).splitlines()[0] if str(e) else ''})") from None
        self.prompt = prompt
        # the rollout is the prompt, the sampled turn, then what `render` appends: the conversation with the
        # new messages must read the same, so it must start with the prompt as it was rendered
        if not after.startswith(prompt):
            raise fail(f"renders {what} by rewriting the turns before them, so grpolab cannot append them to a "
                       f"rollout")
        answer = after.find(_ANSWER, len(prompt))
        if answer < 0:
            raise fail(f"drops the assistant's text from a turn followed by {what}")
        # the sampled turn ends with a stop token: the new messages go right after the first one after its text
        stops = [t for t in (hf.decode([i]) for i in tokenizer.stop_ids) if t]
        ends = sorted(e for e in ((after.find(t, answer + len(_ANSWER)), t) for t in stops) if e[0] >= 0)
        if not ends:
            raise fail(f"does not end an assistant turn with a stop token ({', '.join(map(repr, stops))})")
        self._prefix = after[:ends[0][0] + len(ends[0][1])]
        tail = after[len(self._prefix):]
        if not all(m["content"] in tail for m in probe):
            raise fail(f"drops {what} (a message's content is not in the rendered text)")
        gen = prompt[len(bare):] if prompt.startswith(bare) else ""
        if not tail.endswith(gen):
            raise fail(f"does not open an assistant turn after {what} (the generation prompt {gen!r})")
        self._fail = fail

    def _text(self, messages: list[dict]) -> str:
        return self.tok.tok.apply_chat_template(self._stand_in + messages, tokenize=False, add_generation_prompt=True,
                                                **self.kwargs)

    def render(self, messages: list[dict]) -> list[int]:
        """The ids that follow the model's end-of-turn token: `messages`, then the next assistant turn's opening."""
        text = self._text(messages)
        if not text.startswith(self._prefix):   # only a template whose layout depends on the messages' content
            raise self._fail(f"renders these {self.what} by rewriting the turns before them; grpolab cannot append "
                             f"them to a rollout")
        return list(self.tok.tok(text[len(self._prefix):], add_special_tokens=False)["input_ids"])
