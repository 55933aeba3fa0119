"""An environment's reply as the tokens that follow the model's turn: rendered once through the chat template.

The conversation is never re-tokenized: the model's turn stays the tokens it sampled (its end-of-turn token
last), and after them come the tokens of what the template writes between that token and the next assistant
turn: the reply's messages and the generation prompt. That text is found on a stand-in conversation (a user
message, an assistant message, then the reply), less everything up to the assistant's end-of-turn token, and is
checked once at start-up: a template that rewrites earlier turns when more follow, drops the assistant's text or
the reply's, or does not reopen an assistant turn is refused there, not mid-run.
"""

from __future__ import annotations

from ..errors import ConfigError

_ANSWER = "GRPOLAB-TURN"             # the stand-in assistant turn's text
_PROBE = "GRPOLAB-ENVIRONMENT-REPLY"  # the stand-in reply


class TurnRenderer:
    """`render(messages) -> ids` for an HF tokenizer with a chat template (models/hf.HFTokenizer)."""

    def __init__(self, tokenizer, model_name: str = "the model") -> None:
        hf = getattr(tokenizer, "tok", None)
        if hf is None or not getattr(hf, "chat_template", None):
            raise ConfigError(f"env.name: environments talk to a chat model; the tokenizer of {model_name} has no "
                              f"chat template (use an -Instruct Hugging Face model)")
        self.tok = tokenizer
        user = [{"role": "user", "content": "q"}]
        self._stand_in = [*user, {"role": "assistant", "content": _ANSWER}]
        try:
            prompt = hf.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
            bare = hf.apply_chat_template(user, tokenize=False)
            after = self._text([{"role": "user", "content": _PROBE}])
        except Exception as e:   # noqa: BLE001 - a template error, in one line
            why = str(e).splitlines()[0] if str(e) else ""
            raise ConfigError(f"env.name: the chat template of {model_name} cannot render a reply after an "
                              f"assistant turn ({type(e).__name__}: {why})") from None
        fail = f"env.name: the chat template of {model_name}"
        if not after.startswith(prompt):
            raise ConfigError(f"{fail} rewrites the turns before a reply, so grpolab cannot append replies to an "
                              f"episode")
        at = after.find(_ANSWER, len(prompt))
        if at < 0:
            raise ConfigError(f"{fail} drops the assistant's text from a turn that a reply follows")
        # the sampled turn ends with a stop token: the reply's tokens start right after the first one
        stops = [t for t in (hf.decode([i]) for i in tokenizer.stop_ids) if t]
        ends = sorted(e for e in ((after.find(t, at + len(_ANSWER)), t) for t in stops) if e[0] >= 0)
        if not ends:
            raise ConfigError(f"{fail} does not end an assistant turn with a stop token "
                              f"({', '.join(map(repr, stops))})")
        self._prefix = after[:ends[0][0] + len(ends[0][1])]
        tail = after[len(self._prefix):]
        gen = prompt[len(bare):] if prompt.startswith(bare) else ""
        if _PROBE not in tail or not tail.endswith(gen):
            raise ConfigError(f"{fail} does not render a user message after an assistant turn and then open the "
                              f"next assistant turn")

    def _text(self, messages: list[dict]) -> str:
        return self.tok.tok.apply_chat_template(self._stand_in + messages, tokenize=False, add_generation_prompt=True)

    def render(self, messages: list[dict]) -> list[int]:
        """The ids that follow the model's end-of-turn token: `messages`, then the next assistant turn's opening."""
        text = self._text(messages)
        if not text.startswith(self._prefix):   # only a template whose layout depends on the reply's content
            raise ConfigError("env.name: the chat template renders this reply by rewriting the turns before it")
        return list(self.tok.tok(text[len(self._prefix):], add_special_tokens=False)["input_ids"])
