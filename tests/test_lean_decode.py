"""The lean sampling path agrees with the Hugging Face forward on every architecture it claims.

Each model is a tiny random one built here. The reference is HF's own forward over the whole
(left-padded) sequence without a cache; the lean path prefills the prompt, then decodes one
token at a time from its preallocated cache.
"""

import pytest
import torch
from conftest import randomize_lora_b

from grpolab.models import lean_decode
from grpolab.models.hf import HFCache, HFPolicy
from grpolab.models.lean_decode import LeanCache, LeanDecoder, _Linear, unsupported_reason
from grpolab.models.lean_prefill import packed_prefill, prefill_in_pieces
from grpolab.rollout.engine import generate
from grpolab.utils.padding import pad_sequences

pytest.importorskip("transformers")


def _tiny(kind: str):
    import transformers as tf
    common = dict(vocab_size=97, hidden_size=48, num_hidden_layers=2, num_attention_heads=4, intermediate_size=80,
                  max_position_embeddings=128)
    torch.manual_seed(0)
    if kind == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**common, num_key_value_heads=4)).eval()
    if kind == "llama_gqa_bias_rope_scaling":
        cfg = tf.LlamaConfig(**common, num_key_value_heads=2, attention_bias=True, mlp_bias=True,
                             rope_scaling={"rope_type": "linear", "factor": 2.0}, tie_word_embeddings=False)
        return tf.LlamaForCausalLM(cfg).eval()
    if kind == "qwen2":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**common, num_key_value_heads=2)).eval()
    if kind == "qwen3":
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(**common, num_key_value_heads=2, head_dim=16)).eval()
    if kind == "mistral":
        return tf.MistralForCausalLM(tf.MistralConfig(**common, num_key_value_heads=2, sliding_window=None)).eval()
    raise ValueError(kind)


def _perturb(model) -> None:
    # random init leaves norm weights at 1 and biases at 0; make them matter
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn(p.shape, generator=g) * 0.3)


KINDS = ["llama", "llama_gqa_bias_rope_scaling", "qwen2", "qwen3", "mistral"]


@pytest.mark.parametrize("kind", KINDS)
def test_lean_decode_logits_equal_hf_forward(kind):
    hf = _tiny(kind)
    _perturb(hf)
    policy = HFPolicy(hf)
    assert unsupported_reason(hf, 40) is None
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16]]
    ids, mask = pad_sequences(prompts, pad_id=0, side="left")
    steps = 7
    nxt = torch.randint(1, 97, (len(prompts), steps), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        cache = policy.new_cache(len(prompts), ids.size(1) + steps)
        assert isinstance(cache, LeanCache)
        lean = [policy(ids, key_valid=mask, cache=cache, logits_to_keep=1)[:, -1]]
        for t in range(steps - 1):
            lean.append(policy(nxt[:, t:t + 1], cache=cache)[:, -1])
        full_ids = torch.cat([ids, nxt], dim=1)
        full_mask = torch.cat([mask, torch.ones_like(nxt, dtype=torch.bool)], dim=1)
        ref = policy(full_ids, key_valid=full_mask)   # HF forward, no cache
    P = ids.size(1)
    for t, got in enumerate(lean):
        torch.testing.assert_close(got, ref[:, P - 1 + t], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_lean_greedy_tokens_equal_transformers_generate(kind):
    hf = _tiny(kind)
    _perturb(hf)
    policy = HFPolicy(hf)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 40], [13]]
    ours = generate(policy, prompts, max_new_tokens=10, temperature=0.0, stop_ids=(), pad_id=0)
    for i, p in enumerate(prompts):
        ref = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), do_sample=False,
                          max_new_tokens=10, min_new_tokens=10, pad_token_id=0, eos_token_id=None)
        assert ours.completion_ids[i].tolist() == ref[0, len(p):].tolist()


def test_lean_and_hf_cache_paths_sample_the_same_tokens():
    """Same generator seed through the lean cache and through HF's DynamicCache: same tokens, same log-probs."""
    hf = _tiny("qwen2")
    _perturb(hf)
    prompts = [[5, 6, 7, 8], [11, 12], [20, 21, 22]]
    kw = dict(num_generations=3, max_new_tokens=12, temperature=1.0, top_k=20, stop_ids=(3,), pad_id=0)
    lean = generate(HFPolicy(hf), prompts, generator=torch.Generator().manual_seed(4), **kw)
    plain = generate(HFPolicy(hf, lean_decode=False), prompts, generator=torch.Generator().manual_seed(4), **kw)
    assert torch.equal(lean.completion_ids, plain.completion_ids)
    assert torch.equal(lean.completion_mask, plain.completion_mask)
    torch.testing.assert_close(lean.sampler_logprobs, plain.sampler_logprobs, atol=1e-5, rtol=1e-5)


def test_unsupported_models_fall_back_to_the_hf_cache():
    import transformers as tf
    torch.manual_seed(0)
    gpt2 = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=50, n_embd=32, n_layer=1, n_head=2, n_positions=64)).eval()
    assert "gpt2" in unsupported_reason(gpt2, 40)
    policy = HFPolicy(gpt2)
    assert isinstance(policy.new_cache(2, 40), HFCache)
    g = generate(policy, [[1, 2, 3], [4]], num_generations=2, max_new_tokens=5, stop_ids=(), pad_id=0,
                 generator=torch.Generator().manual_seed(0))
    assert g.completion_ids.shape == (4, 5)
    # a sliding window shorter than the rollout is outside the lean path too
    mistral = _tiny("mistral")
    mistral.config.sliding_window = 16
    assert "sliding window" in unsupported_reason(mistral, 40)
    assert unsupported_reason(mistral, 16) is None


def test_rollout_lean_decode_config_key_reaches_the_policy(tmp_path):
    from grpolab.config.load import load_config
    from grpolab.data.tasks import arithmetic
    from grpolab.models.hf import HFTokenizer
    from grpolab.models.tiny_hf import build_tokenizer
    from grpolab.train.grpo import GRPOTrainer

    tok = build_tokenizer([r["prompt"] + "\n" + r["answer"] for r in arithmetic.generate("train", 200, seed=0)],
                          vocab_size=300)
    hf = _tiny("llama")
    hf.resize_token_embeddings(len(tok))
    rows = arithmetic.generate("train", 4, seed=0)
    for flag, cache_type in (("false", HFCache), ("true", LeanCache)):
        cfg = load_config(None, [f"rollout.lean_decode={flag}", "algorithm.beta=0.04", "rollout.prompts_per_step=2",
                                 "rollout.num_generations=2", "rollout.max_new_tokens=4"])
        policy = HFPolicy(hf)
        trainer = GRPOTrainer(cfg, policy, HFTokenizer(tok), rows, rows, tmp_path)
        assert isinstance(trainer.model.new_cache(2, 8), cache_type)
        assert isinstance(trainer.ref.new_cache(2, 8), cache_type)
        assert trainer.rollout().gen.completion_ids.shape == (4, 4)


@pytest.mark.parametrize("with_bias", [False, True])
def test_normed_linear_equals_rms_norm_then_linear(with_bias):
    """The norm's row scale applied after the matmul equals normalising first (float32), written out plainly."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from grpolab.models.lean_decode import _NormedLinear
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 16, generator=g) * 3, torch.randn(7, 16, generator=g)
    b = torch.randn(7, generator=g) if with_bias else None
    eps = 1e-5
    norm = LlamaRMSNorm(16, eps=eps)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(16, generator=g) + 0.5)
    gamma = norm.weight.detach()
    plain = torch.stack([(row / torch.sqrt((row * row).sum() / 16 + eps)) * gamma for row in x]) @ w.T
    if b is not None:
        plain = plain + b
    torch.testing.assert_close(_NormedLinear(norm, w, b)(x), plain, atol=1e-5, rtol=1e-5)
    # bfloat16 normalises in float32 first and casts back, as HF's RMSNorm does
    xb, wb = x.bfloat16(), w.bfloat16()
    xf = xb.float()
    hf_way = torch.nn.functional.linear((xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).bfloat16(),
                                        wb * gamma.bfloat16(), None if b is None else b.bfloat16())
    got = _NormedLinear(norm.bfloat16(), wb, None if b is None else b.bfloat16())(xb)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, hf_way)


def test_lean_cache_additive_mask_tracks_real_tokens():
    """The cache records which positions are real as an additive mask (0 real, -inf padding) through
    prefill, the copy to G samples and decoding, so a decode step can read it instead of building one."""
    hf = _tiny("llama")
    policy = HFPolicy(hf)
    ids, mask = pad_sequences([[5, 6, 7], [8]], pad_id=0, side="left")
    with torch.inference_mode():
        cache = policy.new_cache(2, 8)
        policy(ids, key_valid=mask, cache=cache, logits_to_keep=1)
        cache = cache.repeat_interleave(2)
        for t in range(3):
            policy(torch.full((4, 1), 9 + t), cache=cache)
    expected_valid = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0]] * 2 + [[0, 0, 1, 1, 1, 1, 0, 0]] * 2, dtype=torch.bool)
    assert torch.equal(cache.bias == 0, expected_valid)
    assert bool(torch.isneginf(cache.bias[~expected_valid]).all())
    assert cache.count.tolist() == [6, 6, 4, 4]


def _lora_policy(kind: str, **settings) -> HFPolicy:
    """A tiny model with grpolab's peft adapters, their B matrices random."""
    from grpolab.models.lora import add_lora
    hf = _tiny(kind)
    _perturb(hf)
    policy = add_lora(HFPolicy(hf), {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0,
                                     "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                        "up_proj", "down_proj"]} | settings)
    randomize_lora_b(policy, seed=3, scale=0.2)
    return policy


def _lean_and_full_logits(policy: HFPolicy) -> tuple[torch.Tensor, torch.Tensor]:
    """Last-token logits decoded through the lean cache, and the HF forward's at the same positions."""
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16]]
    ids, mask = pad_sequences(prompts, pad_id=0, side="left")
    nxt = torch.randint(1, 97, (len(prompts), 5), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        cache = policy.new_cache(len(prompts), ids.size(1) + 5)
        assert isinstance(cache, LeanCache)
        lean = [policy(ids, key_valid=mask, cache=cache, logits_to_keep=1)[:, -1]]
        for t in range(4):
            lean.append(policy(nxt[:, t:t + 1], cache=cache)[:, -1])
        full = policy(torch.cat([ids, nxt], 1), key_valid=torch.cat([mask, torch.ones_like(nxt, dtype=torch.bool)], 1))
    P = ids.size(1)
    return torch.stack(lean, 1), full[:, P - 1:P + 4]


@pytest.mark.parametrize("kind", ["llama_gqa_bias_rope_scaling", "qwen3"])
def test_lora_adapters_are_merged_into_the_lean_path(kind):
    pytest.importorskip("peft")
    policy = _lora_policy(kind)
    assert unsupported_reason(policy.hf, 40) is None
    lean, full = _lean_and_full_logits(policy)
    torch.testing.assert_close(lean, full, atol=2e-5, rtol=1e-4)
    # the adapters change the logits, so the agreement above is not the base model's
    with policy.hf.disable_adapter():
        base_lean, base_full = _lean_and_full_logits(policy)
    torch.testing.assert_close(base_lean, base_full, atol=2e-5, rtol=1e-4)
    assert (base_full - full).abs().max() > 1e-2


def test_lora_lean_and_hf_cache_paths_sample_the_same_tokens():
    pytest.importorskip("peft")
    policy = _lora_policy("llama")
    prompts = [[5, 6, 7, 8], [11, 12], [20, 21, 22]]
    kw = dict(num_generations=3, max_new_tokens=12, temperature=1.0, top_k=20, stop_ids=(3,), pad_id=0)
    lean = generate(policy, prompts, generator=torch.Generator().manual_seed(4), **kw)
    policy.lean_decode = False
    plain = generate(policy, prompts, generator=torch.Generator().manual_seed(4), **kw)
    assert torch.equal(lean.completion_ids, plain.completion_ids)
    torch.testing.assert_close(lean.sampler_logprobs, plain.sampler_logprobs, atol=1e-5, rtol=1e-5)


def test_lora_kinds_the_lean_path_does_not_merge_fall_back():
    pytest.importorskip("peft")
    dropout = _lora_policy("llama", lora_dropout=0.1)
    assert unsupported_reason(dropout.hf, 40) is None            # eval mode: dropout is the identity
    dropout.hf.train()
    assert "dropout" in unsupported_reason(dropout.hf, 40)
    assert isinstance(dropout.new_cache(2, 40), HFCache)
    dora = _lora_policy("llama", use_dora=True)
    assert "DoRA" in unsupported_reason(dora.hf, 40)
    embed = _lora_policy("llama", target_modules=["q_proj", "embed_tokens"])
    assert "embeddings" in unsupported_reason(embed.hf, 40)


@pytest.mark.parametrize("threads", [1, 2])
def test_prepacked_linear_rows_do_not_depend_on_the_batch(threads):
    """float32 on a CPU: the weights go through oneDNN prepacked; each row's output (and the residual
    form's) is bit-identical computed with 600 other rows, a few, or alone, and equals x @ W.T + b to
    float32 rounding. bfloat16 keeps F.linear."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(0)
        w, b = torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
        x, res = torch.randn(600, 64, generator=g), torch.randn(600, 96, generator=g)
        lin = _Linear(w, b)
        assert lin.packed and lin.w.layout == torch._mkldnn or not torch.backends.mkldnn.is_available()
        full, full_res = lin(x), lin.residual(res, x)
        assert torch.allclose(full, x @ w.T + b, atol=1e-4)
        assert torch.allclose(full_res, res + x @ w.T + b, atol=1e-4)
        for rows in (slice(0, 1), slice(5, 8), slice(100, 133), slice(0, 300)):
            assert torch.equal(lin(x[rows]), full[rows])
            assert torch.equal(lin.residual(res[rows], x[rows]), full_res[rows])
        assert not _Linear(w.bfloat16(), None).packed
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("kind", KINDS)
def test_packed_prefill_equals_hf_forward_and_continues_a_prefix(kind):
    """The server's packed prefill (models/lean_prefill.py) on every supported kind (qwen3's per-head norms,
    biases, rope scaling, GQA): each prompt's last logits and keys/values as HF's forward of it alone, and
    a prompt continued from its own first positions' keys and values the same bits as prefilled whole."""
    hf = _tiny(kind)
    _perturb(hf)
    prompts = [[5, 6, 7, 8, 9, 10, 3, 4], [11, 12], [13, 14, 15, 16, 17]]
    with torch.inference_mode():
        d = LeanDecoder(hf, 64)
        kvs, logits = packed_prefill(d, prompts, [None] * 3)
        for p, kv, lg in zip(prompts, kvs, logits):
            out = hf(torch.tensor([p]), use_cache=True)
            assert torch.allclose(lg, out.logits[0, -1], atol=1e-5, rtol=1e-4)
            for layer in range(d.n_layer):
                assert torch.allclose(kv[layer, :d.n_kv], out.past_key_values.layers[layer].keys[0], atol=1e-5)
                assert torch.allclose(kv[layer, d.n_kv:], out.past_key_values.layers[layer].values[0], atol=1e-5)
        (kv2,), lg2 = packed_prefill(d, [prompts[0][3:]], [kvs[0][:, :, :3].clone()])
        assert torch.equal(kv2, kvs[0]) and torch.equal(lg2[0], logits[0])


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_rollout_prefill_in_pieces_depends_on_each_prompt_alone(kind):
    """The rollout's packed prefill (lean_prefill.prefill_in_pieces): each prompt cut at multiples of 3 of
    its own positions gives the same bits packed with two others as alone, agrees with HF's forward of
    it, and packs only real tokens (the projections see sum(lengths) rows, not prompts x the longest)."""
    hf = _tiny(kind)
    _perturb(hf)
    prompts = [[5, 6, 7, 8, 9, 10, 3, 4], [11, 12], [13, 14, 15, 16, 17]]
    rows = []
    with torch.inference_mode():
        d = LeanDecoder(hf, 64)
        real = d.layers[0].qkv
        d.layers[0].qkv = lambda x: rows.append(x.size(0)) or real(x)
        kvs, logits = prefill_in_pieces(d, prompts, 3)
        assert sum(rows) == sum(map(len, prompts))
        for i, p in enumerate(prompts):
            (kv,), lg = prefill_in_pieces(d, [p], 3)
            assert torch.equal(kv, kvs[i]) and torch.equal(lg[0], logits[i]), i
            assert torch.allclose(lg[0], hf(torch.tensor([p])).logits[0, -1], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("shared", [False, True])
def test_compact_keeps_rows_in_place_and_moves_only_the_last_ones(shared):
    """LeanCache.compact: the kept rows below the new size stay where they are, each leaver's place takes
    one of the last kept rows, and the cache holds exactly the kept rows' tensors in the order it returns.
    With a shared prompt (two groups of 3 rows) each row still maps to its own group's prompt, and a group
    with no row left is dropped."""
    torch.manual_seed(0)
    decoder = LeanDecoder(_tiny("llama"), 32)
    with torch.inference_mode():
        cache = LeanCache(decoder, 6, 8)
        cache.kv.normal_()
        cache.bias.normal_()
        cache.count.copy_(torch.arange(6) * 10)
        if shared:
            cache.prefix = lean_decode._Prefix(torch.randn(2, 2, 8, 5, 12), torch.zeros(2, 1, 1, 5), 3, None)
        kv, bias, count = cache.kv.clone(), cache.bias.clone(), cache.count.clone()
        idx = torch.tensor([1, 3, 4, 5]) if not shared else torch.tensor([3, 4, 5])   # group 0 leaves whole
        out, order = cache.compact(idx)
    n = idx.numel()
    assert sorted(order.tolist()) == idx.tolist()
    assert all(order[r] == r for r in idx.tolist() if r < n)   # kept rows below n never move
    assert out.kv.untyped_storage().data_ptr() == cache.kv.untyped_storage().data_ptr()   # in its own tensors
    assert torch.equal(out.kv, kv[:, order]) and torch.equal(out.bias, bias[order])
    assert torch.equal(out.count, count[order])
    if shared:
        pre = out.prefix
        assert pre.kv.size(1) == 1   # group 0 is gone
        slots = torch.arange(n) if pre.slots is None else pre.slots
        assert torch.equal(slots // 3, torch.zeros(n, dtype=torch.long))   # every row is of the group left
        assert torch.equal(slots % 3, order % 3)                             # and keeps its place in it


def test_lean_rows_leave_the_batch_the_step_they_finish_and_decode_as_alone():
    """On the lean path a finished row leaves the decode batch at once (its cache's last rows move into
    its place), so step t decodes exactly the rows still going; every row samples the tokens it samples
    decoded alone, with its log-probs (to float rounding)."""
    from grpolab.rollout.keys import completion_keys
    model = HFPolicy(_tiny("llama_gqa_bias_rope_scaling"))
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]]
    G = 3
    lengths = torch.tensor([9, 4, 12, 2, 3, 2, 12, 7, 5])
    keys = completion_keys(3, torch.arange(3).repeat_interleave(G), torch.arange(G).repeat(3))
    seen = []

    def force(lens):
        def hook(logits, t, rows):
            seen.append(sorted(rows.tolist()))
            logits[:, 1] = float("-inf")
            at = lens[rows] == t + 1
            logits[at] = float("-inf")
            logits[at, 1] = 0.0
            return logits
        return hook
    with torch.inference_mode():
        out = generate(model, prompts, num_generations=G, max_new_tokens=12, temperature=1.0, stop_ids=(1,),
                       keys=keys, logits_hook=force(lengths))
        assert torch.equal(out.completion_mask.sum(-1), lengths)
        assert seen == [[r for r in range(9) if lengths[r] > t] for t in range(12)]   # at once, every step
        for r in range(9):
            alone = generate(model, [prompts[r // G]], num_generations=1, max_new_tokens=12, temperature=1.0,
                             stop_ids=(1,), keys=keys[r:r + 1], logits_hook=force(lengths[r:r + 1]))
            n = int(lengths[r])
            assert torch.equal(alone.completion_ids[0, :n], out.completion_ids[r, :n]), r
            torch.testing.assert_close(alone.sampler_logprobs[0, :n], out.sampler_logprobs[r, :n], atol=1e-5, rtol=0)
