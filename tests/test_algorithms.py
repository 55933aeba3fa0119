"""Each formula against a plain re-computation written out here."""

import math

import pytest
import torch

from grpolab.algorithms.advantages import compute_advantages
from grpolab.algorithms.aggregate import AGG_MODES, aggregate
from grpolab.algorithms.kl import kl_penalty
from grpolab.algorithms.losses import compute_policy_loss


def test_grpo_advantages_match_plain_zscore():
    rewards = [1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5, 2.0, -1.0, 0.0, 3.0]
    groups = [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]
    eps = 1e-4
    want = []
    for g in range(3):
        rs = [r for r, gi in zip(rewards, groups) if gi == g]
        mean = sum(rs) / len(rs)
        std = math.sqrt(sum((r - mean) ** 2 for r in rs) / len(rs))
        want += [(r - mean) / (std + eps) for r in rs]
    got = compute_advantages(torch.tensor(rewards), torch.tensor(groups), "grpo", eps=eps)
    torch.testing.assert_close(got, torch.tensor(want), atol=1e-5, rtol=1e-5)
    # identical rewards in a group -> exactly zero advantage
    assert got[4:8].abs().max() == 0


def test_unbiased_std_and_mean_only_and_groups_of_one():
    r = torch.tensor([1.0, 0.0, 0.0, 7.0])
    g = torch.tensor([0, 0, 0, 1])
    unb = compute_advantages(r, g, "grpo", eps=0.0, unbiased_std=True)
    mean = 1 / 3
    std = math.sqrt(((1 - mean) ** 2 + 2 * mean ** 2) / 2)
    torch.testing.assert_close(unb[:3], torch.tensor([(1 - mean) / std, -mean / std, -mean / std]))
    assert unb[3] == 0  # a group of one has no baseline: advantage 0
    none = compute_advantages(r, g, "grpo", scale_rewards="none")
    torch.testing.assert_close(none, torch.tensor([1 - mean, -mean, -mean, 0.0]))
    torch.testing.assert_close(compute_advantages(r, g, "dr_grpo"), none)


def test_group_ids_need_not_be_contiguous():
    r = torch.tensor([1.0, 5.0, 0.0, 3.0])
    g = torch.tensor([7, 2, 7, 2])
    got = compute_advantages(r, g, "grpo", scale_rewards="none")
    torch.testing.assert_close(got, torch.tensor([0.5, 1.0, -0.5, -1.0]))


def _plain_clip(logp, old, adv, eps_lo, eps_hi, c=None):
    out = []
    for lp, o, a in zip(logp, old, adv):
        r = math.exp(lp - o)
        lo = -a * r
        hi = -a * min(max(r, 1 - eps_lo), 1 + eps_hi)
        l_ = max(lo, hi)
        if c is not None and a < 0:
            l_ = min(l_, -a * c)
        out.append(l_)
    return out


def test_clip_loss_matches_formula_for_ratios_far_outside_the_range():
    logp = torch.tensor([[0.0, -0.1, -3.0, 0.5, -0.2, 1.2]])
    old = torch.tensor([[0.0, -0.5, -0.2, -1.5, -0.2, 0.1]])
    adv = torch.tensor([[1.5, -2.0, 1.0, -0.5, 0.7, -1.0]])
    mask = torch.ones_like(logp)
    for eps_hi, c in [(None, None), (0.28, None), (0.28, 3.0)]:
        want = _plain_clip(logp[0].tolist(), old[0].tolist(), adv[0].tolist(), 0.2, eps_hi or 0.2, c)
        loss, m = compute_policy_loss(logp, old, adv, mask, epsilon=0.2, epsilon_high=eps_hi, clip_ratio_c=c)
        assert loss.item() == pytest.approx(sum(want) / len(want), rel=1e-6)
    # dual clip actually binds on token 3 (A<0, ratio e^2): -A*c = 1.5 < -A*r
    l_nodual, _ = compute_policy_loss(logp, old, adv, mask, epsilon=0.2)
    l_dual, _ = compute_policy_loss(logp, old, adv, mask, epsilon=0.2, clip_ratio_c=3.0)
    assert l_dual < l_nodual


def test_clip_metrics_count_clipped_tokens():
    logp = torch.tensor([[0.0, 1.0, -1.0, 0.0]])
    old = torch.zeros(1, 4)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])[None]
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    _, m = compute_policy_loss(logp, old, adv, mask, epsilon=0.2)
    assert m["clip_ratio/high_sum"] == 1 and m["clip_ratio/low_sum"] == 1 and m["clip_ratio/region_sum"] == 2


def test_on_policy_gradient_is_minus_advantage_times_score():
    # with old == logp (detached), d loss / d logp = -A / N_tokens under token-mean
    logp = torch.tensor([[-0.3, -1.2, -0.7]], requires_grad=True)
    adv = torch.tensor([2.0])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, _ = compute_policy_loss(logp, logp.detach(), adv, mask)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.0, -1.0, 0.0]]))


def test_kl_estimators_match_formulas():
    lp = torch.tensor([[-0.1, -2.0, -0.5]])
    ref = torch.tensor([[-0.3, -0.4, -0.5]])
    d = [a - b for a, b in zip(lp[0].tolist(), ref[0].tolist())]
    torch.testing.assert_close(kl_penalty(lp, ref, "k1")[0], torch.tensor(d))
    torch.testing.assert_close(kl_penalty(lp, ref, "k2")[0], torch.tensor([x * x / 2 for x in d]))
    torch.testing.assert_close(kl_penalty(lp, ref, "k3")[0], torch.tensor([math.exp(-x) - 1 + x for x in d]))
    assert (kl_penalty(lp, ref, "k3") >= 0).all()
    assert kl_penalty(torch.tensor([[-30.0]]), torch.tensor([[0.0]]), "k3").item() == 10.0  # clamped


def test_aggregation_modes_match_plain_sums():
    L = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 0.0], [9.0, 9.0, 9.0]])
    M = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])  # row 2 has no active token
    assert aggregate(L, M, "token-mean").item() == pytest.approx((1 + 2 + 3 + 4 + 5) / 5)
    assert aggregate(L, M, "seq-mean-token-mean").item() == pytest.approx(((6 / 3) + (9 / 2)) / 2)
    assert aggregate(L, M, "seq-mean-token-sum").item() == pytest.approx((6 + 9) / 2)
    assert aggregate(L, M, "seq-mean-token-sum-norm", max_new_tokens=3).item() == pytest.approx(15 / (2 * 3))


@pytest.mark.parametrize("mode", AGG_MODES)
def test_gradient_is_invariant_to_micro_batch_size(mode):
    torch.manual_seed(0)
    B, T = 6, 5
    base = torch.randn(B, T)
    old = base + 0.1 * torch.randn(B, T)
    ref = base + 0.1 * torch.randn(B, T)
    adv = torch.randn(B)
    mask = (torch.rand(B, T) > 0.3).float()
    mask[2] = 0  # a row with nothing to learn
    n_tok, n_seq = float(mask.sum()), float((mask.sum(-1) > 0).sum())
    grads = []
    for mb in (1, 2, B):
        logp = base.clone().requires_grad_(True)
        for i in range(0, B, mb):
            s = slice(i, i + mb)
            kw = dict(global_tokens=n_tok, global_seqs=n_seq, max_new_tokens=T)
            loss, _ = compute_policy_loss(logp[s], old[s], adv[s], mask[s], loss_agg_mode=mode, epsilon=0.2, **kw)
            loss = loss + 0.04 * aggregate(kl_penalty(logp[s], ref[s]), mask[s], mode, **kw)
            loss.backward()
        grads.append(logp.grad.clone())
    torch.testing.assert_close(grads[0], grads[2], atol=1e-6, rtol=0)
    torch.testing.assert_close(grads[1], grads[2], atol=1e-6, rtol=0)
