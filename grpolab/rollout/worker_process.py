"""A rollout worker: a process of its own that samples the trainer's batches with the weight version
it is told to use (train.async_steps; the trainer side is rollout/worker_pool.py).

    python -m grpolab.rollout.worker_process     (started by the trainer, never by hand)

Two threads. The receiving one takes the trainer's commands as soon as they are sent (so the
trainer's broadcast of a new weight version never waits for a batch in progress) and queues them, a
weight version into a buffer of its own. The main one works through the queue in order: a version
goes into the model, a batch is sampled with the current version and sent back. Commands come in the
order the trainer's logical clock gives them, so the version a batch names is always the current one.

Sampling is keyed (rollout/keys.py): a completion depends on its key and the weights, not on which
worker samples it or beside which rows; the trainer's process gets the same tokens it would have
sampled itself.
"""

from __future__ import annotations

import os
import queue
import signal
import sys
import threading
import time
import traceback
from dataclasses import fields

import torch

from ..determinism import pin_cpu_numerics, pin_cuda_numerics
from ..errors import NonFiniteLogits
from . import link
from .engine import sample
from .vllm_engine import VLLMEngine

WATCH_PARENT_S = 0.5   # how often a worker checks that the trainer still runs


def share(n: int, worker: int, workers: int) -> tuple[int, int]:
    """Worker `worker`'s (0-based) slice of `n` prompts: contiguous, sizes differing by at most one."""
    return n * worker // workers, n * (worker + 1) // workers


def share_of_call(call: dict, worker: int, workers: int) -> dict | None:
    """One sampling call cut to this worker's prompts (and their keys); None when it gets none."""
    lo, hi = share(len(call["prompts"]), worker, workers)
    if lo == hi:
        return None
    out = dict(call, prompts=call["prompts"][lo:hi])
    if call.get("keys") is not None:
        g = call.get("num_generations", 1)
        out["keys"] = call["keys"][lo * g:hi * g]
    return out


class Worker:
    def __init__(self, lk: link.Link, debug: bool) -> None:
        self.link, self.debug = lk, debug
        self.inbox: queue.Queue = queue.Queue()
        self.model = None
        self.engine: VLLMEngine | None = None   # rollout.source=vllm: a vLLM engine in this worker
        self.trained: list[torch.Tensor] = []
        self.version = -1

    def _engine(self, options: dict) -> VLLMEngine:
        """A vLLM engine on the model's config, given the model's weights (the version just received). One
        that cannot start ends the worker with its one line (the trainer then reports the worker's exit)."""
        engine = VLLMEngine(self.model.causal_lm().config, **options)
        engine.load_weights(self.model.merged_weights().items(), self.version)
        return engine

    def receive(self) -> None:
        """Receiving thread: commands into the inbox; a weight version into a buffer of its own."""
        try:
            while True:
                kind, batch, version, payload = self.link.recv_command()
                if kind == link.MODEL:
                    model = payload["model"].to(self.link.weights_device)
                    model.eval()
                    self.trained = [p for p in model.parameters() if p.requires_grad]
                    self.inbox.put(("model", version, (model, payload["vllm"])))
                elif kind == link.WEIGHTS:
                    flat = link.flat_like(self.trained)
                    self.link.broadcast_weights(flat)
                    self.inbox.put(("weights", version, flat))
                elif kind == link.GENERATE:
                    self.inbox.put(("generate", version, (batch, payload)))
                else:
                    self.inbox.put(("stop", version, None))
                    return
        except Exception:   # the trainer is gone: its sockets closed
            os._exit(1)

    def run(self) -> None:
        idle_since = time.perf_counter()
        while True:
            what, version, payload = self.inbox.get()
            if what == "stop":
                if self.engine is not None:
                    self.engine.close()
                return
            if what == "model":
                (self.model, vllm), self.version = payload, version
                if vllm is not None:
                    self.engine = self._engine(vllm)
                continue
            if what == "weights":
                link.unflatten_into(self.trained, payload)
                self.version = version
                if self.engine is not None:   # LoRA merged in on the way (the model itself untouched)
                    self.engine.load_weights(self.model.merged_weights().items(), version)
                continue
            batch, calls = payload
            start = time.perf_counter()
            result = {"batch": batch, "version": self.version, "idle_s": start - idle_since}
            try:
                if version != self.version:   # the trainer's clock and this worker disagree: never sample stale
                    raise RuntimeError(f"batch {batch} asks for weight version {version}, the worker holds "
                                       f"{self.version}")
                w = self.link.rank - 1
                parts = [share_of_call(c, w, self.link.size - 1) for c in calls]
                with torch.inference_mode():
                    gens = [None if c is None else sample(self.model, c.pop("prompts"), engine=self.engine, **c)
                            for c in parts]
                # tensors and plain containers: what the trainer's end of the link loads
                result["gens"] = [None if g is None else {f.name: getattr(g, f.name) for f in fields(g)} for g in gens]
            except NonFiniteLogits:
                result["error"] = "nonfinite"
            except Exception as e:   # noqa: BLE001 - one line to the trainer, which ends the run with it
                if self.debug:
                    traceback.print_exc()
                result["error"] = f"{type(e).__name__}: {e}".splitlines()[0]
            result["generate_s"] = time.perf_counter() - start
            self.link.send_result(result)
            idle_since = time.perf_counter()


def _beat(store, rank: int) -> None:
    """The heartbeat the trainer watches (link.BEAT_S): this process runs. Ends with the trainer's store."""
    try:
        while True:
            store.add(link.beat_key(rank), 1)
            time.sleep(link.BEAT_S)
    except Exception:   # noqa: BLE001 - the trainer is gone; _watch_parent ends this process
        return


def _watch_parent(parent: int) -> None:
    """A worker never outlives its trainer (a SIGKILLed trainer cannot tell it to stop)."""
    while os.getppid() == parent:
        time.sleep(WATCH_PARENT_S)
    os._exit(1)


def main() -> int:
    env = os.environ
    # the trainer decides what Ctrl-C means (finish the step, save with the batches in flight, stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    pin_cpu_numerics(int(env["GRPOLAB_WORKER_THREADS"]))
    device = env.get("GRPOLAB_WORKER_DEVICE", "cpu")
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
        if env.get("GRPOLAB_CUDA_DETERMINISTIC") == "1":   # train.cuda_deterministic, as in the trainer
            pin_cuda_numerics()
    size = int(env["GRPOLAB_WORKERS"]) + 1
    # the heartbeat on a connection of its own: the groups' set-up below waits on the store for every peer
    beats = link.connect_store(int(env["GRPOLAB_LINK_PORT"]), size)
    threading.Thread(target=_beat, args=(beats, int(env["GRPOLAB_WORKER_RANK"])), daemon=True).start()
    store = link.connect_store(int(env["GRPOLAB_LINK_PORT"]), size)
    key = bytes.fromhex(env.pop("GRPOLAB_LINK_KEY"))   # not handed on to what this process starts (vLLM's)
    worker = Worker(link.Link.join(store, int(env["GRPOLAB_WORKER_RANK"]), size, key, device),
                    debug=env.get("GRPOLAB_DEBUG") == "1")
    threading.Thread(target=worker.receive, daemon=True).start()
    worker.run()
    worker.link.send_result(None)   # the trainer's receiving thread ends on it
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as e:   # noqa: BLE001 - e.g. the trainer went away while this worker started
        if os.environ.get("GRPOLAB_DEBUG") == "1":
            raise
        print(f"grpolab: rollout worker {os.environ.get('GRPOLAB_WORKER_RANK')}: {e}".splitlines()[0],
              file=sys.stderr)
        sys.exit(2)
