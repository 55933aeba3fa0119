"""bfloat16 sampling and log-probs against float32 on the same tiny Llama: close to float32, really
computed in bfloat16, and with the log-softmax taken in float32 (bfloat16 keeps only 8 bits)."""

import pytest
import torch

from grpolab.data.tasks import arithmetic
from grpolab.models.hf import load_hf
from grpolab.models.logprobs import completion_logprobs
from grpolab.models.tiny_hf import save_tiny_model
from grpolab.rollout.engine import generate

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    rows = arithmetic.generate("train", 300, seed=0)
    path = save_tiny_model(tmp_path_factory.mktemp("bf16") / "llama", [r["prompt"] + "\n" + r["answer"] for r in rows],
                           vocab_size=300, hidden=64, layers=2, heads=4, intermediate=128)
    f32, tok = load_hf(str(path))
    b16, _ = load_hf(str(path), dtype="bfloat16")
    with torch.no_grad():   # a sharper (tied) head than random init gives: log-probs around -1, not -5.7
        for m in (f32, b16):
            m.hf.lm_head.weight.mul_(6.0)
    return f32, b16, tok


def _logprobs(model, g):
    return completion_logprobs(model, g.prompt_ids, g.prompt_mask, g.completion_ids, g.completion_mask)


def _bf16_representable(x: torch.Tensor) -> float:
    """Share of values that survive a round trip through bfloat16: ~1.0 if they were computed in it."""
    return float((x.bfloat16().float() == x).float().mean())


def test_bf16_sampling_and_logprobs_track_float32(pair):
    f32, b16, tok = pair
    assert next(b16.parameters()).dtype == torch.bfloat16
    prompts = [tok.render_prompt(p) for p in ["Mia has 7 shells.", "Leo has 12 coins, loses 3, finds 4 more."]]
    g = generate(b16, prompts, num_generations=4, max_new_tokens=12, temperature=1.0, stop_ids=(),
                 pad_id=tok.pad_id, generator=torch.Generator().manual_seed(0))
    m = g.completion_mask
    assert m.all()
    lp16, lp32 = _logprobs(b16, g), _logprobs(f32, g)
    for lp in (g.sampler_logprobs, lp16):
        assert lp.dtype == torch.float32
        # taken in float32 from bfloat16 logits: almost never a bfloat16 number itself
        assert _bf16_representable(lp[m]) < 0.2
    diff = (lp16 - lp32).abs()
    assert 0 < diff.mean() < 0.01 and diff.max() < 0.05   # bfloat16 really ran, and stays close
    # the sampler (KV cache, lean decode) and the trainer (one forward) agree in bfloat16 too
    assert (g.sampler_logprobs - lp16).abs().max() < 0.05
    # a greedy continuation mostly picks the same tokens in both dtypes
    gg16 = generate(b16, prompts, max_new_tokens=12, temperature=0.0, stop_ids=(), pad_id=tok.pad_id)
    gg32 = generate(f32, prompts, max_new_tokens=12, temperature=0.0, stop_ids=(), pad_id=tok.pad_id)
    assert (gg16.completion_ids[:, :4] == gg32.completion_ids[:, :4]).float().mean() >= 0.75


def test_the_representability_check_catches_a_bf16_log_softmax(pair):
    """What the first test guards against: log-softmax in bfloat16 gives bfloat16 numbers."""
    _, b16, tok = pair
    ids = torch.tensor([tok.render_prompt("Mia has 7 shells and finds 5.")])
    with torch.no_grad():
        logits = b16(ids)
    assert logits.dtype == torch.bfloat16
    assert _bf16_representable(logits.log_softmax(-1).float()) == 1.0
    assert _bf16_representable(logits.float().log_softmax(-1)) < 0.2
