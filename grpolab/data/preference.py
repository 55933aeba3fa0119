"""Preference pairs for DPO: rows of prompt, chosen, rejected (TRL's formats).

- explicit prompt: `prompt` (text or messages), `chosen` and `rejected` (text, or lists of
  assistant messages);
- implicit prompt: `chosen` and `rejected` are whole conversations; the prompt is the messages
  they share from the start.
Each side becomes an SFT row (data/supervised.py), trained on the chosen/rejected part only.
"""

from __future__ import annotations

import math

from ..errors import DataError
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


def preference_rows(records: list[dict], source: str = "", margin: bool = False) -> list[dict]:
    """Rows {'prompt', 'chosen', 'rejected'} (each text or messages), checked; DataError naming the row.
    With `margin`, a row's optional `margin` column (a finite number, or null) is kept too (reward models)."""
    where0 = f"{source}: " if source else ""
    if not records:
        raise DataError(f"{where0}no preference pairs; check the file and the split")
    out = []
    for i, r in enumerate(records, start=1):
        where = f"{where0}row {i}"
        missing = [k for k in ("chosen", "rejected") if not isinstance(r, dict) or k not in r]
        if missing:
            cols = sorted(r) if isinstance(r, dict) else _preview(r)
            raise DataError(f"{where}: no {' or '.join(repr(k) for k in missing)} column; columns are {cols}; "
                            f"DPO rows need prompt, chosen and rejected")
        chosen, rejected = _side(r["chosen"], where, "chosen"), _side(r["rejected"], where, "rejected")
        if "prompt" in r:
            prompt = r["prompt"]
            if isinstance(prompt, str):
                if not prompt.strip():
                    raise DataError(f"{where}: 'prompt' is empty")
            else:
                prompt = _messages(prompt, where, "'prompt'")
        elif isinstance(chosen, list) and isinstance(rejected, list):   # implicit prompt: the shared start
            n = 0
            while n < min(len(chosen), len(rejected)) - 1 and chosen[n] == rejected[n]:
                n += 1
            if n == 0:
                raise DataError(f"{where}: no 'prompt' column and chosen/rejected share no opening messages")
            prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
        else:
            raise DataError(f"{where}: no 'prompt' column; columns are {sorted(r)}; DPO rows need prompt, chosen "
                            f"and rejected (or whole chosen/rejected conversations)")
        if chosen == rejected:
            raise DataError(f"{where}: chosen and rejected are the same; drop the row")
        row = {"prompt": prompt, "chosen": chosen, "rejected": rejected}
        if margin and r.get("margin") is not None:
            m = r["margin"]
            if isinstance(m, bool) or not isinstance(m, (int, float)) or not math.isfinite(m):
                raise DataError(f"{where}: 'margin' is {m!r}; give a finite number (or leave it out)")
            row["margin"] = float(m)
        out.append(row)
    return out


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
