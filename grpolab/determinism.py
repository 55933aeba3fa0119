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

`pin_cpu_numerics` fixes both. What is guaranteed: the same config and seed on the same machine
type, with the same torch/MKL build and thread count, give the same bits, idle or busy. What is
not: a different CPU (another instruction set takes other kernels), another torch build, or another
`train.threads` (a product split differently sums in another order).
"""

from __future__ import annotations

import os

# Read by MKL at its first call, so it is set when grpolab is imported (grpolab/__init__.py);
# a value the user exported wins.
MKL_ENV = {"MKL_CBWR": "AUTO", "MKL_DYNAMIC": "FALSE", "OMP_DYNAMIC": "FALSE"}


def set_reproducible_env() -> None:
    """Set MKL/OpenMP reproducibility variables unless the user set them (before any MKL call)."""
    for k, v in MKL_ENV.items():
        os.environ.setdefault(k, v)


def pin_cpu_numerics(threads: int = 0) -> int:
    """Fix the CPU thread count (0 = torch's default, all cores) and turn MKL's dynamic
    threading off; returns the thread count in use. Call before the first computation."""
    import torch   # here, so that importing grpolab (and `grpolab --help`) stays instant

    # the MKL variables are already set: grpolab/__init__.py runs before this module can be imported
    n = threads or torch.get_num_threads()
    # set_num_threads also calls mkl_set_num_threads and mkl_set_dynamic(0): every MKL product
    # then uses exactly n threads, whatever else the machine runs.
    torch.set_num_threads(n)
    return n
