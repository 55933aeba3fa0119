"""The math of the offline stages, each against a plain re-computation: SFT masking, DPO losses,
distillation KLs, micro-batch invariance, packing."""

import math

import pytest
import torch

from grpolab.algorithms.losses import distill_kl, dpo_loss
from grpolab.config.load import load_config
from grpolab.data.supervised import collate, encode, fit_length, pack, sft_rows
from grpolab.models import GPT, CharTokenizer, GPTConfig
from grpolab.models.hf import load_hf
from grpolab.models.tiny_hf import save_tiny_model


def _logsig(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x > 0 else x - math.log1p(math.exp(x))


# ---------------------------------------------------------------------------- DPO

def _plain_dpo(c, r, rc, rr, beta, kind, eps):
    h = (c - rc) - (r - rr)
    if kind == "sigmoid":
        loss = -(1 - eps) * _logsig(beta * h) - eps * _logsig(-beta * h)
    elif kind == "robust":
        loss = (-(1 - eps) * _logsig(beta * h) + eps * _logsig(-beta * h)) / (1 - 2 * eps)
    elif kind == "hinge":
        loss = max(0.0, 1 - beta * h)
    else:   # ipo
        loss = (h - 1 / (2 * beta)) ** 2
    return loss, beta * (c - rc), beta * (r - rr)


@pytest.mark.parametrize("kind,eps", [("sigmoid", 0.0), ("sigmoid", 0.1), ("robust", 0.2), ("hinge", 0.0),
                                      ("ipo", 0.0)])
def test_dpo_losses_match_a_plain_computation(kind, eps):
    g = torch.Generator().manual_seed(1)
    c, r, rc, rr = (torch.randn(6, generator=g, dtype=torch.float64) * 3 - 10 for _ in range(4))
    beta = 0.3
    losses, cw, rw = dpo_loss(c, r, rc, rr, beta=beta, loss_type=kind, label_smoothing=eps)
    for i in range(6):
        want = _plain_dpo(float(c[i]), float(r[i]), float(rc[i]), float(rr[i]), beta, kind, eps)
        assert float(losses[i]) == pytest.approx(want[0], rel=1e-9, abs=1e-12)
        assert float(cw[i]) == pytest.approx(want[1], rel=1e-12)
        assert float(rw[i]) == pytest.approx(want[2], rel=1e-12)


def test_dpo_gradient_pushes_chosen_up_and_rejected_down():
    c = torch.tensor([-5.0], requires_grad=True)
    r = torch.tensor([-5.0], requires_grad=True)
    losses, _, _ = dpo_loss(c, r, torch.tensor([-5.0]), torch.tensor([-5.0]), beta=0.1)
    losses.sum().backward()
    assert c.grad.item() < 0 < r.grad.item()   # descending the loss raises chosen, lowers rejected
    assert losses.item() == pytest.approx(math.log(2))   # h = 0: -log sigmoid(0)


def test_dpo_rejects_bad_settings():
    x = torch.zeros(2)
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(x, x, x, x, beta=0.1, loss_type="robust", label_smoothing=0.5)
    with pytest.raises(ValueError, match="unknown DPO loss_type"):
        dpo_loss(x, x, x, x, beta=0.1, loss_type="kto")


# ---------------------------------------------------------------------------- distillation

def _plain_softmax(xs):
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    return [v / sum(e) for v in e]


@pytest.mark.parametrize("direction", ["forward", "reverse"])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_distill_kl_matches_a_plain_computation(direction, temperature):
    g = torch.Generator().manual_seed(2)
    s, t = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    got = distill_kl(s, t, direction=direction, temperature=temperature)
    for i in range(3):
        ps = _plain_softmax([x / temperature for x in s[i].tolist()])
        pt = _plain_softmax([x / temperature for x in t[i].tolist()])
        p, q = (pt, ps) if direction == "forward" else (ps, pt)
        want = sum(a * (math.log(a) - math.log(b)) for a, b in zip(p, q)) * temperature ** 2
        assert float(got[i]) == pytest.approx(want, rel=1e-5)
    assert float(distill_kl(s, s, direction=direction)[0]) == pytest.approx(0.0, abs=1e-6)


# ---------------------------------------------------------------------------- SFT masking

def _marked(tok, ids, mask):
    return tok.decode([i for i, m in zip(ids, mask) if m], skip_special=False)


def test_char_conversation_trains_only_the_assistant_turns():
    tok = CharTokenizer()
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+1?"},
            {"role": "assistant", "content": "#### 2"}, {"role": "user", "content": "and 2+2?"},
            {"role": "assistant", "content": "#### 4"}]
    ids, mask = tok.render_conversation(msgs)
    assert _marked(tok, ids, mask) == "#### 2<|end|>#### 4<|end|>"
    assert _marked(tok, *tok.render_conversation(msgs, train_from=3)) == "#### 4<|end|>"   # earlier turns: context
    assert tok.decode(ids, skip_special=False) == ("<|bos|><|user|>be brief\n1+1?<|assistant|>#### 2<|end|>"
                                                    "<|user|>and 2+2?<|assistant|>#### 4<|end|>")
    # a single-turn conversation is the prompt/completion rendering the RL sampler continues from
    one = encode(tok, sft_rows([{"messages": msgs[1:3]}])[0])
    two = encode(tok, {"prompt": "1+1?", "completion": "#### 2"})
    assert (one.ids, one.loss) == (two.ids, two.loss)
    assert one.ids[:len(tok.render_prompt("1+1?"))] == tok.render_prompt("1+1?")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = save_tiny_model(tmp_path_factory.mktemp("llama") / "m", vocab_size=300, hidden=32, layers=2, heads=2,
                           intermediate=64)
    return load_hf(str(path))


def test_hf_conversation_masks_the_assistant_turns_as_the_template_renders_them(tiny_llama):
    _, tok = tiny_llama
    msgs = [{"role": "user", "content": "What is 3 + 4?"}, {"role": "assistant", "content": "3+4=7 #### 7"},
            {"role": "user", "content": "Double it."}, {"role": "assistant", "content": "#### 14"}]
    ids, mask = tok.render_conversation(msgs)
    assert ids == tok.tok(tok.tok.apply_chat_template(msgs, tokenize=False), add_special_tokens=False)["input_ids"]
    text = tok.decode([i for i, m in zip(ids, mask) if m], skip_special=False)
    assert text.replace(" ", "") == "3+4=7####7<|im_end|>\n####14<|im_end|>\n".replace(" ", "")
    assert "Double" not in text and "user" not in text
    ids2, mask2 = tok.render_conversation(msgs, train_from=2)   # prompt/completion: only the last turn
    assert tok.decode([i for i, m in zip(ids2, mask2) if m]).replace(" ", "") == "####14\n"


def test_padding_and_prompt_tokens_are_never_in_the_loss():
    tok = CharTokenizer()
    rows = sft_rows([{"prompt": "a long prompt here", "completion": "x"}, {"prompt": "p", "completion": "yz"}])
    b = collate([encode(tok, r) for r in rows], tok.pad_id)
    assert b["loss"].sum(1).tolist() == [2, 3]     # 'x' + stop, 'yz' + stop
    assert not (b["loss"] & ~b["valid"]).any()      # no padding
    assert tok.decode(b["ids"][0][b["loss"][0]].tolist()) == "x"


def test_length_policy_truncates_drops_or_errors():
    from grpolab.errors import DataError
    tok = CharTokenizer()
    ex = [encode(tok, {"prompt": "p" * 10, "completion": "c" * 10}), encode(tok, {"prompt": "q", "completion": "ok"})]
    kept, t, d = fit_length(ex, 16, "truncate")
    assert (t, d) == (1, 0) and len(kept[0].ids) == 16 and kept[1] is ex[1]
    kept, t, d = fit_length(ex, 12, "truncate")   # the prompt alone fills 12: no completion token left
    assert kept[0] is None and (t, d) == (0, 1)
    assert fit_length(ex, 16, "drop")[0][0] is None
    with pytest.raises(DataError, match="row 1: 24 tokens, over sft.max_length=16"):
        fit_length(ex, 16, "error")


# ---------------------------------------------------------------------------- trainers: micro-batches, packing

ROWS = [{"prompt": f"{a} plus {b}?", "completion": f"{a}+{b}={a + b}\n#### {a + b}"} for a, b in
        [(1, 2), (13, 4), (5, 55), (7, 1), (2, 9), (30, 3)]]


def _grads(model):
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _loss_and_grads(trainer, units, mb):
    trainer.model.zero_grad(set_to_none=True)
    total = trainer.weight(units)
    loss = 0.0
    for i in range(0, len(units), mb):
        part, _ = trainer.micro_loss(units[i:i + mb], total)
        part.backward()
        loss += float(part.detach())
    return loss, _grads(trainer.model)


def _gpt():
    torch.manual_seed(0)
    tok = CharTokenizer()
    return GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=2, n_head=2, n_embd=32, block_size=96)), tok


def _sft(model, tok, *over):
    from grpolab.train.sft import SFTTrainer
    return SFTTrainer(load_config(None, ["sft.steps=1", *over]), model, tok, sft_rows(ROWS))


def test_sft_loss_is_the_mean_token_cross_entropy_and_micro_batch_invariant():
    model, tok = _gpt()
    tr = _sft(model, tok)
    units = tr.units(ROWS)
    whole, g1 = _loss_and_grads(tr, units, len(units))
    parts, g2 = _loss_and_grads(tr, units, 2)
    # plain: -log softmax at every completion token, averaged over all of them
    nll, n = 0.0, 0
    with torch.no_grad():
        for e in units:
            logits = model(torch.tensor([e.ids[:-1]]))[0].double()
            for t in range(1, len(e.ids)):
                if e.loss[t]:
                    nll -= float(logits[t - 1].log_softmax(-1)[e.ids[t]])
                    n += 1
    assert whole == pytest.approx(nll / n, rel=1e-5)
    assert parts == pytest.approx(whole, rel=1e-5)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_packing_gives_the_unpacked_loss_and_gradient_gpt():
    model, tok = _gpt()
    plain, packed = _sft(model, tok), _sft(model, tok, "sft.packing=true", "sft.max_length=90")
    units = plain.units(ROWS)
    assert len(pack(units, 90)) < len(units)   # it does pack
    l1, g1 = _loss_and_grads(plain, units, len(units))
    l2, g2 = _loss_and_grads(packed, units, len(units))
    assert l2 == pytest.approx(l1, rel=1e-5)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_packing_gives_the_unpacked_loss_hf(tiny_llama):
    model, tok = tiny_llama
    plain, packed = _sft(model, tok), _sft(model, tok, "sft.packing=true", "sft.max_length=120")
    units = plain.units(ROWS)
    assert len(pack(units, 120)) < len(units)
    with torch.no_grad():
        l1 = float(plain.micro_loss(units, plain.weight(units))[0])
        l2 = float(packed.micro_loss(units, packed.weight(units))[0])
    assert l2 == pytest.approx(l1, rel=1e-5)


PAIRS = [{"prompt": r["prompt"], "chosen": r["completion"], "rejected": f"#### {i}"} for i, r in enumerate(ROWS)]


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_trainer_loss_is_the_pair_mean_of_dpo_loss_and_micro_batch_invariant(loss_type):
    from grpolab.train.dpo import DPOTrainer
    model, tok = _gpt()
    tr = DPOTrainer(load_config(None, ["dpo.steps=1", f"dpo.loss_type={loss_type}"]), model, tok, PAIRS)
    with torch.no_grad():   # the policy moves away from the reference, so the loss is not log 2 everywhere
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    units = tr.units(PAIRS)
    whole, g1 = _loss_and_grads(tr, units, len(units))
    parts, g2 = _loss_and_grads(tr, units, 4)
    # plain: sequence log-probs of each side from per-token log-softmax, then the formula
    def seq(m, e):
        logits = m(torch.tensor([e.ids[:-1]]))[0].double().log_softmax(-1)
        lp = [float(logits[t - 1, e.ids[t]]) for t in range(1, len(e.ids)) if e.loss[t]]
        return sum(lp) / (len(lp) if loss_type == "ipo" else 1)
    with torch.no_grad():
        want = sum(_plain_dpo(seq(model, c), seq(model, r), seq(tr.ref, c), seq(tr.ref, r), 0.1, loss_type, 0.0)[0]
                   for c, r in units) / len(units)
    assert whole == pytest.approx(want, rel=1e-4)
    assert parts == pytest.approx(whole, rel=1e-5)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kl", ["forward", "reverse"])
def test_distill_trainer_loss_is_the_token_mean_kl_and_micro_batch_invariant(kl):
    from grpolab.train.distill import DistillTrainer
    student, tok = _gpt()
    torch.manual_seed(5)
    teacher = GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_embd=32, block_size=96))
    tr = DistillTrainer(load_config(None, ["distill.steps=1", f"distill.kl={kl}", "distill.temperature=2.0"]),
                        student, tok, teacher, sft_rows(ROWS))
    units = tr.units(sft_rows(ROWS))
    whole, g1 = _loss_and_grads(tr, units, len(units))
    parts, g2 = _loss_and_grads(tr, units, 4)
    total, n = 0.0, 0
    with torch.no_grad():
        for e in units:
            s = student(torch.tensor([e.ids[:-1]]))[0]
            t = teacher(torch.tensor([e.ids[:-1]]))[0]
            for pos in range(1, len(e.ids)):
                if e.loss[pos]:
                    ps = _plain_softmax((s[pos - 1] / 2).tolist())
                    pt = _plain_softmax((t[pos - 1] / 2).tolist())
                    p, q = (pt, ps) if kl == "forward" else (ps, pt)
                    total += sum(a * (math.log(a) - math.log(b)) for a, b in zip(p, q)) * 4
                    n += 1
    assert whole == pytest.approx(total / n, rel=1e-4)
    assert parts == pytest.approx(whole, rel=1e-5)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_dpo_under_lora_uses_the_adapter_off_model_as_reference():
    """No copy: the reference is the policy with its adapters off. LoRA starts as the identity, so the
    first step's implicit rewards are exactly 0; after a step they move while the reference does not."""
    from grpolab.train.dpo import DPOTrainer
    model, tok = _gpt()
    base = {k: v.clone() for k, v in model.state_dict().items()}
    tr = DPOTrainer(load_config(None, ["dpo.steps=2", "dpo.batch_size=6", "dpo.lr=1e-2", "model.lora_rank=4"]),
                    model, tok, PAIRS)
    assert tr.ref is None and tr.ref_model is None
    units = tr.units(PAIRS)
    with torch.no_grad():
        loss, sums = tr.micro_loss(units, len(units))
    assert sums["rewards/chosen"] == 0.0 and sums["rewards/margins"] == 0.0
    assert float(loss) == pytest.approx(math.log(2))
    first = tr.train_step()
    second = tr.train_step()
    assert first["rewards/margins"] == 0.0 and second["rewards/margins"] > 0
    frozen = {n.replace("base_layer.", ""): p for n, p in model.named_parameters() if "lora_" not in n}
    assert set(frozen) == set(base) and all(torch.equal(p, base[n]) for n, p in frozen.items())   # never moved
