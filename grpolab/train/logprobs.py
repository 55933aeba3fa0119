"""Per-token log-probs of completion tokens, recomputed from the sampled token ids."""

from __future__ import annotations

import torch

from ..utils.padding import pad_to_width


def completion_logprobs(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                        completion_ids: torch.Tensor, completion_mask: torch.Tensor,
                        temperature: float = 1.0, with_entropy: bool = False, entropy_grad: bool = False):
    """log softmax(logits / T) of each completion token, (B, C); 0 at masked positions.

    One forward over [left-padded prompt | completion]; the logits at position j predict
    token j+1, so completion token t is scored by the logits at P - 1 + t. With
    with_entropy, also returns the per-token entropy of that distribution (differentiable only
    with entropy_grad, for an entropy bonus).
    """
    # Drop columns that are padding in every row (prompts are left-padded, completions right-padded),
    # so a micro-batch of short sequences costs what its own lengths cost. Positions come from the
    # mask (HF) or are relative (RoPE), so the result does not change.
    C_full = completion_ids.size(1)
    real_p = prompt_mask.any(0).nonzero()
    real_c = completion_mask.any(0).nonzero()
    first = int(real_p[0]) if len(real_p) else prompt_ids.size(1) - 1
    last = int(real_c[-1]) + 1 if len(real_c) else 1
    prompt_ids, prompt_mask = prompt_ids[:, first:], prompt_mask[:, first:]
    completion_ids, completion_mask = completion_ids[:, :last], completion_mask[:, :last]
    ids = torch.cat([prompt_ids, completion_ids], dim=1)
    valid = torch.cat([prompt_mask, completion_mask], dim=1)
    C = completion_ids.size(1)
    # the last C positions of ids[:, :-1] are P-1 .. P+C-2: exactly the ones that predict the completion
    logits = model(ids[:, :-1], key_valid=valid[:, :-1], logits_to_keep=C).float()
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = logits.log_softmax(-1)
    logp = logp_all.gather(-1, completion_ids[..., None]).squeeze(-1)
    logp = pad_to_width(logp * completion_mask, C_full, 0.0)
    if not with_entropy:
        return logp
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, pad_to_width(entropy, C_full, 0.0)
