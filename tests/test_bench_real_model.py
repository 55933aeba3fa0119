"""The pieces the real-model benches (bench/race.py, step.py, rollout.py --model) rely on for a fair
comparison: forced RL-like completion lengths that both samplers obey exactly, and the peak-RSS reading
that covers training steps only. Timings themselves live in bench/, never here."""

import copy
import sys

import pytest
import torch
from conftest import ROOT

from grpolab.models.hf import load_hf
from grpolab.models.lora import add_lora
from grpolab.models.tiny_hf import save_tiny_model
from grpolab.rollout.engine import generate

sys.path.insert(0, str(ROOT / "bench"))
import _smollm2
import rollout


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    save_tiny_model(d, vocab_size=256, hidden=64, layers=2, heads=2, intermediate=128)
    return load_hf(str(d))


def test_rl_like_lengths_are_seeded_skewed_and_reach_the_cap():
    a, b = rollout.rl_lengths(64, 40), rollout.rl_lengths(64, 40)
    assert torch.equal(a, b)
    assert int(a.min()) >= 16 and int(a.max()) == 40 and int((a == 40).sum()) >= 1
    # 16 + 24 u^3 with u uniform: most rows are short (the median of u^3 is 1/8: about 19 tokens)
    assert float(a.float().median()) < 16 + 24 * 0.5


@pytest.mark.parametrize("lora", [False, True])
def test_both_samplers_stop_exactly_at_the_forced_lengths(tiny, lora):
    """m_ours and m_hf assert the forced lengths themselves; this checks they hold on prompts of different
    lengths (left padding for HF) and with LoRA adapters (ours then runs the model's own forward)."""
    policy, tok = tiny
    if lora:
        policy = copy.deepcopy(policy)
        add_lora(policy, {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"]})
        policy.hf.eval()
    prompts = [tok.render_prompt("1 + 2 ="), tok.render_prompt("a longer prompt: 3 plus 4 minus 1 is")]
    assert len(prompts[0]) != len(prompts[1])
    lengths = rollout.rl_lengths(2 * 3, 24)
    eos = tok.eos_id
    rollout.m_ours(policy, prompts, 3, 24, eos, tok.pad_id, seed=1, lengths=lengths)
    rollout.m_hf(policy.hf, prompts, 3, 24, eos, tok.pad_id, seed=1, lengths=lengths)
    wrong = lengths.clone()
    wrong[0] += 1
    _check(policy, prompts, eos, tok.pad_id, lengths, lengths)
    with pytest.raises(AssertionError):   # the comparison can fail
        _check(policy, prompts, eos, tok.pad_id, lengths, wrong)


def _check(policy, prompts, eos, pad, forced, claimed):
    """Sample with `forced` lengths, then compare against `claimed`, as m_ours does."""
    out = generate(policy, prompts, num_generations=3, max_new_tokens=24, temperature=1.0, stop_ids=(eos,),
                   pad_id=pad, generator=torch.Generator().manual_seed(1),
                   logits_hook=lambda lg, t, rows: rollout.force_lengths(lg, t, rows, forced, eos))
    assert torch.equal(out.completion_mask.sum(-1), claimed)


def test_peak_rss_resets_and_then_sees_a_new_allocation():
    if not _smollm2.reset_peak_rss():
        pytest.skip("this kernel does not allow resetting VmHWM")
    before = _smollm2.peak_rss_mib()
    x = torch.ones(64 * 1024 * 1024 // 4 * 3)   # 192 MiB, written (resident)
    grown = _smollm2.peak_rss_mib()
    del x
    assert grown - before > 150
    assert _smollm2.reset_peak_rss() and _smollm2.peak_rss_mib() < grown - 150
