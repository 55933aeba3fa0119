"""The slotted decode (rollout/slot_decode.py): on a CPU it runs eagerly, and must sample what the eager
engine (rollout/decode_loop.py) samples; a row's completion must not depend on its batch; the Triton attention
kernel must compute the reference's attention. The CUDA-graph cases run where a GPU is (bench/gpu.py
runs the same checks at real model shapes)."""

import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT

from grpolab.models import GPT, GPTConfig
from grpolab.models.decode_attention import reference
from grpolab.models.hf import HFPolicy
from grpolab.rollout import slot_decode
from grpolab.rollout.decode_loop import Penalties
from grpolab.rollout.engine import generate
from grpolab.rollout.keys import completion_keys


def _prompts(tok):
    return [tok.render_prompt(p) for p in ("Mia has 7 shells.", "Sum 1+2?", "Ok", "Tom buys 3 pens and 2 more.")]


def _keys(n_prompts, G, seed=0):
    return completion_keys(seed, torch.arange(n_prompts).repeat_interleave(G), torch.arange(G).repeat(n_prompts))


def _gqa_llama(vocab):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=96, num_hidden_layers=2, num_attention_heads=6,
                      num_key_value_heads=2, intermediate_size=128, max_position_embeddings=512,
                      tie_word_embeddings=True)
    torch.manual_seed(1)
    return HFPolicy(LlamaForCausalLM(cfg).eval())


@pytest.fixture(params=["gpt", "gqa_llama"])
def policy(request, tiny_gpt, tok):
    return tiny_gpt if request.param == "gpt" else _gqa_llama(tok.vocab_size)


def _rows(g):
    """Each row's kept tokens and their log-probs."""
    return [(ids[m].tolist(), lp[m]) for ids, lp, m in zip(g.completion_ids, g.sampler_logprobs, g.completion_mask)]


def _same(a, b) -> bool:
    """Two `_rows` lists: the same tokens and the same log-prob bits, row for row."""
    return len(a) == len(b) and all(x[0] == y[0] and torch.equal(x[1], y[1]) for x, y in zip(a, b))


def test_samples_what_the_eager_engine_samples(policy, tok):
    G = 4
    kw = dict(num_generations=G, max_new_tokens=24, stop_ids=(tok.eos_id,), pad_id=tok.pad_id)
    for temperature, keys in ((1.0, _keys(4, G)), (0.7, _keys(4, G, 3)), (0.0, None)):
        eager = generate(policy, _prompts(tok), temperature=temperature, keys=keys, slots=False, **kw)
        slots = generate(policy, _prompts(tok), temperature=temperature, keys=keys, slots=True, **kw)
        assert torch.equal(slots.completion_mask.sum(-1), eager.completion_mask.sum(-1))
        assert torch.equal(slots.truncated, eager.truncated)
        assert torch.equal(slots.prompt_ids, eager.prompt_ids) and torch.equal(slots.prompt_mask, eager.prompt_mask)
        for (a, la), (b, lb) in zip(_rows(slots), _rows(eager)):
            assert a == b
            torch.testing.assert_close(la, lb, atol=1e-5, rtol=1e-5)
        assert not slots.truncated.all() or temperature == 0.0


def test_a_rows_completion_does_not_depend_on_its_batch(policy, tok):
    G = 4
    prompts, keys = _prompts(tok), _keys(4, G)
    kw = dict(max_new_tokens=24, temperature=1.0, stop_ids=(tok.eos_id,), pad_id=tok.pad_id, slots=True)
    full = _rows(generate(policy, prompts, num_generations=G, keys=keys, **kw))
    for r in (0, 6, 15):   # alone: a batch of one row, another prompt length, another cache width
        alone = _rows(generate(policy, [prompts[r // G]], num_generations=1, keys=keys[r:r + 1], **kw))[0]
        assert alone[0] == full[r][0] and torch.equal(alone[1], full[r][1])
    pair = _rows(generate(policy, prompts[2:4], num_generations=G, keys=keys[2 * G:], **kw))
    for i, (ids, lp) in enumerate(pair):
        assert ids == full[2 * G + i][0] and torch.equal(lp, full[2 * G + i][1])


def test_rows_leave_through_smaller_buckets_with_their_own_budgets(tiny_gpt, tok):
    # 36 rows in slots of 8 rows per product: buckets 40, 32, ..., 8 as rows finish at their budgets
    prompts, G = _prompts(tok) * 3, 3
    budgets = torch.tensor([1 + (7 * i) % 23 for i in range(len(prompts) * G)])
    keys = _keys(len(prompts), G)
    kw = dict(num_generations=G, max_new_tokens=24, temperature=1.0, stop_ids=(), pad_id=tok.pad_id, keys=keys)
    got = slot_decode.generate(tiny_gpt, prompts, top_k=0, top_p=1.0, budgets=budgets, graphs=False,
                               rows_per_matmul=8, **kw)
    assert torch.equal(got.completion_mask.sum(-1), budgets)
    assert got.truncated.all()
    want = generate(tiny_gpt, prompts, budgets=budgets, slots=False, **kw)
    for (a, la), (b, lb) in zip(_rows(got), _rows(want)):
        assert a == b
        torch.testing.assert_close(la, lb, atol=1e-5, rtol=1e-5)


def test_rows_on_fewer_slots_are_admitted_as_others_finish_with_the_same_completions(tiny_gpt, tok):
    """36 rows on 8 slots (two groups of 3 at a time): each finished row's slot takes the next waiting group, and
    every row's tokens and log-prob bits equal those of all rows at once; the eager engine samples the same."""
    prompts, G = _prompts(tok) * 3, 3
    budgets = torch.tensor([1 + (5 * i) % 17 for i in range(len(prompts) * G)])
    kw = dict(num_generations=G, max_new_tokens=20, temperature=1.0, top_k=0, top_p=1.0, stop_ids=(tok.eos_id,),
              pad_id=tok.pad_id, keys=_keys(len(prompts), G), budgets=budgets, graphs=False, rows_per_matmul=8)
    counts = []
    few = slot_decode.generate(tiny_gpt, prompts, max_slots=8, on_tokens=counts.append, **kw)
    assert slot_decode.last_split(tiny_gpt)["steps"] > 20   # more steps than one pass of 20 tokens: slots refilled
    every = slot_decode.generate(tiny_gpt, prompts, **kw)
    assert _same(_rows(few), _rows(every))
    assert torch.equal(few.truncated, every.truncated) and torch.equal(few.prompt_ids, every.prompt_ids)
    assert sum(counts) == int(few.completion_mask.sum()) and min(counts) >= 0
    assert (few.completion_mask.sum(-1) <= budgets).all() and not few.truncated.all()
    kw.pop("graphs"), kw.pop("rows_per_matmul")
    eager = generate(tiny_gpt, prompts, slots=False, **kw)
    for (a, la), (b, lb) in zip(_rows(few), _rows(eager)):
        assert a == b
        torch.testing.assert_close(la, lb, atol=1e-5, rtol=1e-5)


def test_penalties_and_min_tokens_sample_what_the_eager_engine_samples(policy, tok):
    """vLLM's repetition/presence/frequency penalties and min_tokens on the slotted decode (refilling 8 slots
    too): the eager engine's tokens and log-probs, and min_tokens holds the end token back."""
    G, prompts = 4, _prompts(tok)
    kw = dict(num_generations=G, max_new_tokens=20, stop_ids=(tok.eos_id,), pad_id=tok.pad_id, keys=_keys(4, G))
    for pen in (dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4, min_tokens=6),
                dict(repetition_penalty=0.8), dict(min_tokens=12, frequency_penalty=-0.3)):
        eager = generate(policy, prompts, temperature=1.0, slots=False, **kw, **pen)
        refilled = slot_decode.generate(policy, prompts, temperature=1.0, top_k=0, top_p=1.0, graphs=False,
                                        rows_per_matmul=4, max_slots=8, penalties=Penalties(**pen), **kw)
        for got in (generate(policy, prompts, temperature=1.0, slots=True, **kw, **pen), refilled):
            assert torch.equal(got.completion_mask.sum(-1), eager.completion_mask.sum(-1))
            for (a, la), (b, lb) in zip(_rows(got), _rows(eager)):
                assert a == b
                torch.testing.assert_close(la, lb, atol=1e-5, rtol=1e-5)
        if pen.get("min_tokens"):
            assert (eager.completion_mask.sum(-1) > pen["min_tokens"]).all()
    plain = generate(policy, prompts, temperature=1.0, slots=True, **kw)
    assert not _same(_rows(plain), _rows(got))   # the penalties changed the completions


def test_top_k_and_top_p_and_counting_tokens(tiny_gpt, tok):
    G = 4
    seen = []
    kw = dict(num_generations=G, max_new_tokens=16, temperature=0.9, top_k=20, top_p=0.8, stop_ids=(tok.eos_id,),
              pad_id=tok.pad_id, keys=_keys(4, G))
    slots = generate(tiny_gpt, _prompts(tok), slots=True, on_tokens=seen.append, **kw)
    eager = generate(tiny_gpt, _prompts(tok), slots=False, **kw)
    assert [r[0] for r in _rows(slots)] == [r[0] for r in _rows(eager)]
    assert sum(seen) == int(slots.completion_mask.sum())


def test_the_triton_kernel_computes_the_reference_attention():
    pytest.importorskip("triton")
    code = """
import torch
from grpolab.models.decode_attention import decode_attention, reference
torch.manual_seed(0)
for b, H, KV, D, T in ((5, 6, 2, 16, 70), (3, 4, 4, 24, 33), (4, 9, 3, 64, 150), (3, 12, 2, 128, 140)):
    q, k, v = torch.randn(b, H, D), torch.randn(b, T, KV, D), torch.randn(b, T, KV, D)
    lens = torch.randint(1, T + 1, (b,))
    lens[0] = T
    out = decode_attention(q, k, v, lens, D ** -0.5, force_kernel=True)
    assert (out - reference(q, k, v, lens, D ** -0.5)).abs().max() < 1e-5
    # a row alone, in a narrower cache: the same bits
    one = decode_attention(q[1:2], k[1:2, :int(lens[1])].contiguous(), v[1:2, :int(lens[1])].contiguous(), lens[1:2],
                           D ** -0.5, force_kernel=True)
    assert torch.equal(one, out[1:2])
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "TRITON_INTERPRET": "1"})
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_the_sampling_kernels_draw_what_sample_next_draws():
    """The fused keyed draw for large vocabularies: sample_next's tokens, its log-probs up to float32 rounding,
    and a row alone the same bits as in its batch."""
    pytest.importorskip("triton")
    code = """
import torch
from grpolab.rollout.keys import completion_keys, token_uniforms
from grpolab.rollout.sampling import sample_next
from grpolab.rollout.sampling_kernels import keyed_sample
torch.manual_seed(0)
for V, T, dtype in ((5000, 1.0, torch.float32), (4096, 0.7, torch.bfloat16), (1500, 1.3, torch.float32)):
    x = (torch.randn(48, V) * 3).to(dtype)
    u = token_uniforms(completion_keys(0, torch.arange(48), torch.zeros(48, dtype=torch.long)), 5)
    tok, lp = keyed_sample(x, T, u)
    want, want_lp = sample_next(x, T, 0, 1.0, None, u)
    assert torch.equal(tok, want), (tok != want).sum()
    assert (lp - want_lp).abs().max() < 1e-5
    # the log-prob is log softmax(x / T) at the token, computed plainly
    plain = torch.log(torch.exp(x.double() / T) / torch.exp(x.double() / T).sum(-1, keepdim=True))
    assert (lp.double() - plain.gather(1, tok[:, None])[:, 0]).abs().max() < 1e-5
    one, one_lp = keyed_sample(x[7:8].clone(), T, u[7:8])
    assert torch.equal(one, tok[7:8]) and torch.equal(one_lp, lp[7:8])
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "TRITON_INTERPRET": "1"})
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_the_fused_kernels_compute_what_torch_computes():
    pytest.importorskip("triton")
    code = """
import torch
from grpolab.models.decode_kernels import rms_norm, rope_store, silu_mul
torch.manual_seed(0)
for dtype, upcast, eps, tol in ((torch.bfloat16, True, 1e-5, 2 ** -6), (torch.float32, False, None, 1e-5)):
    close = lambda a, b: torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)
    x, w = torch.randn(6, 72, dtype=dtype), torch.randn(72, dtype=dtype)
    for weight in (w, None):
        a = rms_norm(x, weight, eps, upcast, force_kernel=True)
        b = rms_norm(x, weight, eps, upcast)
        assert a.dtype == b.dtype
        close(a, b)
        assert torch.equal(rms_norm(x[2:3], weight, eps, upcast, force_kernel=True), a[2:3])   # a row alone
    gu = torch.randn(5, 2 * 40, dtype=dtype)
    a, b = silu_mul(gu, force_kernel=True), silu_mul(gu)
    close(a, b)
    H, KV, D, T = 6, 2, 16, 12
    qkv = torch.randn(3, (H + 2 * KV) * D, dtype=dtype)
    cos, sin = torch.randn(T, D, dtype=dtype), torch.randn(T, D, dtype=dtype)
    lens = torch.tensor([0, 5, 11])
    caches = [torch.zeros(4, T, KV, D, dtype=dtype) for _ in range(4)]
    qa = rope_store(qkv, cos, sin, lens, caches[0], caches[1], H, KV, force_kernel=True)
    qb = rope_store(qkv, cos, sin, lens, caches[2], caches[3], H, KV)
    close(qa, qb)
    close(caches[0], caches[2])
    assert torch.equal(caches[1], caches[3])
    assert caches[0][0, 0].abs().sum() > 0 and caches[0][1, 5].abs().sum() > 0 and caches[0][1, 4].abs().sum() == 0
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "TRITON_INTERPRET": "1"})
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_reference_attention_matches_a_plain_softmax():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 8), torch.randn(2, 10, 2, 8), torch.randn(2, 10, 2, 8)
    lens = torch.tensor([3, 10])
    got = reference(q, k, v, lens, 0.5)
    for r in range(2):
        for h in range(4):
            keys, vals = k[r, :lens[r], h // 2], v[r, :lens[r], h // 2]
            w = torch.softmax(keys @ q[r, h] * 0.5, dim=0)
            torch.testing.assert_close(got[r, h], w @ vals)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _assert_batch_independent(model, vocab: int, longest: int, max_new_tokens: int, stop: int, alone: tuple):
    """16 random prompts x 8 keyed samples on the graph path: the full batch twice, the rows `alone` each in
    a batch of one, and prompts 3-5 in a batch of their own give the same tokens and log-prob bits."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab - 1, (int(n),), generator=g).tolist()
               for n in torch.randint(5, longest, (16,), generator=g)]
    keys = _keys(16, 8)
    kw = dict(max_new_tokens=max_new_tokens, temperature=1.0, stop_ids=(stop,), pad_id=0)
    full = _rows(generate(model, prompts, num_generations=8, keys=keys, **kw))
    assert _same(full, _rows(generate(model, prompts, num_generations=8, keys=keys, **kw)))
    for r in alone:
        one = generate(model, [prompts[r // 8]], num_generations=1, keys=keys[r:r + 1], **kw)
        assert _same(_rows(one), full[r:r + 1])
    assert _same(_rows(generate(model, prompts[3:6], num_generations=8, keys=keys[24:48], **kw)), full[24:48])


@cuda
def test_cuda_graph_rows_alone_equal_rows_in_the_batch():
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=300, n_layer=2, n_head=4, n_embd=128, block_size=256)).cuda().eval()
    _assert_batch_independent(gpt, 300, 50, 64, 1, (0, 77, 127))


@cuda
def test_cuda_attention_kernel_in_bfloat16_computes_the_reference():
    """The tensor-core products in the model's dtype (the CPU interpreter runs bfloat16 products wrong, so
    this case is checked where the kernel runs)."""
    from grpolab.models.decode_attention import decode_attention
    torch.manual_seed(0)
    for b, H, KV, D, T in ((6, 9, 3, 64, 300), (4, 12, 2, 128, 200)):
        q, k, v = (torch.randn(b, H, D, device="cuda").bfloat16(), torch.randn(b, T, KV, D, device="cuda").bfloat16(),
                   torch.randn(b, T, KV, D, device="cuda").bfloat16())
        lens = torch.randint(1, T + 1, (b,), device="cuda")
        out = decode_attention(q, k, v, lens, D ** -0.5)
        want = reference(q, k, v, lens, D ** -0.5)
        assert (out.float() - want.float()).norm() / want.float().norm() < 1e-2
        one = decode_attention(q[2:3], k[2:3], v[2:3], lens[2:3], D ** -0.5)
        assert torch.equal(one, out[2:3])


@cuda
def test_cuda_graph_rows_alone_equal_rows_in_the_batch_bfloat16_gqa():
    """A SmolLM2-like layout (grouped-query heads, tied head, bfloat16, a vocabulary past the fused sampler's
    threshold): a row alone, and in a batch of another size, gives the tokens and log-probs of the full batch."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=5000, hidden_size=192, num_hidden_layers=3, num_attention_heads=6,
                      num_key_value_heads=2, intermediate_size=512, max_position_embeddings=512,
                      tie_word_embeddings=True)
    torch.manual_seed(1)
    policy = HFPolicy(LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval())
    _assert_batch_independent(policy, 5000, 90, 48, 2, (0, 45, 127))
