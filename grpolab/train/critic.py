"""PPO's critic update: its own AdamW, clipped value loss on the GAE returns, the same micro-batches
and passes as the policy; saved in checkpoints as critic.safetensors + critic_optimizer.pt."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from safetensors.torch import load_model as load_safetensors_model
from safetensors.torch import save_model

from ..algorithms.losses import explained_variance, value_loss
from ..models.checkpoint import load_model, load_plain
from ..models.value_head import Critic


def build_critic(cfg, policy) -> Critic:
    """critic.name_or_path (a checkpoint or HF model dir), else a copy of the starting policy (its
    LoRA adapters, if any, become ordinary trained weights), plus a zero-initialised value head."""
    if cfg.critic.name_or_path:
        backbone, _ = load_model(cfg.critic.name_or_path, dtype=cfg.model.dtype,
                                 device=str(next(policy.parameters()).device))
    else:
        backbone = copy.deepcopy(policy)
    critic = Critic(backbone).to(next(policy.parameters()).device)
    return critic.train().requires_grad_(True)


class CriticTrainer:
    def __init__(self, cfg, policy) -> None:
        c = cfg.critic
        self.cfg = cfg
        self.model = build_critic(cfg, policy)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=c.lr, betas=(cfg.optim.beta1, cfg.optim.beta2))
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda s: min(1.0, (s + 1) / c.warmup_steps) if c.warmup_steps else 1.0)

    def _values(self, g, sl: slice) -> torch.Tensor:
        return self.model(g.prompt_ids[sl], g.prompt_mask[sl], g.completion_ids[sl], g.completion_mask[sl],
                          g.context_mask[sl])

    @torch.no_grad()
    def values(self, g, slices: list[slice]) -> torch.Tensor:
        """The rollout's values (B, C), no autograd."""
        self.model.eval()
        return torch.cat([self._values(g, s) for s in slices])

    def update(self, g, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, slices: list[slice],
               passes: int, agg: dict) -> dict:
        """`passes` optimizer steps on the value loss over the batch; the critic's metrics."""
        c, a = self.cfg.critic, self.cfg.algorithm
        self.model.train()
        loss_sum, clip_sum = 0.0, 0.0
        for _ in range(passes):
            self.opt.zero_grad(set_to_none=True)
            for s in slices:
                v = self._values(g, s)
                loss, clipped = value_loss(v, old_values[s], returns[s], mask[s], cliprange_value=c.cliprange_value,
                                           loss_agg_mode=a.loss_agg_mode, **agg)
                loss.backward()
                loss_sum += float(loss.detach())
                clip_sum += clipped
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), c.max_grad_norm or float("inf"))
            self.opt.step()
        self.sched.step()
        self.model.eval()
        m = mask.bool()
        n = max(float(m.sum()), 1.0)
        return {"critic/value_loss": loss_sum / passes, "critic/vf_clipfrac": clip_sum / passes / n,
                "critic/explained_variance": explained_variance(old_values, returns, mask),
                "critic/values_mean": float(old_values[m].mean()) if m.any() else 0.0,
                "critic/returns_mean": float(returns[m].mean()) if m.any() else 0.0,
                "critic/lr": self.opt.param_groups[0]["lr"]}

    # ------------------------------------------------------------ checkpoints
    def save(self, path: Path) -> None:
        save_model(self.model, str(path / "critic.safetensors"))
        torch.save({"optimizer": self.opt.state_dict(), "scheduler": self.sched.state_dict()},
                   path / "critic_optimizer.pt")

    def load(self, path: Path) -> None:
        load_safetensors_model(self.model, str(path / "critic.safetensors"))
        state = load_plain(path / "critic_optimizer.pt")
        self.opt.load_state_dict(state["optimizer"])
        self.sched.load_state_dict(state["scheduler"])
