"""`grpolab serve --kernel-cache N`: the server bounds PyTorch's caches of compiled CPU matrix-product
kernels before its model loads, so a process serving many batch shapes stops growing. Measured in a fresh
Python process (the caches read their sizes once per process): its resident memory while a prepacked linear
layer runs at 200 row counts, after `load_engine` has loaded a tiny Llama with room for all 200 kernels
(PyTorch's own 1,024) and with 4."""

import subprocess
import sys

import pytest
import torch

from grpolab.models.tiny_hf import save_tiny_model

PROGRAM = """
import sys
import torch
from grpolab.models.lean_decode import _Linear
from grpolab.serve.model_loader import load_engine

def rss_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024

torch.set_num_threads(1)
batcher, _, _ = load_engine(sys.argv[1], kernel_cache=int(sys.argv[2]))
assert batcher.decoder is not None
lin = _Linear(torch.randn(64, 32), None)
assert lin.packed
for m in range(1, 21):   # the allocator's own growth, before counting
    lin(torch.randn(m, 32))
before = rss_mib()
for m in range(21, 221):   # one kernel per row count in each cache
    lin(torch.randn(m, 32))
print(rss_mib() - before)
"""


@pytest.mark.skipif(not torch.backends.mkldnn.is_available() or not sys.platform.startswith("linux"),
                    reason="oneDNN's caches, read through /proc")
def test_the_server_bounds_the_kernel_caches_before_its_model_loads(tmp_path):
    model = save_tiny_model(tmp_path / "llama", ["one two three four"], vocab_size=64, hidden=32, layers=1,
                            heads=4, intermediate=64, max_positions=64)

    def growth(setting: str) -> float:
        r = subprocess.run([sys.executable, "-c", PROGRAM, str(model), setting], capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        return float(r.stdout.split()[-1])
    unbounded, bounded = growth("1024"), growth("4")
    # 1,024 keep all 200 kernels (~0.3 MiB each, in two caches): ~107 MiB here; 4 kept each stays near flat
    assert unbounded > 40, (unbounded, bounded)
    assert bounded < 12, (unbounded, bounded)
