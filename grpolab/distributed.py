"""Several processes, one training run: torch.distributed, one process per rank, started by torchrun
(or `grpolab train --nproc N`, which runs torch's own launcher).

What a rank does: it samples and scores its own share of the step's prompts (whole groups), and
everything batch-wide is computed over all ranks: advantages see every reward, loss normalisers
count every token, gradients are summed, metrics are means over the global batch. So an N-rank
step is the 1-process step on the same rollouts, up to float rounding (tests/test_distributed.py).

Backend: gloo on CPU, NCCL on CUDA. Nothing here runs, or imports torch.distributed state, when
the world size is 1.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch

# how long a collective waits for a rank that does not come: long enough for rank 0 to write a large
# checkpoint while the others wait, shorter than torch's 30 minutes. A rank that dies on this machine
# is noticed at once by the launcher, which stops the others.
TIMEOUT_S = 600


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1

    @property
    def main(self) -> bool:
        """Rank 0: the one that writes files, logs and checkpoints."""
        return self.rank == 0


def world_from_env() -> World:
    """The rank layout torchrun exports (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE); 1 process without."""
    env = os.environ
    size = int(env.get("WORLD_SIZE", "1"))
    local_size = int(env.get("LOCAL_WORLD_SIZE", str(size)))
    return World(rank=int(env.get("RANK", "0")), size=size, local_rank=int(env.get("LOCAL_RANK", "0")),
                 local_size=local_size)


def init(device: str = "cpu") -> World:
    """Join the process group when launched with several ranks (gloo on CPU, NCCL on CUDA); the world."""
    w = world_from_env()
    if w.size > 1 and not torch.distributed.is_initialized():
        cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
        if cuda:
            torch.cuda.set_device(w.local_rank)
        # with CUDA: NCCL for the gradients, gloo for the small CPU tensors (counts, rewards, flags)
        torch.distributed.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo",
                                             timeout=timedelta(seconds=TIMEOUT_S))
    return w


def rank_device(device: str, world: World) -> str:
    """model.device for this rank: 'cuda' means cuda:LOCAL_RANK when there are several ranks."""
    if world.size > 1 and device in ("cuda", "auto") and torch.cuda.is_available():
        return f"cuda:{world.local_rank}"
    return device


def active() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized() and \
        torch.distributed.get_world_size() > 1


def sum_all(x: torch.Tensor) -> torch.Tensor:
    """x summed over ranks (in place on a copy); x itself with one rank."""
    if not active():
        return x
    y = x.clone()
    torch.distributed.all_reduce(y)
    return y


def sum_floats(*xs: float) -> list[float]:
    """Python floats summed over ranks, in float64, one collective."""
    if not active():
        return list(xs)
    return sum_all(torch.tensor(xs, dtype=torch.float64)).tolist()


def gather_rows(x: torch.Tensor) -> torch.Tensor:
    """(sum_r N_r, ...) : every rank's x concatenated in rank order (x may differ in length per rank)."""
    if not active():
        return x
    n = torch.tensor([x.size(0)], dtype=torch.long)
    sizes = [torch.zeros_like(n) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(sizes, n)
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros((longest, *x.shape[1:]), dtype=x.dtype)
    padded[:x.size(0)] = x.cpu()
    parts = [torch.zeros_like(padded) for _ in sizes]
    torch.distributed.all_gather(parts, padded)
    return torch.cat([p[:int(s.item())] for p, s in zip(parts, sizes)]).to(x.device)


def gather_objects(obj) -> list:
    """Every rank's picklable `obj`, in rank order."""
    if not active():
        return [obj]
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def unstride(parts: list[list]) -> list:
    """Undo a strided split: parts[r] = items[r::len(parts)] -> items, in their original order."""
    n = sum(len(p) for p in parts)
    return [parts[i % len(parts)][i // len(parts)] for i in range(n)]


def sum_gradients(params) -> None:
    """Each parameter's .grad summed over ranks (the losses are shares of one global loss, so the sum
    is the full-batch gradient). One flat buffer per dtype and device: few collectives."""
    if not active():
        return
    params = [p for p in params if p.requires_grad]
    # a parameter no rank touched keeps grad None (the optimizer skips it, as in one process); one that
    # only some ranks touched gets zeros on the others, so every rank reduces the same buffers
    has = sum_all(torch.tensor([p.grad is not None for p in params], dtype=torch.int32))
    for p, h in zip(params, has.tolist()):
        if h and p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params if p.grad is not None]
    groups: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault((g.dtype, g.device), []).append(g)
    for gs in groups.values():
        flat = torch.cat([g.reshape(-1) for g in gs])
        torch.distributed.all_reduce(flat)
        offset = 0
        for g in gs:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def broadcast_parameters(module: torch.nn.Module) -> None:
    """Rank 0's weights on every rank: all ranks start from the same policy, bit for bit."""
    if not active():
        return
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            torch.distributed.broadcast(t.data, src=0)


def broadcast_object(obj):
    """Rank 0's `obj` on every rank."""
    if not active():
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def check_world(world: World, prompts_per_step: int) -> str | None:
    """What is wrong with running this config on `world` (a config error message), or None."""
    if world.size > 1 and prompts_per_step % world.size:
        return (f"rollout.prompts_per_step: {prompts_per_step} prompts cannot be split evenly over {world.size} "
                f"ranks; give a multiple of {world.size}")
    return None


def barrier() -> None:
    if active():
        torch.distributed.barrier()


def shutdown() -> None:
    """Leave the process group `init` joined (one process joins none: a group there is someone else's,
    e.g. the in-process vLLM engine's, which it tears down itself)."""
    if world_from_env().size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
