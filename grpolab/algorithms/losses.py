"""Policy losses on per-token log-probs, each named in config/names.py's POLICY_LOSSES (`algorithm.policy_loss`).

Each loss is a pure function

    fn(logp, old_logp, adv, mask, *, epsilon, epsilon_high, clip_ratio_c, **_)
        -> (loss (B, T), {"clip_low": bool (B, T), "clip_high": bool (B, T)})

with logp, old_logp, mask (B, T) and adv (B, 1) or (B, T). The loss matrix is exactly 0,
with zero gradient and no NaN, at masked positions (whatever logp holds there), so a row
with no active token contributes nothing. r = exp(logp - old_logp) is the per-token
importance ratio; epsilon_high defaults to epsilon. `compute_policy_loss` reduces the
matrix to a scalar with `aggregate` (see aggregate.py).
"""

from __future__ import annotations

import torch

from ..config.names import DISTILL_KL, DPO_LOSSES, POLICY_LOSSES, load
from .aggregate import aggregate


def _prep(logp, old_logp, adv, mask):
    """Bool mask, and logp, log-ratio and advantages zeroed at masked positions (NaN-safe)."""
    m = mask.bool()
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    lp = torch.where(m, logp, zero)
    log_ratio = torch.where(m, logp - old_logp, zero)
    a = torch.where(m, adv.to(logp.dtype), zero)
    return m, lp, log_ratio, a


def _hi(epsilon: float, epsilon_high: float | None) -> float:
    return epsilon if epsilon_high is None else epsilon_high


def clip_loss(logp, old_logp, adv, mask, *, epsilon: float = 0.2, epsilon_high: float | None = None,
              clip_ratio_c: float | None = None, **_) -> tuple[torch.Tensor, dict]:
    """PPO clipped surrogate (Schulman et al. 2017) as used by GRPO (Shao et al. 2024), per token:

        l_t = max(-A * r_t, -A * clip(r_t, 1 - epsilon, 1 + epsilon_high))
    epsilon_high > epsilon is DAPO's clip-higher (Yu et al. 2025). With clip_ratio_c (dual clip,
    Ye et al. 2020), for A < 0: l_t = min(l_t, -A * clip_ratio_c), bounding the loss of a
    negative-advantage token whose ratio has blown up.
    Clip indicators (the clipped branch is active): low = r < 1-eps and A < 0; high = r > 1+eps_hi and A > 0.
    """
    m, _, log_ratio, a = _prep(logp, old_logp, adv, mask)
    eps_hi = _hi(epsilon, epsilon_high)
    ratio = torch.exp(log_ratio)
    loss = torch.maximum(-a * ratio, -a * ratio.clamp(1 - epsilon, 1 + eps_hi))
    if clip_ratio_c is not None:
        loss = torch.where(a < 0, torch.minimum(loss, -a * clip_ratio_c), loss)
    with torch.no_grad():
        low = (ratio < 1 - epsilon) & (a < 0) & m
        high = (ratio > 1 + eps_hi) & (a > 0) & m
    return torch.where(m, loss, torch.zeros_like(loss)), {"clip_low": low, "clip_high": high}


def gspo_loss(logp, old_logp, adv, mask, *, epsilon: float = 0.2, epsilon_high: float | None = None,
              **_) -> tuple[torch.Tensor, dict]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"), token form (GSPO-token):

        s_i   = exp( 1/|y_i| * sum_t (logp_t - old_logp_t) )          sequence ratio, active tokens
        s_i,t = sg(s_i) * exp(logp_t - sg(logp_t))                     value s_i, d s_i,t/d logp_t = s_i
        l_t   = max(-A * s_i,t, -A * clip(s_i,t, 1 - epsilon, 1 + epsilon_high))
    With A_i,t = A_i and seq-mean-token-mean aggregation the gradient equals GSPO's
    -(1/G) sum_i A_i s_i (1/|y_i|) sum_t grad logp_t (when unclipped). The paper clips the
    sequence ratio with tiny ranges, epsilon = 3e-4 and epsilon_high = 4e-4, not PPO's 0.2.
    Clip indicators are per sequence (s_i out of range with the matching sign of A), broadcast to tokens.
    A row with no active token gets s_i = 1 and zero loss. clip_ratio_c is ignored.
    """
    m, lp, log_ratio, a = _prep(logp, old_logp, adv, mask)
    eps_hi = _hi(epsilon, epsilon_high)
    n_tok = m.sum(-1, keepdim=True).clamp(min=1)
    log_s = (log_ratio.sum(-1, keepdim=True) / n_tok).detach()  # (B, 1)
    s_tok = torch.exp(log_s + lp - lp.detach())                 # (B, T), value s_i
    loss = torch.maximum(-a * s_tok, -a * s_tok.clamp(1 - epsilon, 1 + eps_hi))
    with torch.no_grad():
        s = torch.exp(log_s).expand_as(logp)
        low = (s < 1 - epsilon) & (a < 0) & m
        high = (s > 1 + eps_hi) & (a > 0) & m
    return torch.where(m, loss, torch.zeros_like(loss)), {"clip_low": low, "clip_high": high}


def reinforce_loss(logp, old_logp, adv, mask, **_) -> tuple[torch.Tensor, dict]:
    """REINFORCE (Williams 1992), on-policy, no importance ratio (nanochat's chat_rl):

        l_t = -A * logp_t            d l_t / d logp_t = -A
    old_logp and the clip ranges are unused; nothing is ever clipped.
    """
    m, lp, _, a = _prep(logp, old_logp, adv, mask)
    loss = torch.where(m, -a * lp, torch.zeros_like(lp))
    none = torch.zeros_like(m)
    return loss, {"clip_low": none, "clip_high": none.clone()}


def cispo_loss(logp, old_logp, adv, mask, *, epsilon: float = 0.2, epsilon_high: float | None = None,
               **_) -> tuple[torch.Tensor, dict]:
    """CISPO (MiniMax 2025, "MiniMax-M1"): clip the importance-sampling weight, not the update.

        l_t = -sg(clip(r_t, 1 - epsilon, 1 + epsilon_high)) * A * logp_t
    so d l_t / d logp_t = -clip(r_t) * A: every token keeps a gradient, only its weight is bounded.
    (MiniMax-M1 tunes only the upper bound and leaves the lower one effectively off, i.e. a
    large epsilon.) Clip indicators: low = r < 1-eps, high = r > 1+eps_hi, whatever the sign of A.
    """
    m, lp, log_ratio, a = _prep(logp, old_logp, adv, mask)
    eps_hi = _hi(epsilon, epsilon_high)
    ratio = torch.exp(log_ratio).detach()
    loss = torch.where(m, -ratio.clamp(1 - epsilon, 1 + eps_hi) * a * lp, torch.zeros_like(lp))
    low = (ratio < 1 - epsilon) & m
    high = (ratio > 1 + eps_hi) & m
    return loss, {"clip_low": low, "clip_high": high}


def compute_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                        mask: torch.Tensor, *, policy_loss: str = "clip",
                        loss_agg_mode: str = "token-mean", epsilon: float = 0.2,
                        epsilon_high: float | None = None, clip_ratio_c: float | None = None,
                        max_new_tokens: int | None = None, global_tokens: float | None = None,
                        global_seqs: float | None = None,
                        weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """Scalar policy loss and metrics.

    logp, old_logp, mask: (B, T); advantages: (B,) or (B, T). global_tokens/global_seqs
    are the normalizers of the whole batch when this call sees only a micro-batch.
    Metrics are sums over this call's active tokens (`clip_ratio/*_sum`) so the caller
    can add them up across micro-batches and divide by the global token count. `weights` (B, T)
    multiply the per-token losses before aggregation (rollout correction's importance weights).
    """
    fn = load(POLICY_LOSSES, policy_loss, "algorithm.policy_loss")
    adv = advantages if advantages.dim() == 2 else advantages[:, None]
    loss_mat, info = fn(logp, old_logp, adv.to(logp.dtype), mask, epsilon=epsilon,
                        epsilon_high=epsilon_high, clip_ratio_c=clip_ratio_c)
    if weights is not None:
        loss_mat = loss_mat * weights.to(loss_mat.dtype)
    loss = aggregate(loss_mat, mask, loss_agg_mode, global_tokens=global_tokens,
                     global_seqs=global_seqs, max_new_tokens=max_new_tokens)
    m = mask.bool()
    low, high = info["clip_low"] & m, info["clip_high"] & m
    metrics = {"clip_ratio/low_sum": float(low.sum()), "clip_ratio/high_sum": float(high.sum()),
               "clip_ratio/region_sum": float((low | high).sum())}
    return loss, metrics


# ---------------------------------------------------------------------------- preference (DPO family)

def dpo_loss(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, ref_chosen_logps: torch.Tensor,
             ref_rejected_logps: torch.Tensor, *, beta: float, loss_type: str = "sigmoid",
             label_smoothing: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Direct preference losses on (B,) summed completion log-probs; returns (per-pair losses,
    chosen rewards, rejected rewards), the rewards being the implicit ones, beta * (logp - ref_logp),
    detached (as TRL logs them).

    With h = (chosen - ref_chosen) - (rejected - ref_rejected) and eps = label_smoothing:
        sigmoid  -(1 - eps) log s(beta h) - eps log s(-beta h)        DPO (Rafailov et al. 2023);
                 eps > 0 is conservative DPO (labels flipped with probability eps)
        robust   (-(1 - eps) log s(beta h) + eps log s(-beta h)) / (1 - 2 eps)
                 unbiased under label noise eps (Chowdhury et al. 2024), eps in [0, 0.5)
        hinge    max(0, 1 - beta h)                                    SLiC (Zhao et al. 2023)
        ipo      (h - 1 / (2 beta))^2                                  IPO (Azar et al. 2023); TRL feeds it
                 log-probs averaged over each completion's tokens, and so does the DPO trainer here
    """
    h = (chosen_logps - ref_chosen_logps) - (rejected_logps - ref_rejected_logps)
    logsig = torch.nn.functional.logsigmoid
    if loss_type == "sigmoid":
        losses = -(1 - label_smoothing) * logsig(beta * h) - label_smoothing * logsig(-beta * h)
    elif loss_type == "robust":
        if not 0 <= label_smoothing < 0.5:
            raise ValueError(f"robust DPO needs label_smoothing in [0, 0.5), got {label_smoothing}")
        losses = (-(1 - label_smoothing) * logsig(beta * h) + label_smoothing * logsig(-beta * h)) \
            / (1 - 2 * label_smoothing)
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * h)
    elif loss_type == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown DPO loss_type {loss_type!r}; known: {', '.join(DPO_LOSSES)}")
    chosen_rewards = beta * (chosen_logps - ref_chosen_logps).detach()
    rejected_rewards = beta * (rejected_logps - ref_rejected_logps).detach()
    return losses, chosen_rewards, rejected_rewards


# ---------------------------------------------------------------------------- reward models

def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | float = 0.0,
                       center_coef: float = 0.0) -> torch.Tensor:
    """Per-pair reward-model loss on (B,) scalar scores of the chosen and rejected completions:

        -log s(r_chosen - r_rejected - margin) + center_coef * (r_chosen + r_rejected)^2

    The Bradley-Terry likelihood of the preference (Ouyang et al. 2022, InstructGPT's reward model);
    `margin` (per pair or one number) asks for a gap of at least that much (Llama 2's margin loss,
    Touvron et al. 2023); the centering term pulls the scores' mean toward zero (Eisenstein et al.
    2023), so a reward model's outputs stay on one scale across runs. TRL's RewardTrainer's formula.
    """
    losses = -torch.nn.functional.logsigmoid(chosen - rejected - margin)
    if center_coef:
        losses = losses + center_coef * (chosen + rejected) ** 2
    return losses


# ---------------------------------------------------------------------------- distillation

def distill_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, *, direction: str = "forward",
               temperature: float = 1.0) -> torch.Tensor:
    """Per-position KL between teacher and student next-token distributions (..., V) -> (...),
    both softened by `temperature` and scaled by temperature^2 (Hinton et al. 2015: keeps the
    gradient's size as the temperature changes). In float32.

        forward  KL(p_teacher || p_student) = sum_v p_t(v) (log p_t(v) - log p_s(v))   (mean-seeking;
                 classic logit distillation)
        reverse  KL(p_student || p_teacher) = sum_v p_s(v) (log p_s(v) - log p_t(v))   (mode-seeking; MiniLLM,
                 GKD; on-policy distillation scores the student's own tokens with it)
    """
    s = (student_logits.float() / temperature).log_softmax(-1)
    t = (teacher_logits.float() / temperature).log_softmax(-1)
    if direction == "forward":
        kl = (t.exp() * (t - s)).sum(-1)
    elif direction == "reverse":
        kl = (s.exp() * (s - t)).sum(-1)
    else:
        raise ValueError(f"unknown distillation direction {direction!r}; known: {', '.join(DISTILL_KL)}")
    return kl * temperature ** 2


# ---------------------------------------------------------------------------- critic

def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, *,
               cliprange_value: float, loss_agg_mode: str = "token-mean", **agg) -> tuple[torch.Tensor, float]:
    """PPO's clipped value loss (as in OpenAI's baselines, verl, TRL), per token:

        v_clip = old_V + clip(V - old_V, -cliprange_value, cliprange_value)
        l_t    = 0.5 * max((V - R)^2, (v_clip - R)^2)
    aggregated like the policy losses (`aggregate`, `agg`: global counts of a micro-batch's batch).
    Returns (loss, clipfrac sum: active tokens where the clipped error is the larger one)."""
    m = mask.bool()
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    v = torch.where(m, values, zero)
    r = torch.where(m, returns.to(values.dtype), zero)
    old = torch.where(m, old_values.to(values.dtype), zero)
    clipped = old + (v - old).clamp(-cliprange_value, cliprange_value)
    err, err_clip = (v - r) ** 2, (clipped - r) ** 2
    loss_mat = 0.5 * torch.maximum(err, err_clip)
    clipfrac = float(((err_clip > err) & m).sum())
    return aggregate(loss_mat, mask, loss_agg_mode, **agg), clipfrac


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(returns - values) / Var(returns) over the active tokens (1: the critic explains the
    returns; 0: no better than their mean; NaN when the returns do not vary)."""
    m = mask.bool()
    r, v = returns.double()[m], values.double()[m]
    var = r.var(unbiased=False) if r.numel() else torch.tensor(0.0)
    return float(1 - (r - v).var(unbiased=False) / var) if var > 0 else float("nan")
