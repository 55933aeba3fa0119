"""Exactness of the trainer's pieces, each checked against a plain recomputation: the lr schedule
(and a skipped step), micro-batching, ignore_eos, length metrics, the entropy bonus, padding."""

import copy
import math

import pytest
import torch
from test_grpo import make_trainer

from grpolab.config.load import load_config
from grpolab.train.schedule import lr_factor
from grpolab.train.sft import sft_batch, sft_lr_factor
from grpolab.utils.padding import pad_sequences, pad_to_width

# ---------------------------------------------------------------- lr schedule

def _old_rl_factor(step, warmup, total, schedule):
    """The GRPO schedule as grpo.py computed it before it moved to schedule.py."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant" or total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


@pytest.mark.parametrize("warmup,steps", [(0, 10), (1, 10), (3, 10), (20, 600), (5, 5), (10, 3), (7, 1)])
def test_schedules_are_bit_identical_to_the_old_lambdas(warmup, steps):
    old_sft = lambda s: min(1.0, (s + 1) / max(1, warmup)) * max(0.0, 1 - s / max(1, steps))  # noqa: E731
    for s in range(steps + 3):
        assert sft_lr_factor(s, warmup, steps) == old_sft(s), s          # ==: the demo's numbers do not move
        for schedule in ("constant", "linear", "cosine"):
            assert lr_factor(s, warmup, steps, schedule) == _old_rl_factor(s, warmup, steps, schedule), (s, schedule)


def test_warmup_starts_at_one_over_warmup_not_zero():
    assert [lr_factor(s, 4, 100, "constant") for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]


# ---------------------------------------------------------------- a skipped step

def _poisoned_batch(tr):
    batch, _ = tr.collect()
    tr.advantages(batch, None)
    batch.advantages[0] = float("nan")   # a non-finite value reaches the loss
    return batch


def test_skipped_step_does_not_advance_the_lr_schedule(tmp_path):
    tr = make_trainer(tmp_path, "reward.functions=[length]", "optim.warmup_steps=4", "train.max_bad_steps=3")
    lr0, epoch0 = tr.opt.param_groups[0]["lr"], tr.sched.last_epoch
    assert lr0 == pytest.approx(tr.cfg.optim.lr / 4)
    out = tr.update(_poisoned_batch(tr))
    assert tr.bad_steps == 1 and out["lr"] == lr0
    assert tr.opt.param_groups[0]["lr"] == lr0 and tr.sched.last_epoch == epoch0
    # the next good step uses the same rate the skipped one would have, then the schedule moves on
    batch, _ = tr.collect()
    tr.advantages(batch, None)
    assert tr.update(batch)["lr"] == lr0
    assert tr.sched.last_epoch == epoch0 + 1 and tr.opt.param_groups[0]["lr"] == pytest.approx(2 * lr0)


# ---------------------------------------------------------------- micro-batching end to end

@pytest.mark.parametrize("agg,extra", [("token-mean", []), ("seq-mean-token-mean", []),
                                       ("seq-mean-token-sum-norm", ["algorithm.num_iterations=2"]),
                                       ("token-mean", ["algorithm.num_iterations=2"])],
                         ids=["token-mean-mu1", "seq-mean-token-mean-mu1", "seq-mean-token-sum-norm-mu2",
                              "token-mean-mu2"])
def test_update_is_independent_of_micro_batch_size(tmp_path, agg, extra):
    """1, 3 (uneven slices of the 8 rows) and 0 (all at once) give the same parameters after a step."""
    args = ["algorithm.beta=0.04", "reward.functions=[length]", "optim.lr=1e-3", "optim.warmup_steps=0",
            f"algorithm.loss_agg_mode={agg}", *extra]
    results = {}
    for mbs in (0, 1, 3):
        tr = make_trainer(tmp_path / str(mbs), *args, f"optim.micro_batch_size={mbs}")
        start = copy.deepcopy(tr.model.state_dict())
        m = tr.train_step()
        grads = {n: p.grad.clone() for n, p in tr.model.named_parameters()}   # the last pass's gradient
        results[mbs] = (start, tr.model.state_dict(), grads, m)
    start, want, want_grads, m0 = results[0]
    moved = max(float((want[k] - start[k]).abs().max()) for k in want)
    assert moved > 1e-4   # the step really changed the weights, far beyond the tolerance
    for mbs in (1, 3):
        s, got, grads, m = results[mbs]
        assert all(torch.equal(start[k], s[k]) for k in start)   # same starting point
        for k in want:
            # Adam divides by sqrt(v) + 1e-8, so an entry whose gradient is near 1e-8 moves by an amount that
            # rounding in the gradient changes a lot: those entries are held to the gradient check below
            big = want_grads[k].abs() > 1e-7 if k in want_grads else torch.ones_like(want[k], dtype=torch.bool)
            torch.testing.assert_close(got[k][big], want[k][big], atol=1e-6, rtol=0, msg=f"mbs={mbs} {k}")
        # Adam's first step is nearly sign(gradient), blind to how the gradient is scaled: check it too
        for k in want_grads:
            scale = float(want_grads[k].abs().max())
            torch.testing.assert_close(grads[k], want_grads[k], atol=1e-5 * scale, rtol=1e-4, msg=f"mbs={mbs} {k}")
        for key in ("grad_norm", "kl", "entropy", "reward"):
            assert m[key] == pytest.approx(m0[key], rel=1e-5), (mbs, key)
        assert m["loss"] == pytest.approx(m0["loss"], abs=1e-7)


# ---------------------------------------------------------------- rollout.ignore_eos

def test_ignore_eos_runs_every_completion_to_max_new_tokens(tmp_path):
    L = 40
    runs = {}
    for flag in ("false", "true"):
        tr = make_trainer(tmp_path / flag, f"rollout.ignore_eos={flag}", f"rollout.max_new_tokens={L}")
        runs[flag] = (tr, tr.rollout().gen)
    tr, stopped = runs["false"]
    full_tr, full = runs["true"]
    stops = torch.tensor(tr.tok.stop_ids)
    assert (~stopped.truncated).any()   # without the key some completions end at the stop token
    assert full.completion_ids.shape[1] == L and bool(full.completion_mask.all()) and bool(full.truncated.all())
    # same random draws: up to each row's stop, the tokens are the ones the stopping rollout sampled ...
    m = stopped.completion_mask
    W = m.size(1)
    assert torch.equal(full.completion_ids[:, :W][m], stopped.completion_ids[m])
    torch.testing.assert_close(full.sampler_logprobs[:, :W][m], stopped.sampler_logprobs[m])
    # ... and there the stop token was sampled without ending the completion
    for i in (~stopped.truncated).nonzero().flatten().tolist():
        last = int(m[i].sum()) - 1
        assert bool(torch.isin(full.completion_ids[i, last], stops)) and last < L - 1
    metrics = full_tr.train_step()
    assert metrics["completions/mean_length"] == L and metrics["completions/clipped_ratio"] == 1.0


def test_ignore_eos_key_is_a_bool_defaulting_to_false():
    assert load_config().rollout.ignore_eos is False
    assert load_config(None, ["rollout.ignore_eos=true"]).rollout.ignore_eos is True
    with pytest.raises(Exception, match="rollout.ignore_eos: expected bool"):
        load_config(None, ["rollout.ignore_eos=sometimes"])


# ---------------------------------------------------------------- length metrics

def test_length_metrics_equal_the_lengths_counted_plainly(tmp_path):
    L = 40
    tr = make_trainer(tmp_path, f"rollout.max_new_tokens={L}", "rollout.prompts_per_step=4")
    stops = set(tr.tok.stop_ids)
    for _ in range(2):
        m = tr.train_step()
        lengths, cut = [], []
        for row in tr.last_batch.gen.completion_ids.tolist():
            first = next((i for i, t in enumerate(row) if t in stops), None)
            lengths.append(L if first is None else first + 1)   # the stop token counts
            cut.append(first is None)
        assert 0 < sum(cut) < len(cut)   # a mix of stopped and cut completions, so the check means something
        assert m["completions/mean_length"] == pytest.approx(sum(lengths) / len(lengths), abs=1e-9)
        assert m["completions/clipped_ratio"] == pytest.approx(sum(cut) / len(cut), abs=1e-9)


# ---------------------------------------------------------------- entropy bonus

@pytest.mark.parametrize("coef", [0.5, 0.1])
def test_entropy_bonus_gradient_is_minus_coef_times_the_entropy_gradient(tmp_path, coef):
    """With zero advantages the only gradient is -coef * d(mean token entropy)/d(theta); computed here
    row by row on the unpadded sequences, so a sign flip (or a wrong mean) fails."""
    tr = make_trainer(tmp_path, f"algorithm.entropy_coef={coef}", "optim.max_grad_norm=0", "rollout.temperature=0.8")
    batch, _ = tr.collect()
    batch.advantages = torch.zeros(len(batch))
    before = copy.deepcopy(tr.model)
    tr.update(batch)
    got = {n: p.grad.clone() for n, p in tr.model.named_parameters()}

    g = batch.gen
    total, n_tok = 0.0, int(g.completion_mask.sum())
    before.train()
    for i in range(len(batch)):
        prompt = g.prompt_ids[i][g.prompt_mask[i]]
        comp = g.completion_ids[i][g.completion_mask[i]]
        seq = torch.cat([prompt, comp])[None]
        logits = before(seq)[0, len(prompt) - 1:-1].float() / 0.8
        p = logits.softmax(-1)
        total = total + -(p * logits.log_softmax(-1)).sum() / n_tok
    total.backward()
    for n, p in before.named_parameters():
        want = -coef * p.grad
        torch.testing.assert_close(got[n], want, atol=1e-6, rtol=1e-4, msg=n)
    assert max(float(v.abs().max()) for v in got.values()) > 1e-4


# ---------------------------------------------------------------- padding

def test_pad_sequences_and_pad_to_width():
    ids, mask = pad_sequences([[1, 2, 3], [4], []], pad_id=9, side="left")
    assert ids.tolist() == [[1, 2, 3], [9, 9, 4], [9, 9, 9]]
    assert mask.tolist() == [[True] * 3, [False, False, True], [False] * 3] and mask.dtype == torch.bool
    ids, mask = pad_sequences([[1, 2, 3], [4]], pad_id=0, side="right")
    assert ids.tolist() == [[1, 2, 3], [4, 0, 0]] and mask.tolist() == [[True] * 3, [True, False, False]]
    t = torch.tensor([[1.0, 2.0]], requires_grad=True)
    out = pad_to_width(t, 4, 0.5, side="left")
    assert out.tolist() == [[0.5, 0.5, 1.0, 2.0]] and out.requires_grad
    assert pad_to_width(t, 4, 0.0).tolist() == [[1.0, 2.0, 0.0, 0.0]]
    assert pad_to_width(t, 2, 0.0) is t
    assert pad_to_width(torch.tensor([[True]]), 3, False).tolist() == [[True, False, False]]
    with pytest.raises(ValueError, match=r"side must be 'left' or 'right', got 'middle'"):
        pad_sequences([[1]], 0, side="middle")


def test_sft_batch_is_right_padded_with_the_answer_masked(tok):
    rows = [{"prompt": "1+1?", "answer": "#### 2"}, {"prompt": "Sum 10 and 20?", "answer": "#### 30"}]
    ids, valid, loss_mask = sft_batch(tok, rows)
    for i, r in enumerate(rows):
        p, c = tok.render_prompt(r["prompt"]), tok.render_completion(r["answer"])
        n = len(p) + len(c)
        assert ids[i, :n].tolist() == p + c and (ids[i, n:] == tok.pad_id).all()
        assert valid[i].tolist() == [True] * n + [False] * (ids.size(1) - n)
        assert loss_mask[i].tolist() == [False] * len(p) + [True] * len(c) + [False] * (ids.size(1) - n)
