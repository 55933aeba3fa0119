"""Preference pairs for DPO and reward models: rows of prompt, chosen, rejected.

Formats (data/formats.py lists them for error messages):
- TRL's explicit prompt: `prompt` (text or messages; data.prompt_key when the row has it), `chosen` and
  `rejected` (text, or lists of assistant messages; data.chosen_key / data.rejected_key, dotted keys
  reaching into nested columns);
- TRL's implicit prompt: no prompt column; `chosen` and `rejected` are whole conversations (the prompt
  is the messages they share from the start) or whole texts (the prompt is their shared start, as TRL's
  extract_prompt takes it: a space just before the split goes with the completions);
- LLaMA-Factory's alpaca pairs (instruction, input, chosen, rejected texts) and sharegpt pairs
  (conversations ending with a human turn, chosen / rejected {from, value} messages).
Each side becomes an SFT row (data/supervised.py), trained on the chosen/rejected part only.
"""

from __future__ import annotations

import math

from ..errors import DataError
from .formats import (
    MISSING,
    PAIR_FORMATS,
    alpaca_pair,
    dig,
    formats_hint,
    is_alpaca,
    is_sharegpt,
    shared_text_prefix,
    sharegpt_pair,
)
from .loading import _preview
from .supervised import _messages, as_sft_row, encode, fit_length


def _side(value: object, where: str, name: str):
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"{where}: {name!r} is empty; every pair needs a non-empty chosen and rejected completion")
        return value
    if isinstance(value, list) and not value:
        raise DataError(f"{where}: {name!r} is empty; every pair needs a non-empty chosen and rejected completion")
    return _messages(value, where, repr(name))


def preference_rows(records: list[dict], source: str = "", margin: bool = False, *, prompt_key: str = "prompt",
                    chosen_key: str = "chosen", rejected_key: str = "rejected") -> list[dict]:
    """Rows {'prompt', 'chosen', 'rejected'} (each text or messages), checked; DataError naming the row.
    With `margin`, a row's optional `margin` column (a finite number, or null) is kept too (reward models).
    The prompt is read from `prompt_key` when the row has it, else from a 'prompt' column (the pairs
    `grpolab sample --pairs` writes), else it is implicit."""
    where0 = f"{source}: " if source else ""
    if not records:
        raise DataError(f"{where0}no preference pairs; check the file and the split")
    out = []
    for i, r in enumerate(records, start=1):
        where = f"{where0}row {i}"
        if not isinstance(r, dict):
            raise DataError(f"{where}: expected an object with columns, got {_preview(r)}")
        if is_sharegpt(r) and isinstance(r.get("chosen"), dict):
            row = sharegpt_pair(r, where)
        elif is_alpaca(r):
            row = alpaca_pair(r, where)
        else:
            row = _trl_pair(r, where, prompt_key, chosen_key, rejected_key)
        if row["chosen"] == row["rejected"]:
            raise DataError(f"{where}: chosen and rejected are the same; drop the row")
        if margin and r.get("margin") is not None:
            m = r["margin"]
            if isinstance(m, bool) or not isinstance(m, (int, float)) or not math.isfinite(m):
                raise DataError(f"{where}: 'margin' is {m!r}; give a finite number (or leave it out)")
            row["margin"] = float(m)
        out.append(row)
    return out


def _trl_pair(r: dict, where: str, prompt_key: str, chosen_key: str, rejected_key: str) -> dict:
    chosen, rejected = dig(r, chosen_key), dig(r, rejected_key)
    missing = [k for k, v in ((chosen_key, chosen), (rejected_key, rejected)) if v is MISSING]
    if missing:
        raise DataError(f"{where}: no {' or '.join(repr(k) for k in missing)} column; columns are {sorted(r)}; "
                        f"{formats_hint(PAIR_FORMATS, 'preference')}")
    chosen, rejected = _side(chosen, where, chosen_key), _side(rejected, where, rejected_key)
    key = prompt_key if dig(r, prompt_key) is not MISSING else "prompt"
    prompt = dig(r, key)
    if prompt is not MISSING:
        if isinstance(prompt, str):
            if not prompt.strip():
                raise DataError(f"{where}: {key!r} is empty")
        else:
            prompt = _messages(prompt, where, repr(key))
    elif isinstance(chosen, list) and isinstance(rejected, list):   # implicit prompt: the shared opening messages
        n = 0
        while n < min(len(chosen), len(rejected)) - 1 and chosen[n] == rejected[n]:
            n += 1
        if n == 0:
            raise DataError(f"{where}: no 'prompt' column and chosen/rejected share no opening messages")
        prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
    elif isinstance(chosen, str) and isinstance(rejected, str):   # implicit prompt: the shared start of the texts
        n = shared_text_prefix(chosen, rejected)
        if not chosen[:n].strip():
            raise DataError(f"{where}: no 'prompt' column and the chosen and rejected texts share no start to "
                            f"take as the prompt; give a prompt column")
        prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
    else:
        raise DataError(f"{where}: no 'prompt' column, and chosen/rejected are not both texts or both "
                        f"conversations; {formats_hint(PAIR_FORMATS, 'preference')}")
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def side_row(pair: dict, side: str) -> dict:
    """The chosen or rejected side of a pair as an SFT row."""
    return as_sft_row(pair["prompt"], pair[side])


def fit_pairs(pairs: list[dict], tokenizer, max_length: int, source: str = "") -> tuple[list[dict], list[int]]:
    """(the pairs both of whose sides keep a completion token within `max_length` tokens, the 1-based rows
    of the others). DPO cuts each side to the model's context, and a side whose prompt fills the context
    has nothing left to train on; a batch of only such pairs left the trainer nothing (`range() arg 3
    must not be zero` mid-run), so they are found before training. DataError naming the rows when no pair fits."""
    kept, dropped, sizes = [], [], []
    for i, p in enumerate(pairs, start=1):
        sides = [encode(tokenizer, side_row(p, s)) for s in ("chosen", "rejected")]
        if all(e is not None for e in fit_length(sides, max_length, "truncate")[0]):
            kept.append(p)
        else:
            dropped.append(i)
            if len(sizes) < 5:   # the prompt lengths the message shows
                sizes.append(len(tokenizer.render_prompt(p["prompt"])))
    if not kept:
        where = f"{source}: " if source else ""
        shown = ", ".join(f"row {i} ({n})" for i, n in zip(dropped[:5], sizes))
        more = f" and {len(dropped) - 5} more" if len(dropped) > 5 else ""
        raise DataError(f"{where}no pair fits the model's context of {max_length} tokens: the prompts (tokens, "
                        f"template included) of {shown}{more} leave no room for a chosen or rejected token; "
                        f"shorten the prompts or use a model with a longer context")
    return kept, dropped


def heldout_size(eval_size: int | None, n_pairs: int) -> int:
    """Pairs held out of `n_pairs` for the reward model's eval: `eval_size` when given (rm.eval_size),
    else 10% of them, at least 1 and at most 200 (none from a single pair): a default that fits a
    file of 20 pairs and a file of 20,000."""
    if eval_size is not None:
        return eval_size
    return 0 if n_pairs < 2 else min(200, max(1, n_pairs // 10))
