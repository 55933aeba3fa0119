import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
GSM8K_DIR = ROOT.parent / "shared" / "data" / "gsm8k"

torch.set_num_threads(2)


@pytest.fixture
def tok():
    from grpolab.models import CharTokenizer
    return CharTokenizer()


@pytest.fixture
def tiny_gpt(tok):
    from grpolab.models import GPT, GPTConfig
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=2, n_head=2, n_embd=32, block_size=96)).eval()


def run_cli(*args, cwd=None, timeout=600):
    """Run the real `grpolab` entry point in a subprocess."""
    import subprocess
    return subprocess.run([sys.executable, "-m", "grpolab.cli", *args], capture_output=True, text=True,
                          cwd=cwd or ROOT, timeout=timeout)
