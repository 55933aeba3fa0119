import math

import torch

from grpolab.models.logprobs import completion_logprobs
from grpolab.rollout.engine import generate
from grpolab.rollout.sampling import filter_logits


def _prompts(tok):
    return [tok.render_prompt(p) for p in ("Mia has 7 shells.", "Sum 1+2?", "Ok")]


def test_sampler_logprobs_equal_model_logprobs_of_sampled_tokens(tiny_gpt, tok):
    for temperature in (1.0, 0.7):
        g = generate(tiny_gpt, _prompts(tok), num_generations=4, max_new_tokens=12, temperature=temperature,
                     stop_ids=(tok.eos_id,), pad_id=tok.pad_id, generator=torch.Generator().manual_seed(0))
        # independent recomputation: run each row alone, unpadded, and gather log softmax(logits / T)
        for i in range(g.completion_ids.size(0)):
            prompt = g.prompt_ids[i][g.prompt_mask[i]]
            comp = g.completion_ids[i][g.completion_mask[i]]
            seq = torch.cat([prompt, comp])[None]
            logits = tiny_gpt(seq)[0, len(prompt) - 1:-1] / temperature
            want = logits.log_softmax(-1).gather(-1, comp[:, None]).squeeze(-1)
            torch.testing.assert_close(g.sampler_logprobs[i][g.completion_mask[i]], want, atol=1e-5, rtol=1e-5)
        lp = completion_logprobs(tiny_gpt, g.prompt_ids, g.prompt_mask, g.completion_ids, g.completion_mask,
                                 temperature)
        torch.testing.assert_close(lp, g.sampler_logprobs, atol=1e-5, rtol=1e-5)


def test_rows_are_grouped_and_seeded(tiny_gpt, tok):
    kw = dict(num_generations=3, max_new_tokens=10, temperature=1.0, stop_ids=(tok.eos_id,), pad_id=tok.pad_id)
    a = generate(tiny_gpt, _prompts(tok), generator=torch.Generator().manual_seed(5), **kw)
    b = generate(tiny_gpt, _prompts(tok), generator=torch.Generator().manual_seed(5), **kw)
    c = generate(tiny_gpt, _prompts(tok), generator=torch.Generator().manual_seed(6), **kw)
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert not torch.equal(a.completion_ids, c.completion_ids)
    assert a.completion_ids.size(0) == 9
    for i in range(9):  # row i belongs to prompt i // 3
        want = torch.tensor(_prompts(tok)[i // 3])
        assert torch.equal(a.prompt_ids[i][a.prompt_mask[i]], want)


def test_stop_token_ends_a_row_and_truncation_is_flagged(tiny_gpt, tok):
    # Make the end token overwhelmingly likely: every row must stop after exactly one token.
    bias = torch.zeros(tok.vocab_size)
    bias[tok.eos_id] = 100.0

    class Biased(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, *a, **k):
            return self.m(*a, **k) + bias

        def new_cache(self, *a):
            return self.m.new_cache(*a)

    g = generate(Biased(tiny_gpt), _prompts(tok), num_generations=2, max_new_tokens=8, temperature=1.0,
                 stop_ids=(tok.eos_id,), pad_id=tok.pad_id, generator=torch.Generator().manual_seed(0))
    assert g.completion_mask.sum(-1).tolist() == [1] * 6
    assert not g.truncated.any()
    # no stop token possible: every row runs to max_new_tokens and is flagged truncated
    g = generate(tiny_gpt, _prompts(tok), num_generations=2, max_new_tokens=5, temperature=1.0, stop_ids=(),
                 pad_id=tok.pad_id, generator=torch.Generator().manual_seed(0))
    assert g.completion_ids.shape == (6, 5) and g.truncated.all() and g.completion_mask.all()


def test_greedy_is_argmax_and_deterministic(tiny_gpt, tok):
    g = generate(tiny_gpt, _prompts(tok)[:1], max_new_tokens=6, temperature=0.0, pad_id=tok.pad_id)
    seq = torch.tensor(_prompts(tok)[0])
    for t in range(6):
        nxt = tiny_gpt(seq[None])[0, -1].argmax()
        assert int(nxt) == int(g.completion_ids[0, t])
        seq = torch.cat([seq, nxt[None]])


def test_top_k_and_top_p_filters():
    logits = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.15), math.log(0.05)]])
    k2 = filter_logits(logits, top_k=2)
    assert torch.isfinite(k2).tolist() == [[True, True, False, False]]
    # nucleus 0.7: 0.5 alone is below 0.7, 0.5+0.3 reaches it -> keep the first two
    p = filter_logits(logits, top_p=0.7)
    assert torch.isfinite(p).tolist() == [[True, True, False, False]]
    p = filter_logits(logits, top_p=0.81)
    assert torch.isfinite(p).tolist() == [[True, True, True, False]]
    assert torch.isfinite(filter_logits(logits, top_p=0.01)).tolist() == [[True, False, False, False]]


def test_logprobs_of_a_row_alone_equal_its_logprobs_in_the_padded_batch(tiny_gpt, tok):
    """Micro-batches drop the columns that are padding in all their rows; the values must not move."""
    g = generate(tiny_gpt, _prompts(tok), num_generations=2, max_new_tokens=12, temperature=1.0,
                 stop_ids=(tok.eos_id,), pad_id=tok.pad_id, generator=torch.Generator().manual_seed(3))
    # rows of different lengths, as if they had stopped at 3, 5, ... tokens
    lengths = torch.tensor([3, 5, 12, 1, 7, 9])
    cmask = torch.arange(12)[None] < lengths[:, None]
    full = completion_logprobs(tiny_gpt, g.prompt_ids, g.prompt_mask, g.completion_ids, cmask)
    for i in range(g.completion_ids.size(0)):
        one = completion_logprobs(tiny_gpt, g.prompt_ids[i:i + 1], g.prompt_mask[i:i + 1],
                                  g.completion_ids[i:i + 1], cmask[i:i + 1])
        assert one.shape == (1, g.completion_ids.size(1))
        torch.testing.assert_close(one[0], full[i], atol=1e-5, rtol=1e-5)


def test_rows_that_stop_leave_the_batch_and_the_rest_decode_as_alone(tiny_gpt, tok):
    """Rows forced to stop at different lengths leave the decode batch (the logits hook sees fewer rows);
    every row's tokens and log-probs are what that row gives decoded alone."""
    from grpolab.rollout.keys import completion_keys
    prompts = [tok.render_prompt(q) for q in ("3 + 4?", "10 - 2 = ?", "7 x 6")]
    G, cap = 4, 40
    lengths = torch.tensor([3, 5, 8, 40, 2, 2, 2, 2, 30, 12, 6, 1])
    keys = completion_keys(9, torch.arange(3).repeat_interleave(G), torch.arange(G).repeat(3))
    seen = []

    def force(lens):
        def hook(logits, t, rows):
            seen.append(len(rows))
            logits = logits.clone()
            logits[:, tok.eos_id] = float("-inf")
            at = lens[rows] == t + 1
            logits[at] = float("-inf")
            logits[at, tok.eos_id] = 0.0
            return logits
        return hook
    out = generate(tiny_gpt, prompts, num_generations=G, max_new_tokens=cap, temperature=1.0, stop_ids=tok.stop_ids,
                   pad_id=tok.pad_id, keys=keys, logits_hook=force(lengths))
    assert out.completion_mask.sum(-1).tolist() == lengths.tolist()
    assert seen[0] == 12 and seen[-1] == 1 and len(set(seen)) > 2   # the batch shrank as rows stopped
    for r in range(12):
        seen.clear()
        alone = generate(tiny_gpt, [prompts[r // G]], num_generations=1, max_new_tokens=cap, temperature=1.0,
                         stop_ids=tok.stop_ids, pad_id=tok.pad_id, keys=keys[r:r + 1],
                         logits_hook=force(lengths[r:r + 1]))
        n = int(lengths[r])
        assert alone.completion_ids[0, :n].tolist() == out.completion_ids[r, :n].tolist()
        assert torch.allclose(alone.sampler_logprobs[0, :n], out.sampler_logprobs[r, :n], atol=1e-5)
    assert (out.completion_ids[out.completion_mask.logical_not()] == tok.pad_id).all()


def test_chunked_prefill_samples_what_one_prefill_samples(tiny_gpt, tok, tmp_path):
    """Prompts prefilled 3 positions at a time give the same tokens and log-probs as one prefill: the built-in
    GPT and an HF Llama on HF's cache (left padding spread over several chunks), and on the lean path (packed,
    each prompt in pieces of 3 of its own positions)."""
    from grpolab.models.hf import load_hf
    from grpolab.models.tiny_hf import save_tiny_model
    from grpolab.rollout.keys import completion_keys
    hf, hf_tok = load_hf(str(save_tiny_model(tmp_path / "m", vocab_size=300, hidden=32, layers=2, heads=2,
                                              intermediate=64)))
    texts = ["Sam has 3 apples and buys 12 more.", "1+1", "What is 7 times 8, minus 5?"]
    for name, model, t in (("gpt", tiny_gpt, tok), ("lean", hf, hf_tok), ("hf-cache", hf, hf_tok)):
        if name == "hf-cache":
            model.lean_decode = False
        prompts = [t.render_prompt(x) for x in texts]
        assert max(map(len, prompts)) - min(map(len, prompts)) > 6   # padding fills whole chunks
        keys = completion_keys(5, torch.arange(3).repeat_interleave(2), torch.arange(2).repeat(3))
        runs = [generate(model, prompts, num_generations=2, max_new_tokens=12, temperature=1.0, pad_id=t.pad_id,
                         keys=keys, prefill_chunk=c) for c in (0, 3)]
        assert torch.equal(runs[0].completion_ids, runs[1].completion_ids), name
        assert (runs[0].sampler_logprobs - runs[1].sampler_logprobs).abs().max() <= 1e-5, name
    hf.lean_decode = True


def test_shared_prompt_decode_samples_what_per_row_copies_sample(monkeypatch):
    """The lean path's shared prompt (one copy of each prompt's keys and values per group, two-part
    attention merged by log-sum-exp) samples the same tokens with the same log-probs as per-row copies,
    also after rows leave the batch (whole groups and single rows), with grouped-query attention."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from grpolab.models import lean_decode
    from grpolab.models.hf import HFPolicy
    from grpolab.rollout.keys import completion_keys
    cfg = LlamaConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128, eos_token_id=1)
    torch.manual_seed(0)
    model = HFPolicy(LlamaForCausalLM(cfg).eval())
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]]
    G = 3
    # forced stops: one whole group (prompt 1) leaves early, single rows of the others at various steps
    lengths = torch.tensor([9, 4, 12, 2, 3, 2, 12, 7, 5])

    def force(logits, t, rows):
        logits[:, 1] = float("-inf")
        at = lengths[rows] == t + 1
        logits[at] = float("-inf")
        logits[at, 1] = 0.0
        return logits
    keys = completion_keys(3, torch.arange(3).repeat_interleave(G), torch.arange(G).repeat(3))
    runs = {}
    real, share = lean_decode._attend_shared, lean_decode.LeanCache.share_prompt

    def poisoned(cache, n):   # the completions' keys and values are left unwritten: NaN there must never be read
        out = share(cache, n)
        if out.prefix is not None:
            out.kv.fill_(float("nan"))
        return out
    for name, limit in (("copies", 2**62), ("shared", 0), ("poisoned", 0)):
        monkeypatch.setattr(lean_decode, "SHARE_MIN_BYTES", limit)
        monkeypatch.setattr(lean_decode.LeanCache, "share_prompt", poisoned if name == "poisoned" else share)
        seen = []
        monkeypatch.setattr(lean_decode, "_attend_shared", lambda *a: seen.append(1) or real(*a))
        runs[name] = generate(model, prompts, num_generations=G, max_new_tokens=12, temperature=1.0, stop_ids=(1,),
                              keys=keys, logits_hook=force)
        assert bool(seen) == (name != "copies")
    a, b = runs["copies"], runs["shared"]
    assert torch.equal(a.completion_mask.sum(-1), lengths)
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert (a.sampler_logprobs - b.sampler_logprobs).abs().max() <= 1e-5
    assert torch.equal(runs["poisoned"].completion_ids, b.completion_ids)
    assert torch.equal(runs["poisoned"].sampler_logprobs, b.sampler_logprobs)


def test_prompt_keys_are_shared_only_where_it_saves_enough_bytes():
    """share_prompt's default rule (lean_decode.SHARE_MIN_BYTES): 8 prompts x 128 tokens x 8 samples of
    a 512-wide model share (29 MiB per layer saved); the same with 16-token prompts (3.7 MiB, under the 4 MiB
    threshold) copy."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from grpolab.models.hf import HFPolicy
    cfg = LlamaConfig(vocab_size=64, hidden_size=512, num_hidden_layers=1, num_attention_heads=8,
                      num_key_value_heads=8, intermediate_size=64, max_position_embeddings=256)
    torch.manual_seed(0)
    model = HFPolicy(LlamaForCausalLM(cfg).eval())
    for width, shared in ((128, True), (16, False)):
        with torch.inference_mode():
            cache = model.new_cache(8, width + 4)
            model(torch.randint(0, 64, (8, width)), key_valid=torch.ones(8, width, dtype=torch.bool), cache=cache)
            out = cache.share_prompt(8)
        assert (out.prefix is not None) == shared, width
        assert out.count.tolist() == [width] * 64
        assert out.kv.size(1) == 64 and out.kv.size(3) == (4 if shared else width + 4)
