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
    assert r.stdout.split("\n")[:2] == ["False None", "True True :4096:8"]
