"""float32 master weights for a model trained in bfloat16/float16 (model.dtype): the optimizer
steps float32 copies of the trained parameters and its state is float32, and the model gets the
copies rounded to its dtype after each step. Without them, an update smaller than the weight's
rounding step (bfloat16 keeps 8 bits: a relative 0.4%) would be lost every step."""

from __future__ import annotations

import torch


class MasterWeights:
    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params
        self.master = [p.detach().float().clone() for p in params]

    @staticmethod
    def needed(params: list[torch.nn.Parameter]) -> bool:
        return any(p.dtype in (torch.bfloat16, torch.float16) for p in params)

    def grads_in(self) -> None:
        """The model's gradients, as float32, onto the master copies (the optimizer's parameters)."""
        for m, p in zip(self.master, self.params):
            m.grad = None if p.grad is None else p.grad.float()

    @torch.no_grad()
    def weights_out(self) -> None:
        """The stepped master copies into the model, rounded to its dtype."""
        for m, p in zip(self.master, self.params):
            p.copy_(m)

    @torch.no_grad()
    def load(self, tensors: list[torch.Tensor]) -> None:
        """Master copies saved in a checkpoint (the model's own weights are their rounding)."""
        for m, t in zip(self.master, tensors, strict=True):
            m.copy_(t)
