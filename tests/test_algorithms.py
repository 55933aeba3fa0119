"""Each formula against a plain re-computation written out here (python loops and math, not tensor code)."""

import math

import pytest
import torch

from grpolab.algorithms.aggregate import aggregate
from grpolab.algorithms.estimators import compute_advantages, get_estimator
from grpolab.algorithms.kl import apply_kl_in_reward, kl_penalty
from grpolab.algorithms.losses import compute_policy_loss
from grpolab.algorithms.ref_sync import ref_sync
from grpolab.algorithms.shaping import dynamic_sampling_keep, overlong_penalty
from grpolab.config.names import ADV_ESTIMATORS, AGG_MODES, KL_ESTIMATORS, POLICY_LOSSES, SCALE_REWARDS, load
from grpolab.config.presets import PRESET_KEYS, PRESETS, apply_preset


def policy_loss(name: str):
    return load(POLICY_LOSSES, name, "algorithm.policy_loss")


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


# ----------------------------------------------------------------------------- advantages

# groups: 0 mixed, 1 identical rewards, 2 mixed with a tie at the top, 3 a group of one
REWARDS = [1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 2.0, -1.0, 3.0, 3.0, 0.25, 7.0]
GROUPS = [0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2, 2, 3]


def _groups(rewards, groups):
    out = {}
    for i, (r, g) in enumerate(zip(rewards, groups)):
        out.setdefault(g, []).append((i, r))
    return out


def _mean(xs):
    return sum(xs) / len(xs)


def _std(xs, unbiased=False):
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1 if unbiased else len(xs)))


def _adv(estimator, **opts):
    return compute_advantages(torch.tensor(REWARDS), torch.tensor(GROUPS), estimator, **opts)


def test_registered_names():
    assert set(ADV_ESTIMATORS) == {"grpo", "dr_grpo", "rloo", "reinforce_baseline", "grpo_passk", "gae",
                                   "reinforce_plus_plus", "remax"}
    assert {n for n in ADV_ESTIMATORS if get_estimator(n).token_level} == {"gae", "reinforce_plus_plus", "remax"}
    assert [n for n in ADV_ESTIMATORS if get_estimator(n).critic] == ["gae"]
    assert [n for n in ADV_ESTIMATORS if get_estimator(n).greedy] == ["remax"]
    assert set(POLICY_LOSSES) == {"clip", "gspo", "reinforce", "cispo"}
    assert set(KL_ESTIMATORS) == {"k1", "k2", "k3"}
    assert set(AGG_MODES) == {"token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"}


@pytest.mark.parametrize("unbiased", [False, True])
def test_grpo_batch_scaling_matches_plain(unbiased):
    eps = 1e-4
    std_b = _std(REWARDS, unbiased)
    want = [0.0] * len(REWARDS)
    for rows in _groups(REWARDS, GROUPS).values():
        if len(rows) > 1:
            m = _mean([r for _, r in rows])
            for i, r in rows:
                want[i] = (r - m) / (std_b + eps)
    got = _adv("grpo", eps=eps, unbiased_std=unbiased, scale_rewards="batch")
    torch.testing.assert_close(got, torch.tensor(want), atol=1e-5, rtol=1e-5)


def test_rloo_is_leave_one_out():
    want = [0.0] * len(REWARDS)
    for rows in _groups(REWARDS, GROUPS).values():
        for i, r in rows:
            others = [r2 for j, r2 in rows if j != i]
            want[i] = r - _mean(others) if others else 0.0
    got = _adv("rloo")
    torch.testing.assert_close(got, torch.tensor(want), atol=1e-6, rtol=1e-6)
    # the identity G/(G-1) * (r - mean) on group 0
    g0 = REWARDS[:4]
    assert got[0].item() == pytest.approx(4 / 3 * (g0[0] - _mean(g0)), abs=1e-6)


@pytest.mark.parametrize("unbiased", [False, True])
def test_reinforce_baseline_is_group_centred_then_batch_whitened(unbiased):
    eps = 1e-4
    x = [0.0] * len(REWARDS)
    in_batch = []
    for rows in _groups(REWARDS, GROUPS).values():
        if len(rows) > 1:
            m = _mean([r for _, r in rows])
            for i, r in rows:
                x[i] = r - m
                in_batch.append(i)
    xs = [x[i] for i in in_batch]
    mb, sb = _mean(xs), _std(xs, unbiased)
    want = [(x[i] - mb) / (sb + eps) if i in in_batch else 0.0 for i in range(len(REWARDS))]
    got = _adv("reinforce_baseline", eps=eps, unbiased_std=unbiased)
    torch.testing.assert_close(got, torch.tensor(want), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("scale", ["group", "none", "batch"])
def test_grpo_passk_only_the_best_learns(scale):
    eps = 1e-4
    rewards = list(REWARDS)
    rewards[1] = 0.75   # group 0 [1, .75, 0, 1.5]: lone best row 3, second 1.0
    rewards[3] = 1.5
    rewards[10] = 2.5   # group 2: unique best 3.0 (row 9), second 2.5
    want = [0.0] * len(rewards)
    for rows in _groups(rewards, GROUPS).values():
        if len(rows) < 2:
            continue
        rs = [r for _, r in rows]
        best = max(range(len(rows)), key=lambda k: (rs[k], -k))  # first argmax
        second = max(r for k, r in enumerate(rs) if k != best)
        div = {"group": _std(rs) + eps, "none": 1.0, "batch": _std(rewards) + eps}[scale]
        want[rows[best][0]] = (rs[best] - second) / div
    got = compute_advantages(torch.tensor(rewards), torch.tensor(GROUPS), "grpo_passk", eps=eps, scale_rewards=scale)
    torch.testing.assert_close(got, torch.tensor(want), atol=1e-6, rtol=1e-6)
    assert (got != 0).tolist() == [i in (3, 9) for i in range(len(rewards))]
    if scale == "none":
        assert got[3].item() == pytest.approx(0.5) and got[9].item() == pytest.approx(0.5)
    # a tie at the top (REWARDS: groups 0 and 2) gives the whole group 0, whichever row is "best"
    tied = compute_advantages(torch.tensor(REWARDS), torch.tensor(GROUPS), "grpo_passk", scale_rewards=scale)
    assert tied.abs().max() == 0


@pytest.mark.parametrize("estimator", sorted(n for n in ADV_ESTIMATORS if not get_estimator(n).token_level))
def test_every_estimator_identical_group_and_singleton_are_zero_and_opts_ignored(estimator):
    opts = dict(eps=1e-6, unbiased_std=True, scale_rewards="group", not_an_option=123)
    got = _adv(estimator, **opts)
    assert torch.isfinite(got).all()
    assert got[4:7].abs().max() < 1e-6      # identical rewards
    assert got[12] == 0                      # group of one
    assert got.dtype == torch.float32
    # a batch of nothing but identical groups and singletons: all exactly finite and ~0
    flat = compute_advantages(torch.tensor([2.0, 2.0, 5.0]), torch.tensor([0, 0, 1]), estimator, eps=0.0)
    assert torch.isfinite(flat).all() and flat.abs().max() < 1e-6


def test_unknown_estimator_and_scale_raise():
    with pytest.raises(ValueError, match="adv_estimator: 'ppo' is not one of grpo, "):
        _adv("ppo")
    with pytest.raises(ValueError, match="scale_rewards"):
        _adv("grpo", scale_rewards="global")


# ----------------------------------------------------------------------------- policy losses

LN5, LN001 = math.log(5.0), math.log(0.01)


def _plain_loss(name, lp, o, a, eps_lo=0.2, eps_hi=0.28, c=None):
    """Per-token loss of one token (clip, reinforce, cispo) from the published formula."""
    r = math.exp(lp - o)
    clip_r = min(max(r, 1 - eps_lo), 1 + eps_hi)
    if name == "clip":
        return _plain_clip([lp], [o], [a], eps_lo, eps_hi, c)[0]
    if name == "reinforce":
        return -a * lp
    if name == "cispo":
        return -clip_r * a * lp
    raise KeyError(name)


@pytest.mark.parametrize("name", ["clip", "reinforce", "cispo"])
@pytest.mark.parametrize("c", [None, 3.0])
def test_token_losses_match_formula_far_outside_the_range(name, c):
    # ratios 5 and 0.01 (far outside), 1 (inside), both advantage signs; last token masked
    old = [-1.0, -1.0, -1.0, -1.0, -0.5, -0.5, -2.0]
    lp = [-1.0 + LN5, -1.0 + LN5, -1.0 + LN001, -1.0 + LN001, -0.5, -0.5, -0.3]
    adv = [1.5, -2.0, 1.0, -0.5, 0.7, -1.0, 4.0]
    msk = [1, 1, 1, 1, 1, 1, 0]
    logp = torch.tensor([lp], requires_grad=True)
    mat, info = policy_loss(name)(logp, torch.tensor([old]), torch.tensor([adv]), torch.tensor([msk]),
                                    epsilon=0.2, epsilon_high=0.28, clip_ratio_c=c)
    want = [_plain_loss(name, *x, c=c) if m else 0.0 for *x, m in zip(lp, old, adv, msk)]
    torch.testing.assert_close(mat[0], torch.tensor(want), atol=1e-5, rtol=1e-5)
    assert mat.shape == logp.shape and info["clip_low"].shape == logp.shape
    low, high = info["clip_low"][0].tolist(), info["clip_high"][0].tolist()
    if name == "clip":   # clipped branch active: r out of range on the side the sign of A pushes
        assert low == [False, False, False, True, False, False, False]
        assert high == [True, False, False, False, False, False, False]
    elif name == "cispo":  # weight clipped, whatever the sign of A
        assert low == [False, False, True, True, False, False, False]
        assert high == [True, True, False, False, False, False, False]
    else:
        assert not any(low) and not any(high)


def test_dual_clip_binds_only_for_negative_advantages():
    # token 1: A<0, r=5 -> -A*r = 10 > -A*c = 6 -> 6 ; token 0: A>0, r=5 -> clipped at 1.28*(-A)
    logp = torch.tensor([[LN5, LN5, LN001]])
    old = torch.zeros(1, 3)
    adv = torch.tensor([[1.0, -2.0, -2.0]])
    mat, _ = policy_loss("clip")(logp, old, adv, torch.ones(1, 3), epsilon=0.2, epsilon_high=0.28, clip_ratio_c=3.0)
    torch.testing.assert_close(mat[0], torch.tensor([-1.28, 6.0, 2 * 0.8]))


def _plain_gspo(lp_rows, old_rows, adv_rows, mask_rows, eps_lo, eps_hi):
    """GSPO per-token loss matrix and clip flags from the sequence ratio, written out."""
    mats, lows, highs = [], [], []
    for lp, o, a, m in zip(lp_rows, old_rows, adv_rows, mask_rows):
        act = [x - y for x, y, k in zip(lp, o, m) if k]
        s = math.exp(sum(act) / len(act)) if act else 1.0
        cs = min(max(s, 1 - eps_lo), 1 + eps_hi)
        mats.append([max(-a * s, -a * cs) if k else 0.0 for k in m])
        lows.append([bool(k and s < 1 - eps_lo and a < 0) for k in m])
        highs.append([bool(k and s > 1 + eps_hi and a > 0) for k in m])
    return mats, lows, highs


def _gspo_case():
    torch.manual_seed(1)
    B, T = 6, 4
    old = -torch.rand(B, T) * 2
    shift = torch.tensor([0.0, 0.3, -0.3, 2e-4, -2e-4, 0.1])[:, None]  # per-row log-ratio level
    logp = old + shift + 0.05 * torch.randn(B, T)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]]).float()
    adv = torch.tensor([1.0, 1.0, -1.0, -0.5, 2.0, 1.0])
    return logp, old, adv, mask


def test_gspo_loss_matches_sequence_ratio_formula():
    logp, old, adv, mask = _gspo_case()
    eps_lo, eps_hi = 3e-4, 4e-4
    mat, info = policy_loss("gspo")(logp, old, adv[:, None], mask, epsilon=eps_lo, epsilon_high=eps_hi)
    want, lows, highs = _plain_gspo(logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), eps_lo, eps_hi)
    torch.testing.assert_close(mat, torch.tensor(want), atol=1e-6, rtol=1e-5)
    assert info["clip_low"].tolist() == lows and info["clip_high"].tolist() == highs
    assert any(map(any, lows)) and any(map(any, highs))  # both clip sides are exercised


def test_gspo_gradient_is_the_papers_per_token_form():
    # d J / d logp_t = -A_i * s_i / (|y_i| * N_seqs) unless the clip binds (then 0), seq-mean-token-mean
    logp, old, adv, mask = _gspo_case()
    eps_lo, eps_hi = 0.2, 0.28
    logp = logp.clone()
    logp[1] = old[1] + 0.5   # s = e^0.5 > 1.28, A > 0: clipped
    logp[2] = old[2] - 0.5   # s = e^-0.5 < 0.8,  A < 0: clipped
    logp.requires_grad_(True)
    loss, _ = compute_policy_loss(logp, old, adv, mask, policy_loss="gspo", loss_agg_mode="seq-mean-token-mean",
                                  epsilon=eps_lo, epsilon_high=eps_hi)
    loss.backward()
    lp, o, m = logp.detach().tolist(), old.tolist(), mask.tolist()
    n_seq = sum(1 for row in m if sum(row) > 0)
    want = []
    for i in range(len(lp)):
        n = sum(m[i])
        d = [x - y for x, y, k in zip(lp[i], o[i], m[i]) if k]
        s = math.exp(sum(d) / n) if n else 1.0
        a = adv[i].item()
        clipped = (a > 0 and s > 1 + eps_hi) or (a < 0 and s < 1 - eps_lo)
        want.append([(-a * s / (n * n_seq) if k and not clipped else 0.0) for k in m[i]])
    torch.testing.assert_close(logp.grad, torch.tensor(want), atol=1e-7, rtol=1e-5)
    assert logp.grad[1].abs().max() == 0 and logp.grad[2].abs().max() == 0 and logp.grad[0].abs().max() > 0

    # and it equals the gradient of the sequence-level objective with s_i(theta) (GSPO eq. for J_GSPO)
    lp2 = logp.detach().clone().requires_grad_(True)
    n = mask.sum(-1).clamp(min=1)
    s = torch.exp(((lp2 - old) * mask).sum(-1) / n)
    seq_loss = torch.maximum(-adv * s, -adv * s.clamp(1 - eps_lo, 1 + eps_hi))
    (seq_loss[mask.sum(-1) > 0].sum() / n_seq).backward()
    torch.testing.assert_close(logp.grad, lp2.grad, atol=1e-7, rtol=1e-5)


def test_gspo_on_one_token_completions_is_the_clip_loss():
    logp = torch.tensor([[LN5, 0.0], [LN001, 0.0], [0.1, 0.0], [-0.1, 0.0]])
    old = torch.zeros(4, 2)
    mask = torch.tensor([[1.0, 0.0]] * 4)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    for mode in AGG_MODES:
        kw = dict(loss_agg_mode=mode, epsilon=0.2, epsilon_high=0.28, max_new_tokens=2)
        g, gm = compute_policy_loss(logp, old, adv, mask, policy_loss="gspo", **kw)
        c, cm = compute_policy_loss(logp, old, adv, mask, policy_loss="clip", **kw)
        assert g.item() == pytest.approx(c.item(), rel=1e-6) and gm == cm


def test_cispo_gradient_is_stop_gradient_clipped_weight_times_advantage():
    logp = torch.tensor([[LN5, LN001, 0.1, -0.05], [0.3, LN5, 0.0, 0.0]], requires_grad=True)
    old = torch.zeros(2, 4)
    adv = torch.tensor([[1.0, -2.0, 0.5, -1.0], [-1.5, -1.5, -1.5, 9.0]])  # per-token advantages
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    loss, m = compute_policy_loss(logp, old, adv, mask, policy_loss="cispo", epsilon=0.2, epsilon_high=0.28)
    loss.backward()
    n = 6
    want = [[(-min(max(math.exp(x), 0.8), 1.28) * a / n if k else 0.0) for x, a, k in zip(*rows)]
            for rows in zip(logp.detach().tolist(), adv.tolist(), mask.tolist())]
    torch.testing.assert_close(logp.grad, torch.tensor(want), atol=1e-7, rtol=1e-6)
    # r = 5, 5, e^0.3 above 1.28; r = 0.01 below 0.8
    assert m == {"clip_ratio/low_sum": 1.0, "clip_ratio/high_sum": 3.0, "clip_ratio/region_sum": 4.0}


def test_reinforce_gradient_is_minus_advantage_over_tokens_even_off_policy():
    logp = torch.tensor([[-0.3, -1.2, -0.7], [-2.0, -0.1, -0.4]], requires_grad=True)
    old = logp.detach() + 3.0  # ignored: no ratio
    adv = torch.tensor([2.0, -1.0])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    loss, m = compute_policy_loss(logp, old, adv, mask, policy_loss="reinforce")
    assert loss.item() == pytest.approx(-(2.0 * (-0.3 - 1.2) - 1.0 * (-2.0 - 0.1 - 0.4)) / 5, rel=1e-6)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.4, -0.4, 0.0], [0.2, 0.2, 0.2]]))
    assert m == {"clip_ratio/low_sum": 0.0, "clip_ratio/high_sum": 0.0, "clip_ratio/region_sum": 0.0}


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
@pytest.mark.parametrize("mode", AGG_MODES)
def test_masked_positions_give_zero_loss_and_gradient_without_nan(name, mode):
    # padding holds garbage (-inf, nan, huge) in logp and old_logp; row 2 has no active token
    logp = torch.tensor([[-0.5, -float("inf"), float("nan")], [-0.2, -0.1, 80.0], [float("nan"), -1e9, 5.0]])
    old = torch.tensor([[-0.4, 0.0, -float("inf")], [-0.3, -0.3, -80.0], [-float("inf"), 1e9, float("nan")]])
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    adv = torch.tensor([1.0, -1.0, float("nan")])
    logp.requires_grad_(True)
    mat, _ = policy_loss(name)(logp, old, adv[:, None], mask, epsilon=0.2, epsilon_high=0.28, clip_ratio_c=3.0)
    assert torch.isfinite(mat).all() and (mat[mask == 0] == 0).all()
    loss, _ = compute_policy_loss(logp, old, adv, mask, policy_loss=name, loss_agg_mode=mode, max_new_tokens=3,
                                  clip_ratio_c=3.0)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert (logp.grad[mask == 0] == 0).all() and logp.grad[mask == 1].abs().sum() > 0
    # the KL term sees no mask: finite garbage in padding is fine
    lp_f = torch.nan_to_num(logp.detach(), nan=3.0, neginf=-1e9).requires_grad_(True)
    old_f = torch.nan_to_num(old, nan=-3.0, neginf=-1e9)
    for est in KL_ESTIMATORS:
        kl = aggregate(kl_penalty(lp_f, old_f, est), mask, mode, max_new_tokens=3)
        (g,) = torch.autograd.grad(kl, lp_f)
        assert torch.isfinite(kl) and torch.isfinite(g).all() and (g[mask == 0] == 0).all()
    # the same rows without the all-masked one give the same loss (it is not a sequence)
    loss2, _ = compute_policy_loss(logp[:2], old[:2], adv[:2], mask[:2], policy_loss=name, loss_agg_mode=mode,
                                   max_new_tokens=3, clip_ratio_c=3.0)
    assert loss2.item() == pytest.approx(loss.item(), rel=1e-6)


def test_all_masked_batch_gives_zero_loss():
    z = torch.zeros(2, 3, requires_grad=True)
    for name in POLICY_LOSSES:
        for mode in AGG_MODES:
            loss, m = compute_policy_loss(z, z.detach(), torch.ones(2), torch.zeros(2, 3), policy_loss=name,
                                          loss_agg_mode=mode, max_new_tokens=3)
            assert loss.item() == 0 and m["clip_ratio/region_sum"] == 0


def test_unknown_policy_loss_raises():
    z = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="policy_loss: 'ppo2' is not one of clip, "):
        compute_policy_loss(z, z, torch.ones(1), torch.ones(1, 2), policy_loss="ppo2")


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
@pytest.mark.parametrize("mode", AGG_MODES)
def test_every_loss_gradient_is_invariant_to_micro_batch_size(name, mode):
    torch.manual_seed(0)
    B, T = 6, 5
    base = torch.randn(B, T)
    old = base + 0.2 * torch.randn(B, T)
    old[0, 0] = base[0, 0] - LN5    # ratio 5 on one token
    old[1, 1] = base[1, 1] - LN001  # ratio 0.01 on another
    ref = base + 0.1 * torch.randn(B, T)
    adv = torch.randn(B)
    mask = (torch.rand(B, T) > 0.3).float()
    mask[2] = 0          # a row with nothing to learn
    mask[3] = 0
    mask[3, 0] = 1       # a one-token completion
    n_tok, n_seq = float(mask.sum()), float((mask.sum(-1) > 0).sum())
    grads, sums = [], []
    for mb in (1, 2, B):
        logp = base.clone().requires_grad_(True)
        tot = {"clip_ratio/low_sum": 0.0, "clip_ratio/high_sum": 0.0, "clip_ratio/region_sum": 0.0}
        for i in range(0, B, mb):
            s = slice(i, i + mb)
            kw = dict(global_tokens=n_tok, global_seqs=n_seq, max_new_tokens=T)
            loss, met = compute_policy_loss(logp[s], old[s], adv[s], mask[s], policy_loss=name, loss_agg_mode=mode,
                                            epsilon=0.2, epsilon_high=0.28, clip_ratio_c=3.0, **kw)
            loss = loss + 0.04 * aggregate(kl_penalty(logp[s], ref[s], "k3"), mask[s], mode, **kw)
            loss.backward()
            for k in tot:
                tot[k] += met[k]
        grads.append(logp.grad.clone())
        sums.append(tot)
    torch.testing.assert_close(grads[0], grads[2], atol=1e-6, rtol=0)
    torch.testing.assert_close(grads[1], grads[2], atol=1e-6, rtol=0)
    assert sums[0] == sums[1] == sums[2]
    assert (grads[2][mask == 0] == 0).all()


# ----------------------------------------------------------------------------- KL and aggregation

def test_kl_gradients_match_derivatives():
    lp = torch.tensor([[-0.1, -2.0, -0.5]], requires_grad=True)
    ref = torch.tensor([[-0.3, -0.4, -0.5]])
    d = [a - b for a, b in zip(lp[0].tolist(), ref[0].tolist())]
    derivs = {"k1": [1.0] * 3, "k2": d, "k3": [1 - math.exp(-x) for x in d]}
    for name, want in derivs.items():
        (g,) = torch.autograd.grad(kl_penalty(lp, ref, name).sum(), lp)
        torch.testing.assert_close(g[0], torch.tensor(want))
    # k3 far out of range (d = -100 and +100): clamped value, zero gradient, no NaN
    far = torch.tensor([[-100.0, 100.0]], requires_grad=True)
    k3 = kl_penalty(far, torch.zeros(1, 2), "k3")
    (g,) = torch.autograd.grad(k3.sum(), far)
    assert k3.tolist() == [[10.0, 10.0]] and g.tolist() == [[0.0, 0.0]]
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_penalty(lp, ref, "k4")


def test_apply_kl_in_reward_subtracts_beta_times_summed_kl():
    kl = torch.tensor([[0.1, 0.2, 5.0], [0.3, -0.1, 0.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    scores = torch.tensor([1.0, 0.0, 2.0])
    got = apply_kl_in_reward(scores, kl, mask, beta=0.5)
    torch.testing.assert_close(got, torch.tensor([1.0 - 0.5 * 0.3, 0.0 - 0.5 * 0.2, 2.0]))
    # per-token rewards are summed over the active tokens first
    tok = torch.tensor([[0.0, 1.0, 7.0], [0.5, 0.0, -0.5], [3.0, 3.0, 3.0]])
    got2 = apply_kl_in_reward(tok, kl, mask, beta=0.5)
    torch.testing.assert_close(got2, torch.tensor([1.0 - 0.15, 0.0 - 0.1, 0.0]))
    # no gradient flows through a reward
    kl_g = kl.clone().requires_grad_(True)
    assert not apply_kl_in_reward(scores, kl_g, mask, 0.1).requires_grad


def test_aggregation_with_global_normalizers_and_garbage_padding():
    L = torch.tensor([[1.0, 2.0, float("inf")], [4.0, float("nan"), 0.0], [9.0, 9.0, 9.0]])
    M = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert aggregate(L, M, "token-mean", global_tokens=10).item() == pytest.approx(7 / 10)
    assert aggregate(L, M, "seq-mean-token-mean", global_seqs=4).item() == pytest.approx((1.5 + 4) / 4)
    assert aggregate(L, M, "seq-mean-token-sum", global_seqs=4).item() == pytest.approx(7 / 4)
    assert aggregate(L, M, "seq-mean-token-sum-norm", global_seqs=4, max_new_tokens=5).item() == pytest.approx(7 / 20)
    # without globals: only rows with an active token count as sequences
    assert aggregate(L, M, "seq-mean-token-sum").item() == pytest.approx(7 / 2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        aggregate(L, M, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="loss_agg_mode"):
        aggregate(L, M, "sum")


# ----------------------------------------------------------------------------- shaping, ref sync, presets

def test_overlong_penalty_is_dapos_soft_punishment():
    max_new, buf, pen = 32, 8, 0.7
    lengths = list(range(0, 41))
    want = []
    for L in lengths:
        if L <= max_new - buf:
            want.append(0.0)
        elif L <= max_new:
            want.append(pen * ((max_new - buf) - L) / buf)
        else:
            want.append(-pen)
    got = overlong_penalty(torch.tensor(lengths), max_new, buf, pen)
    torch.testing.assert_close(got, torch.tensor(want))
    assert got[32].item() == pytest.approx(-0.7) and got[24] == 0 and got[25].item() == pytest.approx(-0.7 / 8)
    assert (overlong_penalty(torch.tensor(lengths), max_new, 0, pen) == 0).all()


def test_dynamic_sampling_keeps_groups_with_different_rewards():
    keep = dynamic_sampling_keep(torch.tensor(REWARDS), torch.tensor(GROUPS)).tolist()
    want = [len({r for _, r in _groups(REWARDS, GROUPS)[g]}) > 1 for g in GROUPS]
    assert keep == want == [True] * 4 + [False] * 3 + [True] * 5 + [False]


def test_ref_sync_is_an_in_place_soft_update():
    torch.manual_seed(0)
    pol, ref = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    p0 = [p.detach().clone() for p in pol.parameters()]
    r0 = [p.detach().clone() for p in ref.parameters()]
    ptr = [p.data_ptr() for p in ref.parameters()]
    ref_sync(ref, pol, 0.25)
    for r, a, b in zip(ref.parameters(), p0, r0):
        want = [0.25 * x + 0.75 * y for x, y in zip(a.flatten().tolist(), b.flatten().tolist())]
        torch.testing.assert_close(r.detach().flatten(), torch.tensor(want))
        assert r.grad is None
    assert [p.data_ptr() for p in ref.parameters()] == ptr
    for a, b in zip(pol.parameters(), p0):  # the policy is untouched
        assert torch.equal(a.detach(), b)
    ref_sync(ref, pol, 1.0)
    assert all(torch.equal(r, p) for r, p in zip(ref.parameters(), pol.parameters()))
    with pytest.raises(ValueError):
        ref_sync(ref, pol, 1.5)
    with pytest.raises(ValueError):
        ref_sync(torch.nn.Linear(3, 3), pol, 0.5)


EXPECTED_PRESETS = {  # preset -> (estimator, scale, loss, eps, eps_hi, beta, agg, mu, dyn, overlong_buffer)
    "grpo": ("grpo", "group", "clip", 0.2, None, 0.04, "seq-mean-token-mean", 1, False, 0),
    "dr_grpo": ("dr_grpo", "none", "clip", 0.2, None, 0.0, "seq-mean-token-sum-norm", 1, False, 0),
    "dapo": ("grpo", "group", "clip", 0.2, 0.28, 0.0, "token-mean", 1, True, 8),
    "gspo": ("grpo", "group", "gspo", 3e-4, 4e-4, 0.0, "seq-mean-token-mean", 2, False, 0),
    "rloo": ("rloo", "none", "clip", 0.2, None, 0.0, "seq-mean-token-sum", 1, False, 0),
    "reinforce": ("dr_grpo", "none", "reinforce", 0.2, None, 0.0, "token-mean", 1, False, 0),
    "ppo": ("gae", "group", "clip", 0.2, None, 0.0, "token-mean", 2, False, 0),
}


def test_presets_are_complete_valid_and_as_published():
    assert set(PRESETS) == set(EXPECTED_PRESETS)
    fields = ("adv_estimator", "scale_rewards", "policy_loss", "epsilon", "epsilon_high", "beta", "loss_agg_mode",
              "num_iterations", "dynamic_sampling", "overlong_buffer")
    for name, p in PRESETS.items():
        assert set(p) == set(PRESET_KEYS), name
        assert all(k.startswith("algorithm.") for k in p)
        assert p["algorithm.adv_estimator"] in ADV_ESTIMATORS
        assert p["algorithm.policy_loss"] in POLICY_LOSSES
        assert p["algorithm.kl_estimator"] in KL_ESTIMATORS
        assert p["algorithm.loss_agg_mode"] in AGG_MODES
        assert p["algorithm.scale_rewards"] in SCALE_REWARDS
        assert tuple(p[f"algorithm.{f}"] for f in fields) == EXPECTED_PRESETS[name], name
    assert PRESETS["grpo"]["algorithm.kl_estimator"] == "k3"
    assert (PRESETS["ppo"]["algorithm.gamma"], PRESETS["ppo"]["algorithm.lam"]) == (1.0, 0.95)
    assert PRESETS["dapo"]["algorithm.overlong_penalty"] == 1.0
    assert PRESETS["dapo"]["algorithm.mask_truncated_completions"] is False


def test_apply_preset_returns_a_copy_and_rejects_unknown_names():
    p = apply_preset("dapo")
    p["algorithm.beta"] = 1.0
    assert PRESETS["dapo"]["algorithm.beta"] == 0.0
    with pytest.raises(ValueError, match="grpo, dr_grpo, dapo, gspo, rloo, reinforce, ppo"):
        apply_preset("trpo")
