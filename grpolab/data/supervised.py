"""Supervised examples (SFT, distillation): rows -> token ids and a loss mask.

Row formats (data/formats.py lists them for error messages):
- prompt + completion (TRL's, verl's): `prompt` (text or {role, content} messages) and `completion`
  (text, or a list of assistant messages); the column names are data.prompt_key / data.response_key,
  dotted keys reaching into nested columns.
- conversation: `messages`, a list of {role, content}; every assistant turn is trained on.
- text (TRL's language modelling): `text`, trained on whole (no chat template), then the stop token.
- LLaMA-Factory's alpaca and sharegpt rows, turned into conversations (data/formats.py).

The loss mask marks the tokens the model learns to produce: the completion (with its stop
token), each assistant turn as the chat template renders it, or all of a text row; never the
prompt, the other turns or padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import DataError
from ..utils.padding import pad_sequences
from .formats import (
    MISSING,
    SFT_FORMATS,
    TEXT_KEY,
    alpaca_sft,
    dig,
    formats_hint,
    has,
    is_alpaca,
    is_sharegpt,
    sharegpt_sft,
)
from .loading import _preview, check_roles
from .messages import canonical_role

MESSAGES_KEY = "messages"


@dataclass
class Example:
    """One tokenized example: ids and, per token, whether the loss predicts it."""
    ids: list[int]
    loss: list[bool]


def _messages(value: object, where: str, what: str) -> list[dict]:
    if isinstance(value, list) and value and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value):
        check_roles(value, where, what)
        return [{"role": canonical_role(m["role"]), "content": m["content"]} for m in value]
    raise DataError(f"{where}: {what} must be a non-empty list of {{'role': str, 'content': str}} messages, "
                    f"got {_preview(value)}")


def sft_rows(records: list[dict], *, prompt_key: str = "prompt", response_key: str = "completion",
             source: str = "") -> list[dict]:
    """Rows as {'messages': [...], 'train_from': i} (conversational: assistant turns from message i on are
    trained), {'prompt': str, 'completion': str} or {'text': str}; a clear DataError naming the row otherwise.
    The format is read from each row's columns, in this order: prompt/completion, messages, sharegpt,
    alpaca, text."""
    where0 = f"{source}: " if source else ""
    if not records:
        raise DataError(f"{where0}dataset is empty; check the file and the split")
    out = []
    for i, r in enumerate(records, start=1):
        where = f"{where0}row {i}"
        if not isinstance(r, dict):
            raise DataError(f"{where}: expected an object with columns, got {_preview(r)}")
        if not has(r, prompt_key) and not has(r, response_key):
            out.append(_other_format(r, where, prompt_key, response_key))
            continue
        prompt, completion = dig(r, prompt_key), dig(r, response_key)
        missing = [k for k, v in ((prompt_key, prompt), (response_key, completion)) if v is MISSING]
        if missing:
            raise DataError(f"{where}: no {' or '.join(repr(k) for k in missing)} column; columns are {sorted(r)}; "
                            f"{formats_hint(SFT_FORMATS, 'SFT')}")
        if isinstance(completion, (int, float)) and not isinstance(completion, bool):
            completion = str(completion)
        if isinstance(completion, str) and not completion.strip():
            raise DataError(f"{where}: {response_key!r} is empty; fill it in or drop the row")
        if isinstance(prompt, str) and not prompt.strip():
            raise DataError(f"{where}: {prompt_key!r} is empty; fill it in or drop the row")
        out.append(as_sft_row(prompt if isinstance(prompt, str) else _messages(prompt, where, repr(prompt_key)),
                              completion if isinstance(completion, str) else
                              _messages(completion, where, repr(response_key))))
    return out


def has_sft_target(r: object, response_key: str) -> bool:
    """Whether a row carries something SFT learns (a completion, an assistant turn, a text): a held-out file
    of prompts and answers only has none, and gives no held-out loss."""
    return isinstance(r, dict) and (has(r, response_key) or MESSAGES_KEY in r or is_sharegpt(r) or TEXT_KEY in r
                                    or (is_alpaca(r) and "output" in r))


def _other_format(r: dict, where: str, prompt_key: str, response_key: str) -> dict:
    """An SFT row from a row without prompt/completion columns: messages, sharegpt, alpaca or text."""
    if MESSAGES_KEY in r:
        msgs = _messages(r[MESSAGES_KEY], where, f"column {MESSAGES_KEY!r}")
        if not any(m["role"] == "assistant" for m in msgs):
            raise DataError(f"{where}: conversation has no assistant turn to train on")
        return {"messages": msgs, "train_from": 0}
    if is_sharegpt(r):
        return sharegpt_sft(r, where)
    if is_alpaca(r):
        return alpaca_sft(r, where)
    if TEXT_KEY in r:
        text = r[TEXT_KEY]
        if not isinstance(text, str) or not text.strip():
            raise DataError(f"{where}: {TEXT_KEY!r} must be non-empty text, got {_preview(text)}")
        return {TEXT_KEY: text}
    raise DataError(f"{where}: no {prompt_key!r} or {response_key!r} column; columns are {sorted(r)}; "
                    f"{formats_hint(SFT_FORMATS, 'SFT')}")


def as_sft_row(prompt: str | list[dict], completion: str | list[dict]) -> dict:
    """A checked prompt and completion (text, or messages) as an SFT row: plain text stays prompt +
    completion; otherwise a conversation trained from the completion's first message on."""
    if isinstance(prompt, str) and isinstance(completion, str):
        return {"prompt": prompt, "completion": completion}
    msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    tail = [{"role": "assistant", "content": completion}] if isinstance(completion, str) else list(completion)
    return {"messages": msgs + tail, "train_from": len(msgs)}


def task_sft_rows(rows: list[dict]) -> list[dict]:
    """The built-in tasks' rows (prompt + worked answer) as SFT rows."""
    return [as_sft_row(r["prompt"], r["answer"]) for r in rows]


def encode(tokenizer, row: dict) -> Example:
    """Token ids and loss mask of one SFT row (see `sft_rows`)."""
    if "messages" in row:
        ids, loss = tokenizer.render_conversation(row["messages"], train_from=row.get("train_from", 0))
        return Example(list(ids), list(loss))
    if TEXT_KEY in row:   # the text as it is, then the stop token (TRL appends EOS too); BOS where the model has one
        bos = [tokenizer.bos_id] if getattr(tokenizer, "bos_id", None) is not None else []
        ids = bos + list(tokenizer.encode(row[TEXT_KEY])) + [tokenizer.eos_id]
        return Example(ids, [False] * len(bos) + [True] * (len(ids) - len(bos)))
    p = tokenizer.render_prompt(row["prompt"])
    c = tokenizer.render_completion(row["completion"])
    # what a tool wrote (<|out|>...<|/out|> in built-in completions) is context, not a target
    tool = tokenizer.tool_output_mask(c) if hasattr(tokenizer, "tool_output_mask") else [False] * len(c)
    return Example(p + c, [False] * len(p) + [not t for t in tool])


def fit_length(examples: list[Example], max_length: int, on_long: str) -> tuple[list[Example | None], int, int]:
    """Apply the length policy (sft.on_long) to each example: (the examples, None where dropped;
    how many truncated; how many dropped). `truncate` cuts the end, and drops an example left with no
    loss token; `drop` drops every long one; `error` raises naming the first long row."""
    out, truncated, dropped = [], 0, 0
    for i, e in enumerate(examples, start=1):
        if len(e.ids) <= max_length:
            out.append(e)
        elif on_long == "error":
            raise DataError(f"row {i}: {len(e.ids)} tokens, over sft.max_length={max_length}; raise sft.max_length, "
                            f"or set sft.on_long=truncate or drop")
        elif on_long == "truncate" and any(e.loss[:max_length]):
            out.append(Example(e.ids[:max_length], e.loss[:max_length]))
            truncated += 1
        else:
            out.append(None)
            dropped += 1
    return out, truncated, dropped


def pack(examples: list[Example], max_length: int) -> list[list[Example]]:
    """Consecutive examples packed into sequences of at most max_length tokens (in order; an
    example never straddles two sequences). Each packed example attends only to itself."""
    packs, cur, n = [], [], 0
    for e in examples:
        if cur and n + len(e.ids) > max_length:
            packs.append(cur)
            cur, n = [], 0
        cur.append(e)
        n += len(e.ids)
    if cur:
        packs.append(cur)
    return packs


def collate(items: list, pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch of examples (or of packs of examples): ids (B, T), valid (B, T), loss (B, T)
    (the tokens to predict) and, for packs, segments (B, T): which example of the pack a token is in."""
    packs = [x if isinstance(x, list) else [x] for x in items]
    ids = [[t for e in p for t in e.ids] for p in packs]
    ids_t, valid = pad_sequences(ids, pad_id, "right")
    loss = torch.zeros_like(valid)
    seg = torch.zeros(ids_t.shape, dtype=torch.long)
    for b, p in enumerate(packs):
        j = 0
        for k, e in enumerate(p):
            loss[b, j:j + len(e.ids)] = torch.tensor(e.loss, dtype=torch.bool)
            seg[b, j:j + len(e.ids)] = k
            j += len(e.ids)
    out = {"ids": ids_t, "valid": valid, "loss": loss}
    if any(len(p) > 1 for p in packs):
        out["segments"] = seg
    return out
