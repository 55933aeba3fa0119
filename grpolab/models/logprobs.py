"""Per-token log-probs of completion tokens, recomputed from the sampled token ids."""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint

from ..utils.padding import pad_to_width

# optim.logprob_chunk null: chunks of AUTO_CHUNK positions where one pass's float32 logits would be
# larger than AUTO_CHUNK_BYTES; below that, keeping them for the backward beats recomputing them
# (SmolLM2, 8 rows x 64 positions x 49,152 tokens = 96 MiB: the GRPO update 15 % faster unchunked)
AUTO_CHUNK, AUTO_CHUNK_BYTES = 32, 128 * 2**20


def logprob_chunk(setting: int | None, model, rows: int, positions: int) -> int:
    """Positions per log-prob chunk for optim.logprob_chunk `setting` (None: by the size of the logits
    of `rows` x `positions` over `model`'s vocabulary)."""
    if setting is not None:
        return setting
    vocab = getattr(getattr(model, "config", None), "vocab_size", 0) or 0
    return AUTO_CHUNK if rows * positions * vocab * 4 > AUTO_CHUNK_BYTES else 0


def completion_logprobs(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                        completion_ids: torch.Tensor, completion_mask: torch.Tensor,
                        temperature: float = 1.0, with_entropy: bool = False, entropy_grad: bool = False,
                        chunk: int | None = 0, context_mask: torch.Tensor | None = None, group: int = 0):
    """log softmax(logits / T) of each completion token, (B, C); 0 at masked positions.

    context_mask (B, C): the completion tokens the model attends to, when more than completion_mask's
    (tool outputs: read as context, scored 0 like padding); default completion_mask.

    One forward over [left-padded prompt | completion]; the logits at position j predict
    token j+1, so completion token t is scored by the logits at P - 1 + t. With
    with_entropy, also returns the per-token entropy of that distribution (differentiable only
    with entropy_grad, for an entropy bonus).

    chunk > 0 (optim.logprob_chunk; None: `logprob_chunk`'s choice for this batch): the model returns
    hidden states and the head, log-softmax and
    entropy run over `chunk` positions at a time; with autograd each chunk is recomputed in the
    backward (torch.utils.checkpoint) instead of kept. So no (B, C, V) float32 tensor lives
    longer than one chunk: peak memory stops growing with vocabulary x completion length. The
    values are the same, position by position.

    group > 1 (optim.share_prompt): rows come in groups of `group` with the same prompt (a rollout's G
    samples). Where the model offers `prefix_cache` (HF models with a plain head), each group's prompt
    runs once and its keys and values (with autograd) serve the group's completions: the same function,
    with the prompt's share of the work divided by `group`. Rows that are not such groups (a micro-batch
    cutting a group, a filtered batch) take the plain path; the values agree to float rounding.
    """
    # Drop columns that are padding in every row (prompts are left-padded, completions right-padded),
    # so a micro-batch of short sequences costs what its own lengths cost. Positions come from the
    # mask (HF) or are relative (RoPE), so the result does not change.
    C_full = completion_ids.size(1)
    context_mask = completion_mask if context_mask is None else context_mask
    real_p = prompt_mask.any(0).nonzero()
    real_c = context_mask.any(0).nonzero()
    first = int(real_p[0]) if len(real_p) else prompt_ids.size(1) - 1
    last = int(real_c[-1]) + 1 if len(real_c) else 1
    prompt_ids, prompt_mask = prompt_ids[:, first:], prompt_mask[:, first:]
    completion_ids, completion_mask = completion_ids[:, :last], completion_mask[:, :last]
    ids = torch.cat([prompt_ids, completion_ids], dim=1)
    valid = torch.cat([prompt_mask, context_mask[:, :last]], dim=1)
    C = completion_ids.size(1)
    chunk = logprob_chunk(chunk, model, completion_ids.size(0), C)
    want_grad = torch.is_grad_enabled()
    h = _shared_prompt_hidden(model, prompt_ids, prompt_mask, completion_ids, context_mask[:, :last], group)
    if h is not None and chunk <= 0:   # one pass through the head
        logp, entropy = _score(model.head, h, completion_ids, temperature=temperature, with_entropy=with_entropy,
                               entropy_grad=entropy_grad)
    elif chunk > 0 and getattr(model, "has_plain_head", True) and hasattr(model, "head"):
        if h is None:
            # the last C positions of ids[:, :-1] are P-1 .. P+C-2: exactly the ones that predict the completion
            h = model(ids[:, :-1], key_valid=valid[:, :-1], logits_to_keep=C, hidden=True)
        parts = []
        for i in range(0, C, chunk):
            args = (h[:, i:i + chunk], completion_ids[:, i:i + chunk])
            fn = functools.partial(_score, model.head, temperature=temperature, with_entropy=with_entropy,
                                   entropy_grad=entropy_grad)
            parts.append(checkpoint(fn, *args, use_reentrant=False) if want_grad else fn(*args))
        logp = torch.cat([p[0] for p in parts], dim=1)
        entropy = torch.cat([p[1] for p in parts], dim=1) if with_entropy else None
    else:
        logits = model(ids[:, :-1], key_valid=valid[:, :-1], logits_to_keep=C)
        logp, entropy = _score(lambda x: x, logits, completion_ids, temperature=temperature,
                               with_entropy=with_entropy, entropy_grad=entropy_grad)
    logp = pad_to_width(logp * completion_mask, C_full, 0.0)
    if not with_entropy:
        return logp
    return logp, pad_to_width(entropy, C_full, 0.0)


def _shared_prompt_hidden(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                          completion_valid: torch.Tensor, group: int) -> torch.Tensor | None:
    """Hidden states (B, C, H) predicting each completion token, each group's prompt run once; None when
    the rows are not groups of `group` identical prompts or the model cannot share a prompt."""
    B = prompt_ids.size(0)
    if group <= 1 or B % group or not hasattr(model, "prefix_cache"):
        return None
    firsts, firsts_mask = prompt_ids[::group], prompt_mask[::group]
    if not (torch.equal(prompt_ids, firsts.repeat_interleave(group, 0))
            and torch.equal(prompt_mask, firsts_mask.repeat_interleave(group, 0))):
        return None
    cache = model.prefix_cache()
    if cache is None:
        return None
    # the prompt's last position predicts completion token 0; completion token t-1 predicts token t
    last = model(firsts, key_valid=firsts_mask, cache=cache, logits_to_keep=1, hidden=True)
    h = last.repeat_interleave(group, 0)
    if completion_ids.size(1) > 1:
        cache = cache.repeat_interleave(group)
        rest = model(completion_ids[:, :-1], key_valid=completion_valid[:, :-1], cache=cache, hidden=True)
        h = torch.cat([h, rest], dim=1)
    return h


def _score(head, h: torch.Tensor, ids: torch.Tensor, *, temperature: float, with_entropy: bool,
           entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-prob of `ids`, entropy or None) from hidden states `h` through `head`, in float32."""
    logits = head(h).float()
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = logits.log_softmax(-1)
    logp = logp_all.gather(-1, ids[..., None]).squeeze(-1)
    if not with_entropy:
        return logp, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def token_logprobs(model, ids: torch.Tensor, valid: torch.Tensor, *, segments: torch.Tensor | None = None,
                   chunk: int | None = 0) -> torch.Tensor:
    """log p(ids[:, t + 1] | ids[:, :t + 1]) for every position, (B, T - 1), float32: one forward over
    right-padded sequences (SFT, DPO, distillation). `segments`: packed sequences (see GPT.forward).
    chunk > 0: the head and log-softmax run `chunk` positions at a time, each recomputed in the backward
    (as in completion_logprobs), so no (B, T, V) float32 logits are kept."""
    kw = {"segments": segments[:, :-1]} if segments is not None else {}
    targets = ids[:, 1:]
    chunk = logprob_chunk(chunk, model, targets.size(0), targets.size(1))
    if chunk > 0 and getattr(model, "has_plain_head", True) and hasattr(model, "head"):
        h = model(ids[:, :-1], key_valid=valid[:, :-1], hidden=True, **kw)
        fn = functools.partial(_score, model.head, temperature=1.0, with_entropy=False, entropy_grad=False)
        parts = [checkpoint(lambda a, b: fn(a, b)[0], h[:, i:i + chunk], targets[:, i:i + chunk], use_reentrant=False)
                 if torch.is_grad_enabled() else fn(h[:, i:i + chunk], targets[:, i:i + chunk])[0]
                 for i in range(0, targets.size(1), chunk)]
        return torch.cat(parts, dim=1)
    logits = model(ids[:, :-1], key_valid=valid[:, :-1], **kw).float()
    return -torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                                              reduction="none").view_as(targets)


def summed_logprobs(model, b: dict[str, torch.Tensor], chunk: int | None = 0) -> torch.Tensor:
    """(B,) sum of log p over each row's loss tokens, for a `data.supervised.collate` batch (DPO's
    sequence log-probs; a DPO checkpoint's implicit reward)."""
    return (token_logprobs(model, b["ids"], b["valid"], chunk=chunk) * b["loss"][:, 1:]).sum(-1)
