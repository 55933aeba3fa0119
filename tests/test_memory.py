"""Memory switches: chunked log-probs (optim.logprob_chunk) and activation checkpointing
(model.gradient_checkpointing) give the same numbers as the plain path, and do what they claim."""

import copy

import pytest
import torch
from test_grpo import make_trainer

from grpolab.models import GPT, CharTokenizer, GPTConfig, set_gradient_checkpointing
from grpolab.models.logprobs import completion_logprobs


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from grpolab.models.hf import load_hf
    from grpolab.models.tiny_hf import save_tiny_model
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=CharTokenizer().vocab_size, n_layer=2, n_head=2, n_embd=32, block_size=64))
    d = save_tiny_model(tmp_path_factory.mktemp("llama"), vocab_size=300, hidden=32, layers=2, heads=2,
                        intermediate=64)
    return {"gpt": gpt, "llama": load_hf(str(d))[0]}


def _batch(V=90, B=3, P=7, C=11):
    g = torch.Generator().manual_seed(1)
    pid, cid = torch.randint(0, V, (B, P), generator=g), torch.randint(0, V, (B, C), generator=g)
    pm, cm = torch.ones(B, P, dtype=torch.bool), torch.ones(B, C, dtype=torch.bool)
    pm[0, :3] = False   # left padding
    cm[1, 6:] = False   # a completion that stopped early
    return pid, pm, cid, cm


def _run(model, chunk=0, ckpt=False):
    """Log-probs, entropies and the gradient of sum(logp) + 0.1 sum(entropy) (temperature 0.9)."""
    m = copy.deepcopy(model).train()
    set_gradient_checkpointing(m, ckpt)
    pid, pm, cid, cm = _batch()
    lp, ent = completion_logprobs(m, pid, pm, cid, cm, 0.9, with_entropy=True, entropy_grad=True, chunk=chunk)
    (lp.sum() + 0.1 * (ent * cm).sum()).backward()
    return lp.detach(), ent.detach(), {k: p.grad for k, p in m.named_parameters()}


def _plain_logprobs(model, pid, pm, cid, cm, temperature):
    """Independent: the full logits of the whole sequence, log-softmax, pick each completion token."""
    ids, valid = torch.cat([pid, cid], 1), torch.cat([pm, cm], 1)
    logits = model(ids, key_valid=valid).float() / temperature
    P = pid.size(1)
    lp = logits[:, P - 1:-1].log_softmax(-1).gather(-1, cid[..., None]).squeeze(-1)
    return lp * cm


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_chunked_logprobs_equal_the_plain_ones(models, name):
    plain = _run(models[name])
    for chunk in (1, 4, 64):   # 64 > C: one chunk
        lp, ent, grads = _run(models[name], chunk=chunk)
        # to 1e-6 of the values' size (float32 keeps 7 digits; a chunk's matmul may round another way)
        assert (lp - plain[0]).abs().max() <= 1e-6 * plain[0].abs().max(), chunk
        assert (ent - plain[1]).abs().max() <= 1e-6 * plain[1].abs().max(), chunk
        for k, g in plain[2].items():
            # the head's gradient is summed chunk by chunk: another order of the same float sums
            assert (grads[k] - g).abs().max() <= 1e-5 * max(1.0, float(g.abs().max())), (chunk, k)
    with torch.no_grad():
        pid, pm, cid, cm = _batch()
        ref = _plain_logprobs(models[name], pid, pm, cid, cm, 0.9)
        got = completion_logprobs(models[name], pid, pm, cid, cm, 0.9, chunk=4)
    assert (got - ref).abs().max() <= 1e-5 and got[cm].abs().min() > 0


def _saved_vocab_numels(model, chunk, V):
    """The sizes of the vocabulary-wide tensors (last dim V) autograd keeps for the backward during
    one log-prob forward."""
    sizes = []

    def pack(t):
        if t.dim() and t.shape[-1] == V:
            sizes.append(t.numel())
        return t
    pid, pm, cid, cm = _batch(C=40)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        completion_logprobs(model, pid, pm, cid, cm, 1.0, with_entropy=True, chunk=chunk)
    return sizes


def test_chunked_logprobs_keep_no_full_vocabulary_tensor_for_the_backward(models):
    """The plain path keeps (B, C, V) float32 logits/log-probs for the backward; with chunks nothing
    vocabulary-wide is kept beyond a chunk (it is recomputed in the backward)."""
    m = copy.deepcopy(models["llama"]).train()
    B, C, V = 3, 40, m.config.vocab_size
    assert max(_saved_vocab_numels(m, 0, V)) >= B * C * V
    assert max(_saved_vocab_numels(m, 8, V), default=0) <= B * 8 * V


def test_logprob_chunk_null_chunks_only_logits_over_the_size_limit(models, monkeypatch):
    """optim.logprob_chunk null: rows x positions x vocabulary x 4 bytes over AUTO_CHUNK_BYTES chunks,
    at or under it one pass; a number is used as given. Through completion_logprobs: with the limit just
    under this batch's logits nothing vocabulary-wide outlives a chunk, just at them the full logits are kept."""
    from grpolab.models import logprobs
    m = copy.deepcopy(models["llama"]).train()
    B, C, V = 3, 40, m.config.vocab_size
    limit = logprobs.AUTO_CHUNK_BYTES
    rows = limit // (128 * V * 4)                 # logits of rows x 128 positions: just under the limit
    assert logprobs.logprob_chunk(None, m, rows, 128) == 0
    assert logprobs.logprob_chunk(None, m, rows + 1, 128) == logprobs.AUTO_CHUNK
    assert logprobs.logprob_chunk(None, object(), 10**6, 10**6) == 0    # no vocabulary known: one pass
    assert logprobs.logprob_chunk(0, m, 10**6, 128) == 0 and logprobs.logprob_chunk(5, m, 1, 1) == 5
    monkeypatch.setattr(logprobs, "AUTO_CHUNK", 8)
    monkeypatch.setattr(logprobs, "AUTO_CHUNK_BYTES", B * C * V * 4)
    assert max(_saved_vocab_numels(m, None, V)) >= B * C * V
    monkeypatch.setattr(logprobs, "AUTO_CHUNK_BYTES", B * C * V * 4 - 1)
    assert max(_saved_vocab_numels(m, None, V), default=0) <= B * 8 * V


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_gradient_checkpointing_same_gradients_and_blocks_recomputed(models, name):
    plain = _run(models[name])
    lp, ent, grads = _run(models[name], ckpt=True)
    assert torch.equal(lp, plain[0])
    for k, g in plain[2].items():
        assert (grads[k] - g).abs().max() <= 1e-6, k
    # each block runs twice per training forward+backward with checkpointing (once more in the
    # backward), once without; sampling and no-grad passes never recompute
    m = copy.deepcopy(models[name]).train()
    # a module inside the first block (a forward hook would not see the recompute, and HF checkpoints
    # its layer's own class forward)
    inner = m.blocks[0].qkv if name == "gpt" else m.hf.model.layers[0].self_attn
    calls, forward = [], inner.forward

    def counted(*args, **kwargs):
        calls.append(1)
        return forward(*args, **kwargs)
    inner.forward = counted
    pid, pm, cid, cm = _batch()
    for ckpt in (False, True):
        set_gradient_checkpointing(m, ckpt)
        calls.clear()
        completion_logprobs(m, pid, pm, cid, cm).sum().backward()
        assert len(calls) == (2 if ckpt else 1), ckpt
    calls.clear()
    with torch.no_grad():
        completion_logprobs(m, pid, pm, cid, cm)
    assert len(calls) == 1


def test_training_with_both_switches_gives_the_same_run(tmp_path):
    """Two GRPO steps with optim.logprob_chunk=4 and model.gradient_checkpointing=true: the metrics of
    the same run without them."""
    runs = {}
    for name, extra in [("plain", []), ("lean", ["optim.logprob_chunk=4", "model.gradient_checkpointing=true"])]:
        tr = make_trainer(tmp_path / name, "train.max_steps=2", "algorithm.beta=0.04", "optim.micro_batch_size=3",
                          "reward.functions=[length]",
                          *extra)
        runs[name] = tr.train()
    for a, b in zip(runs["plain"], runs["lean"]):
        for key in ("reward", "loss", "grad_norm", "kl", "entropy"):
            assert b[key] == pytest.approx(a[key], abs=1e-5, rel=1e-5), key
    assert runs["plain"][-1]["grad_norm"] > 0


def test_bfloat16_trains_float32_master_weights_and_resumes_exactly(tmp_path, models):
    """model.dtype=bfloat16: AdamW steps float32 master copies (its state is float32), the model holds
    their bfloat16 rounding, updates below bfloat16's resolution accumulate in the masters, and the
    masters are in the checkpoint: 1 step + resume + 1 step is the 2-step run."""
    from grpolab.models.tiny_hf import save_tiny_model
    base = save_tiny_model(tmp_path / "llama", vocab_size=300, hidden=32, layers=2, heads=2, intermediate=64)
    args = [f"model.name_or_path={base}", "model.dtype=bfloat16", "reward.functions=[length]", "optim.lr=1e-5",
            "algorithm.beta=0.04"]
    tr = make_trainer(tmp_path / "whole", *args, "train.max_steps=2")
    trained = [p for p in tr.model.parameters() if p.requires_grad]
    start = [p.detach().float().clone() for p in trained]
    whole = tr.train()
    assert tr.master is not None and all(m.dtype == torch.float32 for m in tr.master.master)
    states = [s for s in tr.opt.state.values()]
    assert states and all(s["exp_avg"].dtype == torch.float32 == s["exp_avg_sq"].dtype for s in states)
    assert all(p.dtype == torch.bfloat16 and torch.equal(p, m.to(torch.bfloat16))
               for p, m in zip(trained, tr.master.master))
    moved_master = sum(int((m != s).sum()) for m, s in zip(tr.master.master, start))
    moved_only_there = sum(int(((m != s) & (p.float() == s)).sum())
                           for m, s, p in zip(tr.master.master, start, trained))
    assert moved_master > 0 and moved_only_there > 0.3 * moved_master   # lr 1e-5: most steps are below resolution

    make_trainer(tmp_path / "parts", *args, "train.max_steps=1").train()
    resumed = make_trainer(tmp_path / "parts", *args, "train.max_steps=2", "train.resume=auto")
    parts = resumed.train()
    strip = lambda ms: [{k: v for k, v in m.items() if not k.startswith(("time/", "perf/"))} for m in ms]
    assert strip(parts) == strip(whole)[1:]
    # the masters went on from the saved ones, not from the bfloat16 weights
    assert all(torch.equal(a, b) for a, b in zip(resumed.master.master, tr.master.master))


def _grouped_batch(V=90, P=3, G=4, L=6, C=9):
    """P prompts (left-padded to L, each of its own length) x G completions (right-padded, one stopped
    after a single token), rows grouped as the engine returns them."""
    g = torch.Generator().manual_seed(2)
    pid = torch.randint(0, V, (P, L), generator=g).repeat_interleave(G, 0)
    pm = torch.ones(P, L, dtype=torch.bool)
    pm[0, :2], pm[2, :4] = False, False
    pm = pm.repeat_interleave(G, 0)
    cid = torch.randint(0, V, (P * G, C), generator=g)
    cm = torch.ones(P * G, C, dtype=torch.bool)
    cm[1, 1:], cm[5, 4:], cm[10, 7:] = False, False, False
    return pid, pm, cid, cm


@pytest.mark.parametrize("chunk", [0, 4])
def test_shared_prompt_logprobs_and_gradients_equal_the_plain_ones(models, chunk):
    """optim.share_prompt: each group's prompt runs once (its KV cache, with autograd, serves the
    group). Log-probs, entropies and every parameter's gradient equal the plain pass's, written out
    independently above (full logits of each whole sequence)."""
    from grpolab.models.logprobs import _shared_prompt_hidden
    pid, pm, cid, cm = _grouped_batch()
    results = []
    for group in (0, 4):
        m = copy.deepcopy(models["llama"]).train()
        lp, ent = completion_logprobs(m, pid, pm, cid, cm, 0.9, with_entropy=True, entropy_grad=True, chunk=chunk,
                                      group=group)
        (lp.sum() + 0.1 * (ent * cm).sum()).backward()
        results.append((lp.detach(), ent.detach(), {k: p.grad for k, p in m.named_parameters()}))
    (lp0, ent0, g0), (lp1, ent1, g1) = results
    assert _shared_prompt_hidden(models["llama"], pid, pm, cid, cm, 4) is not None   # the shared path ran
    with torch.no_grad():
        plain = _plain_logprobs(models["llama"], pid, pm, cid, cm, 0.9)
    assert (lp1 - plain).abs().max() <= 1e-5 and lp1[cm].abs().min() > 0
    assert (lp1 - lp0).abs().max() <= 1e-5 and (ent1 - ent0).abs().max() <= 1e-5
    for k, g in g0.items():
        assert (g1[k] - g).abs().max() <= 1e-5 * max(1.0, float(g.abs().max())), k
    # rows that are not whole groups of one prompt take the plain path, same values
    mixed = torch.arange(12).roll(1)
    assert _shared_prompt_hidden(models["llama"], pid[mixed], pm[mixed], cid[mixed], cm[mixed], 4) is None
    with torch.no_grad():
        got = completion_logprobs(models["llama"], pid[mixed], pm[mixed], cid[mixed], cm[mixed], 0.9, group=4)
    assert (got - plain[mixed]).abs().max() <= 1e-5
