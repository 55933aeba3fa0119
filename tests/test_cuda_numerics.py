"""train.cuda_deterministic: CUDA runs get torch's deterministic kernels, CPU runs are left as they are
(the GPU side itself is checked by bench/gpu_check.sh where a GPU is lent)."""

import subprocess
import sys

from conftest import ROOT

PROBE = """
import os, torch
from grpolab.config.load import load_config
from grpolab.determinism import pin_cuda_numerics
from grpolab.jobs.common import setup_torch
setup_torch(load_config(None, ["model.device=cpu"]))
print(torch.are_deterministic_algorithms_enabled(), os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
pin_cuda_numerics()
print(torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
      os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
"""


def test_cpu_runs_keep_the_default_kernels_and_cuda_ones_get_the_deterministic():
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=ROOT,
                       env={"PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    # strict (warn_only False): the warn-only form keeps attention's non-deterministic backward
    assert r.stdout.split("\n")[:2] == ["False None", "True False :4096:8"]


def test_an_op_without_a_deterministic_kernel_is_recognised():
    """Strict mode refuses such an op (they are CUDA ops: none raises on a CPU) with torch's RuntimeError, whose
    text comes from at::Context::alertNotDeterministic; cli.py turns it into one line naming
    train.cuda_deterministic."""
    from grpolab.cli import _no_deterministic_kernel
    text = ("index_reduce_cuda does not have a deterministic implementation, but you set "
            "'torch.use_deterministic_algorithms(True)'. You can turn off determinism just for this operation, or you "
            "can use the 'warn_only=True' option, if that's acceptable for your application.")
    assert _no_deterministic_kernel(RuntimeError(text))
    assert not _no_deterministic_kernel(RuntimeError("CUDA out of memory"))
