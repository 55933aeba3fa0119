"""The wire between a trainer and its rollout workers, on torch.distributed.

Two kinds of process groups, built on one TCPStore that the trainer hosts (neither is torch's default
group: the trainer ranks keep theirs for gradients, and a worker keeps none, so vLLM can make its own):
    commands  trainer (rank 0) -> every worker, by broadcast: the model once, each weight version
              once, each batch's sampling calls, stop. gloo; the weights go over NCCL when they live on GPUs.
    results   one two-member gloo group per worker: its batches back to the trainer (point to point).

A message is a header (int64: kind, batch, version, payload bytes) then the payload: pickled bytes, or
the weight tensors themselves. A peer that dies closes its sockets: the other side's pending call raises
at once, which is how either side notices (rollout/worker_pool.py, rollout/worker_process.py).
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as tdist

MODEL, WEIGHTS, GENERATE, STOP = 1, 2, 3, 4
# A worker waits for the trainer's next command for as long as the trainer's step and eval take, and
# the trainer for a batch as long as its generation takes: no deadline on either; a peer's death
# is noticed by its closed sockets (and process handles) instead.
WAIT = timedelta(days=7)
# ...except a peer that stops without dying (SIGSTOP, a frozen machine): each worker adds one to its store
# counter every BEAT_S seconds, and the trainer names one whose count stops moving (rollout/worker_pool.py)
BEAT_S = 1.0


def beat_key(worker: int) -> str:
    """The store counter of worker `worker`'s heartbeat."""
    return f"heartbeat/{worker}"


def host_store(size: int, timeout_s: float = 120.0) -> tdist.TCPStore:
    """The trainer's store, on a free local port (`.port`); the workers connect with `connect_store`."""
    return tdist.TCPStore("127.0.0.1", 0, size, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def connect_store(host: str, port: int, size: int, timeout_s: float = 120.0) -> tdist.TCPStore:
    return tdist.TCPStore(host, port, size, False, timeout=timedelta(seconds=timeout_s))


def dumps(obj) -> torch.Tensor:
    """`obj` as a uint8 tensor (torch.save: tensors inside stay tensors)."""
    buf = io.BytesIO()
    torch.save(obj, buf, pickle_protocol=pickle.HIGHEST_PROTOCOL)
    return torch.frombuffer(bytearray(buf.getbuffer()), dtype=torch.uint8)


def loads(t: torch.Tensor):
    """`dumps`'s inverse; tensors land on the CPU (the receiver moves them where it keeps them)."""
    return torch.load(io.BytesIO(t.numpy().tobytes()), map_location="cpu", weights_only=False)


@dataclass
class Link:
    """One process's end: rank 0 is the trainer, ranks 1..N the workers."""
    rank: int
    size: int
    commands: tdist.ProcessGroup
    weights: tdist.ProcessGroup       # the command group on CPU; NCCL when the weights are on GPUs
    results: dict[int, tdist.ProcessGroup]   # worker rank -> its group with the trainer (ranks 0 and 1 there)
    weights_device: torch.device

    @classmethod
    def join(cls, store: tdist.Store, rank: int, size: int, device: str = "cpu") -> Link:
        """Build this process's groups on `store` (every process calls this once; it returns when all have)."""
        commands = tdist.ProcessGroupGloo(tdist.PrefixStore("commands", store), rank, size, WAIT)
        dev = torch.device(device)
        weights = commands
        if dev.type == "cuda":   # the trainer's and workers' GPUs: the weights never pass through host memory
            weights = tdist.ProcessGroupNCCL(tdist.PrefixStore("weights", store), rank, size)
        results = {}
        for w in range(1, size):
            if rank in (0, w):
                results[w] = tdist.ProcessGroupGloo(tdist.PrefixStore(f"results/{w}", store), 0 if rank == 0 else 1,
                                                    2, WAIT)
        return cls(rank, size, commands, weights, results, dev)

    # ------------------------------------------------------------ trainer -> workers
    def _broadcast(self, group: tdist.ProcessGroup, t: torch.Tensor) -> None:
        opts = tdist.BroadcastOptions()
        opts.rootRank = 0
        group.broadcast([t], opts).wait()

    def send_command(self, kind: int, batch: int = 0, version: int = 0, payload=None) -> None:
        """Trainer: a command to every worker (payload: any picklable object)."""
        data = dumps(payload) if payload is not None else torch.zeros(0, dtype=torch.uint8)
        self._broadcast(self.commands, torch.tensor([kind, batch, version, data.numel()], dtype=torch.int64))
        if data.numel():
            self._broadcast(self.commands, data)

    def recv_command(self) -> tuple[int, int, int, object]:
        """Worker: the next command as (kind, batch, version, payload or None)."""
        head = torch.zeros(4, dtype=torch.int64)
        self._broadcast(self.commands, head)
        kind, batch, version, n = head.tolist()
        payload = None
        if n:
            data = torch.empty(n, dtype=torch.uint8)
            self._broadcast(self.commands, data)
            payload = loads(data)
        return kind, batch, version, payload

    def broadcast_weights(self, flat: list[torch.Tensor]) -> None:
        """Both sides: the trainer's flat weight buffers into every worker's (same shapes, same order)."""
        for t in flat:
            self._broadcast(self.weights, t)
        if self.weights_device.type == "cuda":
            torch.cuda.synchronize(self.weights_device)

    # ------------------------------------------------------------ workers -> trainer
    def send_result(self, obj) -> None:
        """Worker: one object to the trainer."""
        g = self.results[self.rank]
        data = dumps(obj)
        g.send([torch.tensor([data.numel()], dtype=torch.int64)], 0, 0).wait()
        g.send([data], 0, 1).wait()

    def recv_result(self, worker: int):
        """Trainer: the next object from `worker` (blocks; raises when the worker is gone)."""
        g = self.results[worker]
        n = torch.zeros(1, dtype=torch.int64)
        g.recv([n], 1, 0).wait()
        data = torch.empty(int(n), dtype=torch.uint8)
        g.recv([data], 1, 1).wait()
        return loads(data)


def flat_weights(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors grouped by dtype and device, each group one flat buffer (few broadcasts)."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        groups.setdefault((p.dtype, p.device), []).append(p.detach().reshape(-1))
    return [torch.cat(g) for g in groups.values()]


def flat_like(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Empty buffers shaped as `flat_weights(params)` (what a worker receives a weight version into)."""
    sizes: dict[tuple, int] = {}
    for p in params:
        sizes[(p.dtype, p.device)] = sizes.get((p.dtype, p.device), 0) + p.numel()
    return [torch.empty(n, dtype=dt, device=dev) for (dt, dev), n in sizes.items()]


def unflatten_into(params: list[torch.Tensor], flat: list[torch.Tensor]) -> None:
    """`flat_weights`'s inverse: copy the buffers back into `params` (same order)."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        groups.setdefault((p.dtype, p.device), []).append(p)
    with torch.no_grad():
        for ps, buf in zip(groups.values(), flat):
            offset = 0
            for p in ps:
                p.copy_(buf[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
