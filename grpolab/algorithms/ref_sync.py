"""Reference-model refresh (TR-DPO, Gorbatovski et al. 2024, "Learn Your Reference Model for Real Good Alignment")."""

from __future__ import annotations

import torch


@torch.no_grad()
def ref_sync(ref_model: torch.nn.Module, policy_model: torch.nn.Module, alpha: float) -> None:
    """Soft update of the reference towards the policy, in place, for every parameter:

        theta_ref <- alpha * theta_policy + (1 - alpha) * theta_ref
    alpha = 1 copies the policy (TR-DPO's hard update); alpha in (0, 1) is the soft update.
    Parameters are matched by name; the two models must have the same parameter names and shapes.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"ref_sync alpha must be in [0, 1], got {alpha}")
    policy = dict(policy_model.named_parameters())
    ref = dict(ref_model.named_parameters())
    if policy.keys() != ref.keys():
        raise ValueError("ref_sync: reference and policy models have different parameters")
    for name, p_ref in ref.items():
        p = policy[name]
        if p.shape != p_ref.shape:
            raise ValueError(f"ref_sync: {name} is {tuple(p.shape)} in the policy, {tuple(p_ref.shape)} in the ref")
        p_ref.lerp_(p.to(device=p_ref.device, dtype=p_ref.dtype), alpha)
