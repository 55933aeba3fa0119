"""The rest of the RL family, each formula against a plain re-computation: GAE, REINFORCE++, ReMax,
the value loss, explained variance, intrinsic rewards (self-certainty, entropy, trajectory log-prob,
RLPR and its std filter), rollout correction; the critic's micro-batch invariance; PPO resume."""

import json
import math

import pytest
import torch

from grpolab.algorithms.advantages import (
    compute_gae,
    compute_reinforce_plus_plus,
    compute_remax,
    token_level_rewards,
)
from grpolab.algorithms.losses import explained_variance, value_loss
from grpolab.algorithms.rollout_correction import rollout_correction
from grpolab.models import GPT, CharTokenizer, GPTConfig
from grpolab.rollout.engine import generate
from grpolab.train.group_filters import std_filter

# two rows, the second with a hole (a masked position inside the completion: e.g. tool output)
MASK = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 1, 1]], dtype=torch.bool)
R = torch.tensor([[0.0, 0.1, 0.0, 1.0, 0.0], [0.2, 0.0, 0.0, -0.3, 0.5]], dtype=torch.float64)
V = torch.tensor([[0.5, 0.4, 0.3, 0.2, 0.0], [0.1, 0.2, 9.0, 0.3, 0.4]], dtype=torch.float64)


def _active(row):
    return [t for t in range(MASK.size(1)) if MASK[row, t]]


def _plain_whiten(x, mask):
    vals = [float(x[b, t]) for b in range(x.size(0)) for t in range(x.size(1)) if mask[b, t]]
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)
    return [[(float(x[b, t]) - mean) / math.sqrt(var + 1e-8) if mask[b, t] else 0.0 for t in range(x.size(1))]
            for b in range(x.size(0))]


def test_gae_matches_a_plain_recursion_over_the_active_tokens():
    gamma, lam = 0.9, 0.8
    adv, ret = compute_gae(R, V, MASK, gamma, lam)
    raw = torch.zeros_like(R)
    for b in range(2):
        ts = _active(b)   # the hole is skipped: the next state of t is the next active position
        a_next = 0.0
        for k in reversed(range(len(ts))):
            t = ts[k]
            v_next = float(V[b, ts[k + 1]]) if k + 1 < len(ts) else 0.0
            delta = float(R[b, t]) + gamma * v_next - float(V[b, t])
            a_next = delta + gamma * lam * a_next
            raw[b, t] = a_next
    torch.testing.assert_close(ret, (raw + V) * MASK)
    torch.testing.assert_close(adv, torch.tensor(_plain_whiten(raw, MASK), dtype=adv.dtype))
    assert float(adv[MASK].mean()) == pytest.approx(0.0, abs=1e-12)


def test_reinforce_plus_plus_discounts_over_the_active_tokens_and_whitens():
    gamma = 0.7
    adv, ret = compute_reinforce_plus_plus(R, MASK, gamma)
    want = torch.zeros_like(R)
    for b in range(2):
        g = 0.0
        for t in reversed(_active(b)):
            g = float(R[b, t]) + gamma * g
            want[b, t] = g
    torch.testing.assert_close(ret, want)
    torch.testing.assert_close(adv, torch.tensor(_plain_whiten(want, MASK), dtype=adv.dtype))


def test_remax_subtracts_the_greedy_reward_from_the_return():
    base = torch.tensor([0.5, -1.0], dtype=torch.float64)
    adv, ret = compute_remax(R, base, MASK)
    for b in range(2):
        for t in range(5):
            future = sum(float(R[b, s]) for s in _active(b) if s >= t)
            assert float(ret[b, t]) == pytest.approx(future if MASK[b, t] else 0.0)
            assert float(adv[b, t]) == pytest.approx(future - float(base[b]) if MASK[b, t] else 0.0)


def test_token_level_rewards_put_the_score_on_the_last_token_and_the_kl_on_every_token():
    kl = torch.full((2, 5), 0.5)
    out = token_level_rewards(torch.tensor([1.0, 2.0]), MASK, kl, beta=0.1)
    want = [[-0.05, -0.05, -0.05, 1.0 - 0.05, 0.0], [-0.05, -0.05, 0.0, -0.05, 2.0 - 0.05]]
    torch.testing.assert_close(out, torch.tensor(want))


def test_value_loss_is_half_the_larger_squared_error_with_clipping():
    v = torch.tensor([[1.0, 0.0, 2.0], [0.5, 3.0, 0.0]])
    old = torch.tensor([[0.0, 0.0, 1.0], [0.5, 0.0, 0.0]])
    ret = torch.tensor([[1.0, 1.0, 0.0], [0.0, 2.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    loss, clipped = value_loss(v, old, ret, mask, cliprange_value=0.2)
    terms, nclip = [], 0
    for b in range(2):
        for t in range(3):
            if mask[b, t]:
                vc = float(old[b, t]) + max(-0.2, min(0.2, float(v[b, t] - old[b, t])))
                e1, e2 = (float(v[b, t] - ret[b, t])) ** 2, (vc - float(ret[b, t])) ** 2
                terms.append(0.5 * max(e1, e2))
                nclip += e2 > e1
    assert float(loss) == pytest.approx(sum(terms) / len(terms))
    assert clipped == nclip


def test_explained_variance():
    ret = torch.tensor([[1.0, 2.0, 3.0, 0.0]])
    val = torch.tensor([[1.5, 2.0, 2.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    r, v = [1.0, 2.0, 3.0], [1.5, 2.0, 2.0]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    var = lambda xs: mean([(x - mean(xs)) ** 2 for x in xs])  # noqa: E731
    assert explained_variance(val, ret, mask) == pytest.approx(1 - var([a - b for a, b in zip(r, v)]) / var(r))


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["tis", "mis"])
def test_rollout_correction_weights_and_masks(mode, level):
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -1.0]])
    smp = torch.tensor([[-2.0, -1.0, -0.5], [-1.2, -1.0, -5.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    w, m, metrics = rollout_correction(old, smp, mask, mode=mode, level=level, threshold=2.0)
    for b in range(2):
        seq = math.exp(sum(float(old[b, t] - smp[b, t]) for t in range(3) if mask[b, t]))
        for t in range(3):
            rho = math.exp(float(old[b, t] - smp[b, t])) if level == "token" else seq
            if mode == "tis":
                assert float(w[b, t]) == pytest.approx(min(rho, 2.0) if mask[b, t] else 0.0, rel=1e-6)
                assert bool(m[b, t]) == bool(mask[b, t])
            else:
                assert float(w[b, t]) == 1.0
                assert bool(m[b, t]) == bool(mask[b, t] and 0.5 <= rho <= 2.0)
    diffs = [abs(float(old[b, t] - smp[b, t])) for b in range(2) for t in range(3) if mask[b, t]]
    assert metrics["rollout/logprob_abs_diff_sum"] == pytest.approx(sum(diffs))
    seqs = [math.exp(sum(float(old[b, t] - smp[b, t]) for t in range(3) if mask[b, t])) for b in range(2)]
    assert metrics["rollout/ratio_max"] == pytest.approx(math.e if level == "token" else max(seqs), rel=1e-6)


# ---------------------------------------------------------------------------- intrinsic rewards

@pytest.fixture(scope="module")
def policy_batch():
    from grpolab.rewards.intrinsic import PolicyView
    torch.manual_seed(0)
    tok = CharTokenizer()
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=2, n_head=2, n_embd=32, block_size=96)).eval()
    prompts = ["1 plus 2?", "Ann has 3 pens and buys 4. How many?"]
    gen = generate(model, [tok.render_prompt(p) for p in prompts], num_generations=2, max_new_tokens=12,
                   temperature=1.0, stop_ids=tok.stop_ids, pad_id=tok.pad_id,
                   generator=torch.Generator().manual_seed(3))
    texts = [tok.decode(c[m].tolist()) for c, m in zip(gen.completion_ids, gen.completion_mask)]
    return model, tok, gen, [p for p in prompts for _ in range(2)], texts, PolicyView(model, tok, gen)


def _plain_token_dists(model, tok, prompt, ids):
    """Next-token distributions at each completion token, recomputed one prefix at a time."""
    out = []
    with torch.no_grad():
        for t in range(len(ids)):
            seq = torch.tensor([tok.render_prompt(prompt) + ids[:t]])
            out.append(model(seq)[0, -1].double().log_softmax(-1))
    return out


def test_intrinsic_rewards_match_a_plain_computation(policy_batch):
    from grpolab.rewards.intrinsic import self_certainty, token_entropy, trajectory_logprob
    model, tok, gen, prompts, texts, view = policy_batch
    cert = self_certainty(texts, policy=view)
    ent = token_entropy(texts, policy=view)
    traj = trajectory_logprob(texts, policy=view)
    for i in range(len(texts)):
        ids = gen.completion_ids[i][gen.completion_mask[i]].tolist()
        dists = _plain_token_dists(model, tok, prompts[i], ids)
        V = dists[0].numel()
        want_cert = sum(float(-math.log(V) - d.mean()) for d in dists) / len(ids)
        want_ent = -sum(float(-(d.exp() * d).sum()) for d in dists) / len(ids)
        want_traj = sum(float(d[y]) for d, y in zip(dists, ids)) / len(ids)
        assert cert[i] == pytest.approx(want_cert, rel=1e-4)
        assert ent[i] == pytest.approx(want_ent, rel=1e-4)
        assert traj[i] == pytest.approx(want_traj, rel=1e-4)


def test_policy_stats_are_computed_once_for_every_reward_that_asks(policy_batch):
    from grpolab.rewards.combine import score
    from grpolab.rewards.intrinsic import PolicyView
    model, tok, gen, prompts, texts, _ = policy_batch
    calls = []
    hook = model.register_forward_hook(lambda *a: calls.append(1))
    try:
        view = PolicyView(model, tok, gen)
        total, cols = score(["self_certainty", "token_entropy", "trajectory_logprob"], None, prompts, texts, {},
                            policy=view)
    finally:
        hook.remove()
    assert len(calls) == 1   # one forward over the batch, shared by three rewards
    torch.testing.assert_close(total, cols["self_certainty"] + cols["token_entropy"] + cols["trajectory_logprob"])


def test_rlpr_is_the_debiased_mean_probability_of_the_reference_clipped(policy_batch):
    from grpolab.rewards.intrinsic import rlpr
    model, tok, gen, prompts, _, view = policy_batch
    completions = ["1+2=3\n#### 4", "no answer here", "3+4=7\n#### 7", "#### 1"]
    answers = ["1+2=3\n#### 3", "3", "3+4=7\n#### 7", "7"]
    got = rlpr(prompts, completions, answers, policy=view)

    def mean_prob(prefix, target):
        with torch.no_grad():
            lp = model(torch.tensor([prefix + target]))[0].double().log_softmax(-1)
        return sum(math.exp(float(lp[len(prefix) - 1 + k, y])) for k, y in enumerate(target)) / len(target)
    for i, (p, c, a) in enumerate(zip(prompts, completions, answers)):
        ref = a.rsplit("####", 1)[1].strip() if "####" in a else a
        reasoning = c.rsplit("####", 1)[0] if "####" in c else c.rstrip() + "\n"
        with_r = mean_prob(tok.render_prompt(p) + tok.encode(reasoning + "#### "), tok.encode(ref))
        without = mean_prob(tok.render_prompt(p) + tok.encode("#### "), tok.encode(ref))
        assert got[i] == pytest.approx(min(1.0, max(0.0, with_r - without)), abs=1e-5)


def test_std_filter_tracks_a_moving_average_of_group_stds(tmp_path):
    """RLPR's filter, replayed plainly: the first batch sets the average and keeps all; later batches
    keep the groups whose std reaches the average of the batches before them."""
    from test_grpo import make_trainer
    tr = make_trainer(tmp_path, "sft.steps=0", "reward.functions=[length]", "algorithm.std_filter_ema=0.5",
                      "rollout.prompts_per_step=3")
    ema, seen = None, []
    for _ in range(3):
        batch = tr.rollout()
        tr.score(batch)
        groups = [batch.rewards[batch.group_ids == g] for g in range(3)]
        stds = [float(r.std(unbiased=False)) for r in groups]
        stats = {}
        kept, tr.std_ema = std_filter(batch, 0.5, tr.std_ema, stats)
        want = [g for g in range(3) if ema is None or stds[g] >= ema] or [0, 1, 2]
        assert sorted(set(kept.group_ids.tolist())) == want
        assert stats["std_filter/threshold"] == pytest.approx(ema or 0.0)
        ema = sum(stds) / 3 if ema is None else 0.5 * ema + 0.5 * sum(stds) / 3
        assert tr.std_ema == pytest.approx(ema)
        seen.append(len(want))
    assert min(seen) < 3   # the filter did drop something in this run


# ---------------------------------------------------------------------------- the critic, PPO

def test_critic_update_is_micro_batch_invariant(tmp_path):
    from test_grpo import make_trainer

    from grpolab.algorithms.losses import value_loss as vl
    tr = make_trainer(tmp_path, "sft.steps=0", "algorithm.adv_estimator=gae", "rollout.prompts_per_step=3",
                      "reward.functions=[length]")
    batch = tr.rollout()
    tr.score(batch)
    tr.advantages(batch, None)
    g, mask = batch.gen, batch.gen.completion_mask
    agg = dict(global_tokens=float(mask.sum()), global_seqs=float(len(batch)), max_new_tokens=12)
    grads = []
    for mb in (len(batch), 5):
        tr.critic.model.zero_grad(set_to_none=True)
        for i in range(0, len(batch), mb):
            s = slice(i, i + mb)
            loss, _ = vl(tr.critic._values(g, s), batch.values[s], batch.returns[s], mask[s], cliprange_value=0.5,
                         **agg)
            loss.backward()
        grads.append([p.grad.clone() for p in tr.critic.model.parameters() if p.grad is not None])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert any(float(x.abs().sum()) > 0 for x in grads[0])


def test_ppo_resume_restores_the_critic_and_gives_identical_metrics(tmp_path):
    from test_grpo import make_trainer
    over = ["algorithm.preset=ppo", "train.max_steps=4", "train.save_every=2", "train.keep_checkpoints=0",
            "critic.warmup_updates=1", "reward.functions=[length]"]
    a = make_trainer(tmp_path / "a", *over)
    full = a.train()
    ckpt = tmp_path / "a" / "checkpoints" / "step_2"
    assert (ckpt / "critic.safetensors").is_file() and (ckpt / "critic_optimizer.pt").is_file()
    assert "loss" not in full[0] and "critic/value_loss" in full[0]   # step 1: the critic warms up alone
    assert all(k in full[-1] for k in ("critic/explained_variance", "critic/vf_clipfrac", "critic/values_mean",
                                       "critic/returns_mean", "rollout/logprob_abs_diff", "rollout/ratio_max"))
    b = make_trainer(tmp_path / "b", *over)
    b.restore(ckpt)
    rest = b.train()
    strip = lambda ms: json.dumps([{k: v for k, v in m.items() if not k.startswith(("time/", "perf/"))}  # noqa: E731
                                   for m in ms])
    assert strip(rest) == strip(full[2:])
    assert full[-1]["critic/value_loss"] > 0 and full[-1]["loss"] != 0   # both models learned something


def test_sampler_and_trainer_drift_is_logged_and_small(tmp_path):
    from test_grpo import make_trainer
    tr = make_trainer(tmp_path, "train.max_steps=1")
    m = tr.train()[0]
    assert 0 < m["rollout/logprob_abs_diff"] < 1e-4        # two code paths, same model: float noise only
    assert abs(m["rollout/ratio_max"] - 1.0) < 1e-3
