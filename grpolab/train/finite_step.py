"""An optimizer step that never leaves non-finite weights behind.

A finite loss and gradient can still overflow the weights (a huge learning rate: optim.lr=1e30 turns
every parameter into inf, then NaN), and a checkpoint saved after such a step holds nothing usable.
The trainers check every parameter after each step (`count_nonfinite`: one reduction per tensor). What
follows a bad update depends on `train.undo_nonfinite_updates`: by default the run stops with one line
before any checkpoint holds the weights; with it, `snapshot` keeps a copy of what the step changes (the
optimizer's parameters and its state) and `restore` puts it back, so the step is skipped, as a step with
a non-finite loss is, and counted. That copy costs a pass over the weights and optimizer state every step
(1.8 s per step for 135M parameters on a loaded 2-core machine), hence opt-in. On a GPU it is kept in host
memory (it would otherwise double the optimizer's footprint on the device).
"""

from __future__ import annotations

import torch


def _local(t: torch.Tensor) -> torch.Tensor:
    """A sharded (FSDP2 DTensor) tensor's local shard; a plain tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def params_of(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


def _copy(t: torch.Tensor) -> torch.Tensor:
    t = _local(t).detach()
    return t.to("cpu", copy=True) if t.is_cuda else t.clone()


def snapshot(opt: torch.optim.Optimizer) -> tuple[list[torch.Tensor], dict]:
    """Copies of the optimizer's parameters and of its per-parameter state (tensors copied, numbers kept)."""
    params = [_copy(p) for p in params_of(opt)]
    state = {p: {k: _copy(v) if torch.is_tensor(v) else v for k, v in opt.state[p].items()}
             for p in params_of(opt) if p in opt.state}
    return params, state


@torch.no_grad()
def restore(opt: torch.optim.Optimizer, saved: tuple[list[torch.Tensor], dict]) -> None:
    """Put a `snapshot` back in place (the same tensors: the model and any view of them see it)."""
    params, state = saved
    for p, v in zip(params_of(opt), params):
        _local(p).copy_(v)
    for p in params_of(opt):
        if p not in state:   # no state before the step (its first): none after it either
            opt.state.pop(p, None)
            continue
        for k, v in state[p].items():
            cur = opt.state[p].get(k)
            if torch.is_tensor(v) and torch.is_tensor(cur):
                _local(cur).copy_(v)
            else:
                opt.state[p][k] = v


def overflowed(loss: float, norm: float, lr: float) -> str:
    """How an update that made weights non-finite is described, in the trainers' one-line messages."""
    return f"the update made weights NaN/inf (loss {loss}, gradient norm {norm}, lr {lr:g})"


def count_nonfinite(params) -> int:
    """How many of these tensors (local shards) hold a NaN or inf. Fast path: a NaN or inf anywhere makes the
    float32 sum of all the sums non-finite, so a finite one proves every element finite with one
    reduction per tensor and one sync (a finite sum that overflows only sends it to the exact check)."""
    tensors = [t for t in map(_local, params) if t.numel()]
    sums = [t.sum(dtype=torch.float32).to(tensors[0].device) for t in tensors]
    if not tensors or torch.isfinite(torch.stack(sums).sum()):
        return 0
    return sum(not bool(torch.isfinite(t).all()) for t in tensors)
