"""The wire between a trainer and its rollout workers, on torch.distributed.

Two kinds of process groups, built on one TCPStore that the trainer hosts (neither is torch's default
group: the trainer ranks keep theirs for gradients, and a worker keeps none, so vLLM can make its own):
    commands  trainer (rank 0) -> every worker, by broadcast: the model once, each weight version
              once, each batch's sampling calls, stop. gloo; the weights go over NCCL when they live on GPUs.
    results   one two-member gloo group per worker: its batches back to the trainer (point to point).

A message is a header (int64: kind, batch, version, payload bytes) then the payload: sealed bytes, or
the weight tensors themselves. A peer that dies closes its sockets: the other side's pending call raises
at once, which is how either side notices (rollout/worker_pool.py, rollout/worker_process.py).

The wire is the run's alone. The workers are always this machine's children, so every socket of it listens
on loopback only: the store on a socket bound here (torch's TCPStore binds every interface when given a
port), the gloo groups on a loopback device (not where the hostname or GLOO_SOCKET_IFNAME points). Loopback
is still shared with the machine's other users, so a payload is sealed with the run's key (a random one the
trainer hands its workers in their environment, never over a socket): a message without it is refused
unread. A command or result is then loaded as tensors and plain containers only (torch.load
weights_only=True); the model, once, as the whole module it is (its classes: LoRA, the dtype), which is
why it is read only under the key.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import secrets
import socket
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


LOOPBACK = "127.0.0.1"
TAG = 32                       # bytes of a payload's seal (HMAC-SHA256), ahead of the payload
GLOO_THREADS = 2               # what ProcessGroupGloo(store, rank, size, timeout) gives its one device


class LinkError(RuntimeError):
    """A payload the run's peers did not send (its seal does not match the run's key)."""


def new_key() -> bytes:
    """A run's key: 32 random bytes."""
    return secrets.token_bytes(32)


def host_store(size: int, timeout_s: float = 120.0) -> tdist.TCPStore:
    """The trainer's store, on a free loopback port (`.port`); the workers connect with `connect_store`.
    Handed a port, TCPStore listens on every interface, so it gets a socket already bound to loopback."""
    sock = socket.create_server((LOOPBACK, 0), backlog=128)
    port = sock.getsockname()[1]
    # the store owns the socket from here (and closes it)
    return tdist.TCPStore(LOOPBACK, port, size, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False,
                          master_listen_fd=sock.detach())


def connect_store(port: int, size: int, timeout_s: float = 120.0) -> tdist.TCPStore:
    return tdist.TCPStore(LOOPBACK, port, size, False, timeout=timedelta(seconds=timeout_s))


def gloo_group(store: tdist.Store, rank: int, size: int) -> tdist.ProcessGroupGloo:
    """A gloo group whose sockets listen on loopback (its default device listens where the hostname resolves,
    or on GLOO_SOCKET_IFNAME: any interface)."""
    opts = tdist.ProcessGroupGloo._Options()
    opts._devices = [tdist.ProcessGroupGloo.create_device(hostname=LOOPBACK)]
    opts._timeout = WAIT
    opts._threads = GLOO_THREADS
    return tdist.ProcessGroupGloo(store, rank, size, opts)


def _tag(key: bytes, data) -> bytes:
    return hmac.new(key, data, hashlib.sha256).digest()


def seal(obj, key: bytes) -> torch.Tensor:
    """`obj` as a uint8 tensor (torch.save: tensors inside stay tensors), its HMAC under `key` ahead of it."""
    buf = io.BytesIO()
    buf.write(bytes(TAG))
    torch.save(obj, buf)
    view = buf.getbuffer()
    view[:TAG] = _tag(key, view[TAG:])
    return torch.frombuffer(bytearray(view), dtype=torch.uint8)


def unseal(t: torch.Tensor, key: bytes, code: bool = False):
    """`seal`'s inverse; tensors land on the CPU (the receiver moves them where it keeps them). Refused unread
    (LinkError) unless sealed with `key`; loaded as tensors and plain containers only unless `code` (the model)."""
    data = t.numpy().tobytes()
    if len(data) < TAG or not hmac.compare_digest(data[:TAG], _tag(key, memoryview(data)[TAG:])):
        raise LinkError("a message on the rollout workers' link is not sealed with this run's key; refused unread")
    return torch.load(io.BytesIO(memoryview(data)[TAG:]), map_location="cpu", weights_only=not code)


@dataclass
class Link:
    """One process's end: rank 0 is the trainer, ranks 1..N the workers."""
    rank: int
    size: int
    commands: tdist.ProcessGroup
    weights: tdist.ProcessGroup       # the command group on CPU; NCCL when the weights are on GPUs
    results: dict[int, tdist.ProcessGroup]   # worker rank -> its group with the trainer (ranks 0 and 1 there)
    weights_device: torch.device
    key: bytes                        # the run's: every payload is sealed with it

    @classmethod
    def join(cls, store: tdist.Store, rank: int, size: int, key: bytes, device: str = "cpu") -> Link:
        """Build this process's groups on `store` (every process calls this once; it returns when all have)."""
        commands = gloo_group(tdist.PrefixStore("commands", store), rank, size)
        dev = torch.device(device)
        weights = commands
        if dev.type == "cuda":   # the trainer's and workers' GPUs: the weights never pass through host memory
            weights = tdist.ProcessGroupNCCL(tdist.PrefixStore("weights", store), rank, size)
        results = {}
        for w in range(1, size):
            if rank in (0, w):
                results[w] = gloo_group(tdist.PrefixStore(f"results/{w}", store), 0 if rank == 0 else 1, 2)
        return cls(rank, size, commands, weights, results, dev, key)

    # ------------------------------------------------------------ trainer -> workers
    def _broadcast(self, group: tdist.ProcessGroup, t: torch.Tensor) -> None:
        opts = tdist.BroadcastOptions()
        opts.rootRank = 0
        group.broadcast([t], opts).wait()

    def send_command(self, kind: int, batch: int = 0, version: int = 0, payload=None) -> None:
        """Trainer: a command to every worker (payload: tensors and plain containers; the model's: any
        picklable object)."""
        data = seal(payload, self.key) if payload is not None else torch.zeros(0, dtype=torch.uint8)
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
            payload = unseal(data, self.key, code=kind == MODEL)
        return kind, batch, version, payload

    def broadcast_weights(self, flat: list[torch.Tensor]) -> None:
        """Both sides: the trainer's flat weight buffers into every worker's (same shapes, same order)."""
        for t in flat:
            self._broadcast(self.weights, t)
        if self.weights_device.type == "cuda":
            torch.cuda.synchronize(self.weights_device)

    # ------------------------------------------------------------ workers -> trainer
    def send_result(self, obj) -> None:
        """Worker: one object (tensors and plain containers) to the trainer."""
        g = self.results[self.rank]
        data = seal(obj, self.key)
        g.send([torch.tensor([data.numel()], dtype=torch.int64)], 0, 0).wait()
        g.send([data], 0, 1).wait()

    def recv_result(self, worker: int):
        """Trainer: the next object from `worker` (blocks; raises when the worker is gone)."""
        g = self.results[worker]
        n = torch.zeros(1, dtype=torch.int64)
        g.recv([n], 1, 0).wait()
        data = torch.empty(int(n), dtype=torch.uint8)
        g.recv([data], 1, 1).wait()
        return unseal(data, self.key)


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
