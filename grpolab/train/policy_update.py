"""The policy update of one RL step: algorithm.num_iterations (mu) optimizer passes over the rollout batch,
each accumulating the clipped-ratio loss (+ beta * KL with the KL in the loss, - entropy bonus) over the
micro-batches, then one optimizer step. The loss is one loss over the global batch: each rank's share is
aggregated with the global token and sequence counts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from .. import distributed as dist
from .. import sharding
from ..algorithms.aggregate import aggregate
from ..algorithms.kl import kl_penalty
from ..algorithms.losses import compute_policy_loss
from ..algorithms.rollout_correction import rollout_correction
from ..config.schema import AlgorithmConfig
from ..monitor.console import StepProgress
from ..rollout.batch import RolloutBatch
from .logprob_passes import LogProbPasses
from .plan import Plan


class Optimizing(Protocol):
    """The trainer shell's optimizer side (train/base.py)."""
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    master: object

    def apply_update(self, loss: float, norm: float) -> bool: ...


CLIP = ("low", "high", "region")                     # clip_ratio/<k>_mean
MISMATCH = ("logprob_abs_diff", "masked", "ratio")   # rollout/<k>: sampler vs trainer log-probs


@dataclass
class _Sums:
    """Running sums over a step's passes and micro-batches (token sums, divided by the token count at the end)."""
    loss: float = 0.0
    kl: float = 0.0
    entropy: float = 0.0
    clip: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CLIP, 0.0))
    rollout: dict[str, float] = field(default_factory=lambda: dict.fromkeys(MISMATCH, 0.0))
    ratio_max: float = 0.0


def loss_mask(batch: RolloutBatch, a: AlgorithmConfig) -> torch.Tensor:
    """The tokens the loss reads: completions cut at max_new_tokens can be left out (mask_truncated_completions)."""
    g = batch.gen
    return g.completion_mask & ~g.truncated[:, None] if a.mask_truncated_completions else g.completion_mask


def aggregation(batch: RolloutBatch, a: AlgorithmConfig, max_new_tokens: int) -> dict:
    """The global batch's counts the loss aggregates with: each rank's loss is its share of one loss over
    every rank's tokens."""
    mask = loss_mask(batch, a).float()
    n_tok, n_seq = dist.sum_floats(float(mask.sum()), float((mask.sum(-1) > 0).sum()))
    return dict(global_tokens=n_tok, global_seqs=n_seq, max_new_tokens=max_new_tokens)


def update(model, batch: RolloutBatch, plan: Plan, a: AlgorithmConfig, lp: LogProbPasses, optimizer: Optimizing,
           max_grad_norm: float, ref_lp: torch.Tensor | None, progress: StepProgress, max_new_tokens: int) -> dict:
    """mu optimizer passes over the batch; returns loss/KL/clip/entropy/rollout-mismatch metrics."""
    g = batch.gen
    adv = batch.advantages.to(next(model.parameters()).device)
    mask = loss_mask(batch, a)
    agg = aggregation(batch, a, max_new_tokens)
    slices, extra = lp.micro_batches(len(batch))
    # old-policy log-probs in a no-grad pass; with mu == 1 the old policy is the current one, so the ratio
    # is exactly 1 and the old log-probs are the detached logp
    old_lp = None
    if a.num_iterations > 1:
        model.eval()
        old_lp = lp.frozen(model, g)
    model.train()
    progress.start_phase("update", len(batch) * a.num_iterations)
    lr = optimizer.opt.param_groups[0]["lr"]   # the rate this step's updates use (logged before the scheduler moves)
    sums, grad_norms, applied = _Sums(), [], 0
    for it in range(a.num_iterations):
        optimizer.opt.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)   # (the same tensors, unless master weights are in use)
        for s in slices:
            loss = _micro_batch_loss(model, batch, s, plan, a, lp, adv, mask, old_lp, ref_lp, agg, sums, it == 0)
            loss.backward()
            progress.add(rows=s.stop - s.start, tokens=int(mask[s].sum()))
            sums.loss += float(loss.detach())
        for _ in range(extra):   # stand-ins: a backward (FSDP's gradient reduction) that adds zero
            (lp(model, g, slice(0, 1)).sum() * 0.0).backward()
        norm = _gradient_norm(model, optimizer, plan.sharded, max_grad_norm)
        grad_norms.append(norm)
        # decided on the global loss and weights, so that every rank skips or applies the same steps
        if not optimizer.apply_update(sums.loss, norm):   # skipped or undone: no further passes
            break
        applied += 1
    if applied:   # a skipped step leaves the schedule where it was: the next step gets this step's lr
        optimizer.sched.step()
    model.eval()
    return _metrics(sums, plan, a, lr, grad_norms, agg["global_tokens"])


def _micro_batch_loss(model, batch: RolloutBatch, s: slice, plan: Plan, a: AlgorithmConfig, lp: LogProbPasses,
                      adv: torch.Tensor, mask: torch.Tensor, old_lp: torch.Tensor | None,
                      ref_lp: torch.Tensor | None, agg: dict, sums: _Sums, first_pass: bool) -> torch.Tensor:
    """One micro-batch's share of the loss; its sums added to `sums` (the rollout mismatch on the first pass)."""
    g = batch.gen
    logp, ent = lp(model, g, s, with_entropy=True, entropy_grad=a.entropy_coef > 0)
    m = mask[s]
    old = old_lp[s] if old_lp is not None else logp.detach()
    # sampler vs trainer probabilities of the same tokens: logged always, corrected on request
    w, m_pg, rc = rollout_correction(old, g.sampler_logprobs[s], m, mode=plan.correction,
                                     level=a.rollout_correction_level, threshold=a.rollout_correction_threshold)
    if first_pass:
        for k in sums.rollout:
            sums.rollout[k] += rc.get(f"rollout/{k}_sum", 0.0)
        sums.ratio_max = max(sums.ratio_max, rc["rollout/ratio_max"])
    loss, cm = compute_policy_loss(logp, old, adv[s], m_pg, policy_loss=a.policy_loss, loss_agg_mode=a.loss_agg_mode,
                                   epsilon=a.epsilon, epsilon_high=a.epsilon_high, clip_ratio_c=a.clip_ratio_c,
                                   weights=w if plan.correction == "tis" else None, **agg)
    if plan.kl_in_loss:
        kl = kl_penalty(logp, ref_lp[s], a.kl_estimator)
        loss = loss + a.beta * aggregate(kl, m, a.loss_agg_mode, **agg)
        sums.kl += float((kl.detach() * m).sum())
    if a.entropy_coef:
        loss = loss - a.entropy_coef * aggregate(ent, m, a.loss_agg_mode, **agg)
    sums.entropy += float((ent.detach() * m).sum())
    for k in sums.clip:
        sums.clip[k] += cm[f"clip_ratio/{k}_sum"]
    return loss


def _gradient_norm(model, optimizer: Optimizing, sharded: bool, max_grad_norm: float) -> float:
    """The full batch's gradient on every rank, clipped; its norm before clipping."""
    if not sharded:   # (fsdp sums each micro-batch's gradient into the shards as it goes)
        dist.sum_gradients(model.parameters())
    if optimizer.master:
        optimizer.master.grads_in()
    clipped = optimizer.master.master if optimizer.master else model.parameters()
    return sharding.grad_norm(torch.nn.utils.clip_grad_norm_(clipped, max_grad_norm or float("inf")))


def _metrics(sums: _Sums, plan: Plan, a: AlgorithmConfig, lr: float, grad_norms: list[float], n_tok: float) -> dict:
    """The step's update metrics, over all ranks."""
    names = ["loss", "kl", "entropy", *(f"clip/{k}" for k in sums.clip), *(f"rollout/{k}" for k in sums.rollout)]
    values = [sums.loss, sums.kl, sums.entropy, *sums.clip.values(), *sums.rollout.values()]
    total = dict(zip(names, dist.sum_floats(*values)))   # over all ranks (as is, in one process)
    passes, tokens = a.num_iterations, max(n_tok, 1)
    out = {"lr": lr, "loss": total["loss"] / passes, "grad_norm": sum(grad_norms) / len(grad_norms),
           "entropy": total["entropy"] / passes / tokens}
    if plan.kl_in_loss:
        out["kl"] = total["kl"] / passes / tokens
    for k in sums.clip:
        out[f"clip_ratio/{k}_mean"] = total[f"clip/{k}"] / passes / tokens
    out["rollout/logprob_abs_diff"] = total["rollout/logprob_abs_diff"] / tokens
    out["rollout/ratio_mean"] = total["rollout/ratio"] / tokens
    out["rollout/ratio_max"] = float(dist.gather_rows(torch.tensor([sums.ratio_max])).max())
    if plan.correction == "mis":
        out["rollout/masked_ratio"] = total["rollout/masked"] / tokens
    return out
