"""Bit-identical CPU results whatever the machine's load.

Two things in the CPU math libraries let the same program compute different floats on a busy
machine than on an idle one, even with the same seed:

* MKL's dynamic threading (MKL_DYNAMIC, on by default): MKL picks how many threads each matrix
  multiply uses at call time. A product split across a different number of threads sums its
  partial results in a different order. torch turns it off only when `torch.set_num_threads` is
  called, which `grpolab` used to do only when `train.threads` was set.
* MKL's run-to-run freedom (no Conditional Numerical Reproducibility): without `MKL_CBWR`, MKL may
  pick code paths by memory alignment and schedule work between threads dynamically. `MKL_CBWR=AUTO`
  keeps the fastest code path for this CPU and makes it reproducible from run to run.

`pin_cpu_numerics` fixes both. On CUDA, `pin_cuda_numerics` asks torch for its deterministic kernels:
without them the demo's two runs on an H200 differed from the first step (an embedding's backward adds
its rows' gradients with atomics, in whatever order the threads arrive); docs/determinism.md has what
was measured (bench/gpu.py).

What is guaranteed: the same config and seed on the same machine
type, with the same torch/MKL build and thread count, give the same bits, idle or busy. What is
not: a different CPU (another instruction set takes other kernels), another torch build, or another
`train.threads` (a product split differently sums in another order).

Speed on a shared machine: torch's CPU build runs its parallel regions (and MKL's, through MKL's GNU
threading layer) on GNU OpenMP (libgomp; `torch.__config__.parallel_info()`). By default a libgomp
worker that finishes its part spin-waits for the next region (GOMP_SPINCOUNT, 300,000 spins) instead
of sleeping. On an idle machine that saves a wake-up; when another process wants the cores, the
spinning workers take the CPU time the thread doing the real work needs, and every region waits for
a descheduled spinner: `grpolab sft` at train.threads=0 ran 3-13x slower than at train.threads=1 and
burned ~4x the CPU. `OMP_WAIT_POLICY=PASSIVE` makes idle workers sleep at once (libgomp's spin count
0), which costs an idle machine a wake-up per region: the Python API's SmolLM2 example ran 15-40 % slower
per step than with the default. `GOMP_SPINCOUNT=3000` (with the passive policy: GOMP_SPINCOUNT wins in
libgomp) lets a worker spin for about 30 us, long enough to catch the next region of a step's back-to-back
operations; beside a CPU burner that spin still cost the same example 25-40 % per step against none. No one
spin count is best for both, so importing grpolab looks at the machine for 30 ms (/proc/stat): when other
processes keep half a core or more busy, workers sleep at once (GOMP_SPINCOUNT=0), else they spin 3000 times
(bench/api_import_order.py; docs/python-api.md has the numbers). The choice holds for the process's life (the
runtime reads it once). `KMP_BLOCKTIME=0` is the passive policy for builds on Intel's OpenMP (libiomp5). How
threads wait changes no arithmetic: the bits are the same (tests/test_threads.py; bench/threads.py
measures the speed).
"""

from __future__ import annotations

import os
import sys
import time

# Read by MKL at its first call, so it is set when grpolab is imported (grpolab/__init__.py);
# a value the user exported wins.
MKL_ENV = {"MKL_CBWR": "AUTO", "MKL_DYNAMIC": "FALSE", "OMP_DYNAMIC": "FALSE"}
# Read by the OpenMP runtime once, when it is loaded (with torch): grpolab/__init__.py sets them
# before anything imports torch. When the user exported any of them, none is set: their choice wins
# (OMP_WAIT_POLICY=ACTIVE brings the spinning back, e.g. for a dedicated machine).
OPENMP_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "3000", "KMP_BLOCKTIME": "0"}
# how long importing grpolab samples the machine's load, and from how many cores kept busy by other processes on
# idle workers sleep at once instead of spinning
BUSY_PROBE_S = 0.03
BUSY_CORES = 0.5


# Whether torch (and with it the OpenMP runtime) was loaded before grpolab, with none of OPENMP_ENV exported: the
# runtime then keeps its defaults for the life of the process, and the Python API runs its jobs in a child process
# that starts with grpolab's settings (api/child.py).
OPENMP_MISSED = False


def busy_cores(interval: float = BUSY_PROBE_S) -> float | None:
    """How many cores other processes kept busy over `interval` seconds, from /proc/stat's counters (user to
    steal) less this process's own (its other threads'; the caller sleeps meanwhile), in the same clock ticks;
    None where they cannot be read."""
    def counters() -> tuple[int, int]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
        with open("/proc/self/stat") as f:   # utime and stime, after the command name (which may hold spaces)
            own = f.read().rpartition(")")[2].split()
        return sum(v) - v[3] - v[4] - int(own[11]) - int(own[12]), sum(v)   # busy elsewhere, all

    try:
        busy0, all0 = counters()
        time.sleep(interval)
        busy1, all1 = counters()
    except (OSError, ValueError, IndexError):
        return None
    return max(busy1 - busy0, 0) / max(all1 - all0, 1) * (os.cpu_count() or 1)


def openmp_env(busy: float | None) -> dict[str, str]:
    """The wait settings for a machine whose other processes keep `busy` cores busy (None: unknown): no spin on
    a busy machine, a short one on an idle one."""
    if busy is not None and busy >= BUSY_CORES:
        return {**OPENMP_ENV, "GOMP_SPINCOUNT": "0"}
    return dict(OPENMP_ENV)


def set_reproducible_env() -> None:
    """Set the MKL/OpenMP reproducibility and wait-policy variables unless the user set them
    (before torch is imported: the OpenMP runtime reads them when it is loaded)."""
    global OPENMP_MISSED
    users = any(k in os.environ for k in OPENMP_ENV)
    OPENMP_MISSED = "torch" in sys.modules and not users
    for k, v in {**MKL_ENV, **({} if users else openmp_env(busy_cores()))}.items():
        os.environ.setdefault(k, v)


def pin_cuda_numerics() -> None:
    """CUDA's deterministic kernels: `torch.use_deterministic_algorithms` in its strict form, and cuBLAS's
    fixed workspace (CUBLAS_WORKSPACE_CONFIG, read when cuBLAS starts, so set before the first product; a
    value the user exported wins). Strict, because in the warn-only form torch keeps the non-deterministic
    backward of flash and memory-efficient attention (it only warns), which made two bf16 runs of a
    SmolLM2-shaped model differ; strict, they take their deterministic algorithms, and an op that has
    none raises instead of running (jobs turn that into one line naming train.cuda_deterministic)."""
    import torch

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)


def pin_cpu_numerics(threads: int = 0) -> int:
    """Fix the CPU thread count (0 = torch's default, all cores) and turn MKL's dynamic
    threading off; returns the thread count in use. Call before the first computation."""
    import torch  # here, so that importing grpolab (and `grpolab --help`) stays instant

    # the MKL variables are already set: grpolab/__init__.py runs before this module can be imported
    n = threads or torch.get_num_threads()
    # set_num_threads also calls mkl_set_num_threads and mkl_set_dynamic(0): every MKL product
    # then uses exactly n threads, whatever else the machine runs.
    torch.set_num_threads(n)
    return n
