"""An environment's reply as the tokens that follow the model's turn: rendered once through the chat template
(`models.chat_turns.AfterTurn`, the same rendering tool results get), never by re-tokenizing the conversation."""

from __future__ import annotations

from ..errors import ConfigError
from ..models.chat_turns import AfterTurn

_PROBE = "GRPOLAB-ENVIRONMENT-REPLY"   # the stand-in reply checked at start-up


class TurnRenderer:
    """`render(messages) -> ids` for an HF tokenizer with a chat template (models/hf.HFTokenizer): the reply's
    messages after the model's end-of-turn token, then the next assistant turn's opening."""

    def __init__(self, tokenizer, model_name: str = "the model") -> None:
        hf = getattr(tokenizer, "tok", None)
        if hf is None or not getattr(hf, "chat_template", None):
            raise ConfigError(f"env.name: environments talk to a chat model; the tokenizer of {model_name} has no "
                              f"chat template (use an -Instruct Hugging Face model)")

        def fail(why: str) -> ConfigError:
            return ConfigError(f"env.name: the chat template of {model_name} {why}")

        self.tok = tokenizer
        self._after = AfterTurn(tokenizer, [{"role": "user", "content": _PROBE}], "an environment's reply", fail)

    def render(self, messages: list[dict]) -> list[int]:
        return self._after.render(messages)
