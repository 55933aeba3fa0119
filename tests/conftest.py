import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

# The suite runs one test at a time on cores of its own, where libgomp's default spin-wait is fastest: grpolab's
# shared-machine setting (determinism.OPENMP_ENV) made the in-process tests ~25 % slower. So this process keeps
# libgomp's default, exported before grpolab is imported (an exported value wins, and grpolab then counts torch as
# loaded with its settings: the Python API runs in-process), and drops it once torch has loaded the runtime, so
# the CLIs the tests start get grpolab's settings, as users' runs do. A value the caller exported is kept.
OPENMP_KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
SUITE_SPIN = not any(k in os.environ for k in OPENMP_KEYS)
if SUITE_SPIN:
    os.environ["GOMP_SPINCOUNT"] = "300000"   # libgomp's own default
# isort: off
import grpolab  # noqa: E402  (before torch: the OpenMP runtime reads its settings when torch loads it)
# isort: on
import pytest  # noqa: E402
import torch  # noqa: E402

from grpolab.models.logprobs import token_logprobs  # noqa: E402
from grpolab.serve.batcher import Batcher, Job  # noqa: E402

assert set(OPENMP_KEYS) == set(grpolab.determinism.OPENMP_ENV)
if SUITE_SPIN:
    del os.environ["GOMP_SPINCOUNT"]

ROOT = Path(__file__).resolve().parents[1]
GSM8K_DIR = ROOT.parent / "shared" / "data" / "gsm8k"

torch.set_num_threads(2)
# tests never read or write the user's warm-start cache (~/.cache): a reused entry would skip the warm start a
# test measures; tests of the cache name their own directory
os.environ.setdefault("GRPOLAB_WARM_START_CACHE", "0")
# a suite started in the background by a non-interactive shell inherits SIGINT ignored, and so would every
# CLI it runs (an ignored signal stays ignored across exec): the Ctrl-C tests would test nothing
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# tests/with_vllm needs vLLM, which lives in its own venv (`make test-vllm`, part of `make test`)
HAS_VLLM = getattr(importlib.util.find_spec("vllm"), "origin", None) is not None   # (not a namespace folder)
collect_ignore = [] if HAS_VLLM else ["with_vllm"]


@pytest.fixture
def tok():
    from grpolab.models import CharTokenizer
    return CharTokenizer()


@pytest.fixture
def tiny_gpt(tok):
    from grpolab.models import GPT, GPTConfig
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=2, n_head=2, n_embd=32, block_size=96)).eval()


def overfit(model, batch: dict, steps: int, lr: float = 1e-2):
    """Train `model` on a collated SFT batch (grpolab.data.supervised.collate: its loss mask leaves tool
    outputs out, as SFT does) with AdamW for `steps` steps, until it writes the completions greedily;
    returns it in eval mode."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        logp = token_logprobs(model, batch["ids"], batch["valid"])
        loss = -(logp * batch["loss"][:, 1:]).sum() / batch["loss"][:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def wait_for_rows(metrics: Path, n: int, proc=None, timeout: float = 300, poll: float = 0.02) -> None:
    """Wait until a run's metrics.jsonl holds at least `n` rows (or `proc`, when given, has exited, or
    `timeout` seconds have passed): the moment a test interrupts a run part-way."""
    deadline = time.time() + timeout
    while time.time() < deadline and (proc is None or proc.poll() is None):
        if metrics.exists() and len(metrics.read_text().splitlines()) >= n:
            return
        time.sleep(poll)


def run_cli(*args, cwd=None, timeout=600):
    """Run the real `grpolab` entry point in a subprocess."""
    import subprocess
    return subprocess.run([sys.executable, "-m", "grpolab.cli", *args], capture_output=True, text=True,
                          cwd=cwd or ROOT, timeout=timeout)


# GSM8K-format rows written by the tests themselves, so GSM8K coverage never depends on the
# shared files: (question, worked answer with <<calculator>> notes ending '#### N', the loader's
# canonical answer). Thousands separators, negative and decimal answers included.
GSM8K_SAMPLE = {
    "test": [
        ("A baker makes 24 muffins every morning. She sells 3 boxes of 6 muffins and gives 2 muffins to "
         "a neighbor. How many muffins are left?",
         "She sells 3 * 6 = <<3*6=18>>18 muffins.\nShe gives away 2 more, so 18 + 2 = <<18+2=20>>20 muffins "
         "are gone.\nThat leaves 24 - 20 = <<24-20=4>>4 muffins.\n#### 4", "4"),
        ("A town of 12,500 people grows by 8% in one year. How many people live there after the year?",
         "The town gains 12,500 * 0.08 = <<12500*0.08=1000>>1,000 people.\nSo it has 12,500 + 1,000 = "
         "<<12500+1000=13500>>13,500 people.\n#### 13,500", "13500"),
        ("The temperature at dawn was 5 degrees. It fell 3 degrees every hour for 4 hours. What was the "
         "temperature then?",
         "It fell 3 * 4 = <<3*4=12>>12 degrees in all.\nSo it was 5 - 12 = <<5-12=-7>>-7 degrees.\n#### -7", "-7"),
        ("Tom buys 3 pens at $1.50 each. How much does he spend in dollars?",
         "The pens cost 3 * 1.50 = $<<3*1.5=4.5>>4.50 in all.\n#### 4.5", "4.5"),
        ("A club's account held $2,000 and then paid $3,250 in bills. What is the balance in dollars?",
         "The balance is 2,000 - 3,250 = $<<2000-3250=-1250>>-1,250.\n#### -1,250", "-1250"),
        ("A farmer plants 1,200 rows of corn with 45 plants in each row. How many plants are there?",
         "There are 1,200 * 45 = <<1200*45=54000>>54,000 plants.\n#### 54000", "54000"),
        ("Maria reads 15 pages a day for 2 weeks. How many pages does she read?",
         "Two weeks is 2 * 7 = <<2*7=14>>14 days.\nShe reads 15 * 14 = <<15*14=210>>210 pages.\n#### 210", "210"),
        ("A factory makes 1,250,000 bolts a year and ships 3/5 of them abroad. How many bolts does it ship "
         "abroad?",
         "It ships 1,250,000 * 3/5 = <<1250000*3/5=750000>>750,000 bolts abroad.\n#### 750,000", "750000"),
    ],
    "train": [
        ("Janet has 3 dozen eggs. She uses 7 of them for a cake. How many eggs are left?",
         "3 dozen is 3 * 12 = <<3*12=36>>36 eggs.\nShe has 36 - 7 = <<36-7=29>>29 eggs left.\n#### 29", "29"),
        ("A shop's profit was -$450 in January and $1,325 in February. What was its total profit in "
         "dollars?",
         "The total is -450 + 1,325 = $<<-450+1325=875>>875.\n#### 875", "875"),
        ("Sam drives at 65 miles per hour for 3.5 hours. How many miles does he drive?",
         "He drives 65 * 3.5 = <<65*3.5=227.5>>227.5 miles.\n#### 227.5", "227.5"),
        ("A submarine is at -120 meters. It rises 45 meters. At what depth is it now, in meters?",
         "It is now at -120 + 45 = <<-120+45=-75>>-75 meters.\n#### -75", "-75"),
        ("A stadium seats 42,000 people and sells out 3 games. How many tickets are sold?",
         "It sells 42,000 * 3 = <<42000*3=126000>>126,000 tickets.\n#### 126,000", "126000"),
    ],
}


@pytest.fixture
def gsm8k_dir(tmp_path):
    """A directory with GSM8K-format train.jsonl and test.jsonl ({'question', 'answer'}) from GSM8K_SAMPLE."""
    import json
    path = tmp_path / "gsm8k"
    path.mkdir()
    for split, rows in GSM8K_SAMPLE.items():
        lines = [json.dumps({"question": q, "answer": a}) for q, a, _ in rows]
        (path / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    return path


def penalized(prompt: list[int], out: list[int], logits: list[float], presence: float, frequency: float,
              repetition: float) -> list[float]:
    """vLLM's penalties written out token by token, the tests' independent check of
    rollout/logits_processors.penalize: CTRL's repetition penalty over the tokens of the prompt and the
    output, then OpenAI's frequency and presence penalties over the output."""
    res = []
    for i, v in enumerate(logits):
        n = out.count(i)
        if n or i in prompt:
            v = v / repetition if v > 0 else v * repetition
        res.append(v - frequency * n - presence * (n > 0))
    return res


def randomize_lora_b(model, seed: int, scale: float) -> None:
    """Random LoRA B matrices on an HFPolicy with peft adapters, in eval mode (peft starts B at zero,
    which would make a missing adapter invisible to a test)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.hf.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    model.hf.eval()



def staggered(model, tok, prompts, params, max_batch, decoder=None, context=512, prefix_cache=None):
    """The server's batcher with one job submitted per step (rows join a running batch), run to the end;
    each job's choices' tokens (job i is draw i)."""
    b = Batcher(model, tok, max_batch=max_batch, context=context, decoder=decoder, prefix_cache=prefix_cache)
    jobs = [Job(p, params, draw=i) for i, p in enumerate(prompts)]
    for j in jobs:
        b.submit(j)
        b.step()
    while not b.idle():
        b.step()
    return [[c.tokens for c in j.choices] for j in jobs]

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    """Until `url`/health answers; AssertionError with the server's output if it exits first."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise AssertionError(f"server exited: {proc.stdout.read()[-3000:]}")
        try:
            urllib.request.urlopen(url + "/health", timeout=1)
            return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"server not ready after {timeout:.0f} s")


@contextlib.contextmanager
def running_server(model, *args, log=None):
    """`grpolab serve MODEL` in a subprocess on a free port; stopped by its pid (SIGINT) at the end."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "grpolab", "serve", str(model), "--port", str(port),
                             "--log-level", "warning", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, 120)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                raise
