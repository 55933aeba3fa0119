"""The served model's tokenizer over HTTP, in vLLM's shapes: POST /tokenize, POST /detokenize and
GET /tokenizer_info (what lm-evaluation-harness's `local-completions` asks for to count tokens with the
server's own tokenizer: its "remote" tokenizer backend).

- /tokenize {"prompt": str, "add_special_tokens": true, "return_token_strs": false} or {"messages": [...]}
  (rendered as /v1/chat/completions renders them, generation prompt included) ->
  {"count", "max_model_len", "tokens", "token_strs"}
- /detokenize {"tokens": [ids]} -> {"prompt": text} (special tokens kept, so the ids round-trip)
- /tokenizer_info -> {"tokenizer_class", "bos_token", "eos_token", "pad_token", "unk_token",
  "model_max_length", "chat_template"}
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ..models.tokenizer import BOS, END, PAD

# items serialised per json.dumps call: one call over millions of ids holds the GIL (and with it the event
# loop, /health too) for a second; between slices the loop's thread gets its turn
SLICE = 1 << 16


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None   # vLLM's defaults: true for a prompt, false for messages
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]


def longest_token_chars(tok) -> int:
    """An upper bound on the characters one token stands for: its longest vocabulary entry (a byte-level
    BPE entry's length is its byte count, at least its character count) or special-token text."""
    if hasattr(tok, "tok"):
        return max(len(s) for s in tok.tok.get_vocab())
    return max([1, *(len(s) for s in tok.special)])


def raw_ids(tok, text: str) -> list[int]:
    """A completions prompt as it is: an HF tokenizer's ids (its BOS included, special-token text
    parsed); for the built-in tokenizer, characters with special-token text (e.g. <|bos|>) parsed."""
    return encode(tok, text, add_special_tokens=True)


def encode(tok, text: str, add_special_tokens: bool) -> list[int]:
    """A text's ids, special-token text parsed; with `add_special_tokens`, the tokens a Hugging Face
    tokenizer adds (its BOS). The built-in tokenizer adds none."""
    if hasattr(tok, "tok"):
        return tok.tok(text, add_special_tokens=add_special_tokens)["input_ids"]
    parts = re.split("(" + "|".join(re.escape(t) for t in tok.special) + ")", text)
    return [i for part in parts if part for i in ([tok.special[part]] if part in tok.special else tok.encode(part))]


def token_strs(tok, ids: list[int]) -> list[str]:
    """Each id's token as the vocabulary spells it (a Hugging Face tokenizer's pieces, e.g. 'Ġthe')."""
    if hasattr(tok, "tok"):
        return tok.tok.convert_ids_to_tokens(ids)
    return [tok.decode([t], skip_special=False) for t in ids]


def json_list(items: list) -> str:
    """`items` as a compact JSON array (as FastAPI writes it), serialised SLICE items at a time."""
    return "[" + ",".join(json.dumps(items[i:i + SLICE], ensure_ascii=False, separators=(",", ":"))[1:-1]
                          for i in range(0, len(items), SLICE)) + "]"


def tokenize_body(tok, ids: list[int], context: int, with_strs: bool) -> bytes:
    """/tokenize's JSON response, built whole in the preparing thread: for a document of millions of tokens
    FastAPI's own encoding of the dict (jsonable_encoder, then json.dumps) took seconds on the event loop."""
    strs = json_list(token_strs(tok, ids)) if with_strs else "null"
    return (f'{{"count":{len(ids)},"max_model_len":{context},"tokens":{json_list(ids)},'
            f'"token_strs":{strs}}}').encode()


def tokenizer_info(tok, context: int) -> dict:
    """vLLM's /tokenizer_info fields that clients read: the special tokens' texts, the class and chat template."""
    if hasattr(tok, "tok"):
        t = tok.tok
        template = t.chat_template if isinstance(getattr(t, "chat_template", None), str) else None
        return {"tokenizer_class": type(t).__name__, "bos_token": t.bos_token, "eos_token": t.eos_token,
                "pad_token": t.pad_token, "unk_token": t.unk_token, "model_max_length": context,
                "chat_template": template}
    return {"tokenizer_class": type(tok).__name__, "bos_token": BOS, "eos_token": END, "pad_token": PAD,
            "unk_token": None, "model_max_length": context, "chat_template": None}
