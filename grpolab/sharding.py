"""train.strategy: fsdp. FSDP2 (`torch.distributed.fsdp.fully_shard`) over the ranks: each rank
keeps 1/N of every parameter, gradient and optimizer state; a block's full weights exist only
while it runs.

- Sharding: every transformer block is its own unit, then the root (embeddings, final norm,
  head; tied weights stay together in the root).
- Gradients are summed over ranks, not averaged: each rank's loss is already its share of one
  global loss (train/grpo.py), so the sum is the full batch's gradient, as with `ddp`.
- Sampling: ranks decode different numbers of tokens (they stop when their own completions
  stop), so per-block all-gathers would not line up. `full_weights` gathers the whole policy
  once for a rollout or an evaluation and frees it after.
- Every forward and backward outside `full_weights` is a collective: all ranks must run the same
  number of micro-batches (the trainer pads with empty ones).
- Checkpoints are gathered to full tensors on rank 0 and written as ordinary files, so a run
  written by N ranks resumes on 1 and the other way round.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
from torch import nn

from .models.blocks import blocks

# torch warns (on every rank, every step) when an FSDP unit returns a view: an in-place op on that
# view (`out += y`) would skip the unit's pre-backward hook and give wrong gradients. The built-in
# GPT's Block returns `addmm(...).view(B, T, C)` (the residual add fused into the matmul); every
# consumer of it (the next Block, GPT.forward's slice and final norm, activation checkpointing) is
# out of place, so the hook stays and the gradients are one process's (tests/test_distributed.py::
# test_fsdp_on_the_builtin_gpt_equals_one_process). A clone would cost a copy per block for nothing.
# Only this class is silenced: a Hugging Face layer that returns a view still warns.
BLOCK_VIEW_WARNING = r"FSDP2-wrapped module \(FSDPBlock\) returned a view tensor"


def shard(model: nn.Module, frozen: bool = False) -> nn.Module:
    """fully_shard each block, then the root, in place (the module keeps its identity and API).
    `frozen` (the reference): the root's weights are freed after each forward too, as there is no
    backward to keep them for."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard
    # the mesh on the model's device type (a CUDA machine can still train on CPU)
    mesh = init_device_mesh(next(model.parameters()).device.type, (torch.distributed.get_world_size(),))
    warnings.filterwarnings("ignore", message=BLOCK_VIEW_WARNING, category=UserWarning)
    for b in blocks(model):
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            # sum over ranks (the losses are shares of one loss), with plain SUM collectives: gloo
            # has no pre-multiplied reduction
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
    if frozen:
        model.set_reshard_after_forward(True)
    return model


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule
    return isinstance(model, FSDPModule)


def _units(model: nn.Module) -> list:
    from torch.distributed.fsdp import FSDPModule
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def full_weights(model: nn.Module):
    """Within: every parameter gathered (plain tensors), no collective per forward, so each rank
    can run as many forwards as it needs (decoding). A no-op for a model that is not sharded."""
    if not is_sharded(model):
        yield model
        return
    units = _units(model)
    model.set_reshard_after_forward(False)
    for u in units:
        u.unshard()
    try:
        yield model
    finally:
        for u in units:
            u.reshard()
        model.set_reshard_after_forward(True)
        model.set_reshard_after_forward(False, recurse=False)   # the root's default: kept for backward


def grad_norm(norm: torch.Tensor) -> float:
    """clip_grad_norm_'s result as a float (a replicated DTensor for sharded gradients)."""
    from torch.distributed.tensor import DTensor
    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)


_FULL = dict(full_state_dict=True, cpu_offload=True)


def _aliases(model: nn.Module) -> dict[str, str]:
    """Tied parameters: second name -> first name (e.g. lm_head.weight -> embed_tokens.weight)."""
    first: dict[int, str] = {}
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out[name] = first[id(p)]
        else:
            first[id(p)] = name
    return out


def full_state_dict(model: nn.Module, tied: bool = True) -> dict[str, torch.Tensor]:
    """The full weights on rank 0 (CPU), {} on the other ranks; every rank must call it. Without
    `tied`, a tied parameter appears once, under its first name (as safetensors' save_model writes it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    sd = get_model_state_dict(model, options=StateDictOptions(**_FULL))
    if not tied:
        for alias in _aliases(model):
            sd.pop(alias, None)
    return sd


def load_full_state_dict(model: nn.Module, sd: dict[str, torch.Tensor]) -> None:
    """Full weights (the same on every rank) into a sharded model: each rank keeps its shard. Tied
    parameters may be given under either name."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    sd = dict(sd)
    for alias, name in _aliases(model).items():
        if alias in sd and name not in sd:
            sd[name] = sd[alias]
        sd.setdefault(alias, sd.get(name))
    set_model_state_dict(model, sd, options=StateDictOptions(full_state_dict=True))


def _param_names(model: nn.Module) -> list[str]:
    """Parameter names in `model.parameters()` order: the index of a parameter in torch's own
    optimizer state dicts (one param group built from model.parameters())."""
    return [n for n, _ in model.named_parameters()]


def full_optimizer_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """The optimizer state gathered to rank 0 in torch's ordinary layout (`opt.state_dict()` of the
    same optimizer in one process: states keyed by parameter index); {} on the other ranks."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(**_FULL))
    if not osd:
        return {}
    index = {n: i for i, n in enumerate(_param_names(model))}
    return {"state": {index[n]: s for n, s in osd["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in osd["param_groups"]]}


def load_optimizer_state(model: nn.Module, opt: torch.optim.Optimizer, state: dict) -> None:
    """torch's ordinary optimizer state dict (from one process or `full_optimizer_state`, the same
    on every rank) into the optimizer of a sharded model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    names = _param_names(model)
    osd = {"state": {names[i]: s for i, s in state["state"].items()},
           "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]}
    set_optimizer_state_dict(model, opt, osd, options=StateDictOptions(full_state_dict=True))
