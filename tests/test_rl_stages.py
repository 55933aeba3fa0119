"""The RL step's stages called on their own (train/plan.py, scoring.py, batch_advantages.py, policy_update.py,
collect.py), each against a computation written out here; the batches come from a real tiny policy."""

import math

import pytest
import torch
from test_grpo import make_trainer

from grpolab import distributed as dist
from grpolab.algorithms.estimators import get_estimator
from grpolab.config.load import load_config
from grpolab.errors import ConfigError
from grpolab.models.logprobs import completion_logprobs
from grpolab.rewards.combine import TrainerState
from grpolab.rollout.source import RolloutSource
from grpolab.train import policy_update, scoring
from grpolab.train.batch_advantages import advantages
from grpolab.train.collect import collect
from grpolab.train.logprob_passes import LogProbPasses
from grpolab.train.plan import build_plan

ONE = dist.World(rank=0, size=1, local_rank=0, local_size=1)


@pytest.mark.parametrize("overrides, lora, want", [
    ([], False, ("none", "none", "grpo", False)),
    (["algorithm.beta=0.04"], False, ("frozen", "loss", "grpo", False)),
    (["algorithm.beta=0.04"], True, ("adapters_off", "loss", "grpo", False)),
    (["algorithm.beta=0.04", "algorithm.kl_in_reward=true"], False, ("frozen", "reward", "grpo", False)),
    (["algorithm.preset=ppo"], False, ("none", "none", "gae", True)),
    (["algorithm.adv_estimator=remax"], False, ("none", "none", "remax", False)),
])
def test_the_plan_decides_reference_kl_estimator_and_critic_once(overrides, lora, want):
    cfg = load_config(None, overrides)
    plan = build_plan(cfg, 1, lora)
    reference, kl, name, critic = want
    assert (plan.reference, plan.kl, plan.estimator, plan.critic) == (reference, kl, get_estimator(name), critic)
    assert plan.estimator.greedy == (name == "remax")
    assert plan.share_group == (cfg.rollout.num_generations if cfg.optim.share_prompt else 0)
    assert build_plan(cfg, 2, lora).share_group == 0   # two forwards per backward: not under DDP


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    return make_trainer(tmp_path_factory.mktemp("stages"), "sft.steps=0", "reward.functions=[length]",
                        "rollout.prompts_per_step=3", "rollout.num_generations=4")


def test_the_source_gives_grouped_rows_of_the_published_version(trainer):
    trainer.source.publish(trainer.model, trainer.step)
    taken = trainer.source.take(trainer.step)
    b = taken.batch
    assert b.group_ids.tolist() == [0] * 4 + [1] * 4 + [2] * 4 and b.weight_version == trainer.step
    assert len(b.completions) == 12 and taken.metrics["time/generate"] >= 0
    assert b.prompts[0] == b.prompts[3] != b.prompts[4]   # one prompt per group


REWARDS = """
def double(completions, **_):
    return [2.0 * len(c) for c in completions]

def none_for_first(completions, **_):
    return [None] + [1.0] * (len(completions) - 1)
"""


def test_score_is_the_weighted_total_plus_the_overlong_penalty(trainer, tmp_path):
    batch = trainer.rollout()
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    specs = [f"{tmp_path / 'my_rewards.py'}:double", f"{tmp_path / 'my_rewards.py'}:none_for_first"]
    rewards = scoring.Rewards(specs, [0.5, 3.0], overlong_buffer=4, overlong_penalty=1.0, max_new_tokens=12)
    scoring.score(batch, rewards, TrainerState(0, 1, 0.0))
    lengths = batch.gen.completion_mask.sum(-1).tolist()
    for i, c in enumerate(batch.completions):
        # DAPO's soft overlong punishment: 0 up to 12 - 4 tokens, then linearly down to -1 at 12
        pen = -min(max(lengths[i] - 8, 0) / 4, 1.0)
        want = 0.5 * 2.0 * len(c) + (0.0 if i == 0 else 3.0) + pen
        assert float(batch.rewards[i]) == pytest.approx(want, abs=1e-5), i
        assert float(batch.reward_columns["overlong"][i]) == pytest.approx(pen, abs=1e-6)
    assert batch.scorable.all()   # the first row: one function scored it


def test_group_advantages_are_z_scores_and_unscored_rows_get_zero(trainer):
    batch = trainer.rollout()
    batch.rewards = torch.tensor([1.0, 2.0, 3.0, 4.0, 0.0, 0.0, 5.0, 5.0, 2.0, 9.0, 4.0, 1.0])
    batch.scorable = torch.tensor([True] * 11 + [False])
    cfg = load_config(None, ["algorithm.adv_eps=0.0"])
    advantages(batch, build_plan(cfg, 1, False), cfg.algorithm, None, ONE)
    for g, rows in enumerate([range(0, 4), range(4, 8), range(8, 11)]):
        r = [float(batch.rewards[i]) for i in rows]
        mean = sum(r) / len(r)
        std = math.sqrt(sum((x - mean) ** 2 for x in r) / len(r))
        for i, x in zip(rows, r):
            assert float(batch.advantages[i]) == pytest.approx((x - mean) / std if std else 0.0, abs=1e-5), (g, i)
    assert float(batch.advantages[11]) == 0.0


class PlainSGD:
    """The optimizer side a policy update needs: plain SGD, a constant schedule, every update applied."""

    def __init__(self, model, lr):
        self.opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: 1.0)
        self.master = None

    def apply_update(self, loss, norm):
        self.opt.step()
        return True


def test_one_update_is_a_step_along_the_advantage_weighted_log_prob_gradient(trainer):
    """mu = 1, token-mean, no KL: the loss is -mean over tokens of A * ratio with ratio = 1, so one SGD step
    moves the weights by lr * grad(mean_t A_t * logp_t), computed here with autograd on the log-probs alone."""
    cfg = load_config(None, ["optim.share_prompt=false", "algorithm.loss_agg_mode=token-mean"])
    model = trainer.model
    batch = trainer.rollout()
    batch.advantages = torch.linspace(-1.0, 1.0, len(batch))
    g = batch.gen
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    logp = completion_logprobs(model, g.prompt_ids, g.prompt_mask, g.completion_ids, g.completion_mask,
                               cfg.rollout.temperature)
    m = g.completion_mask.float()
    ((batch.advantages[:, None] * logp * m).sum() / m.sum()).backward()
    want = {n: before[n] + 0.1 * p.grad for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    lp = LogProbPasses(cfg.rollout.temperature, None, 0, 0, False)
    out = policy_update.update(model, batch, build_plan(cfg, 1, False), cfg.algorithm, lp, PlainSGD(model, 0.1),
                               0.0, None, trainer.progress, cfg.rollout.max_new_tokens)
    for n, p in model.named_parameters():
        if n in want:
            torch.testing.assert_close(p.detach(), want[n], atol=1e-6, rtol=1e-5)
    assert out["clip_ratio/region_mean"] == 0.0 and out["rollout/ratio_mean"] == pytest.approx(1.0, abs=1e-3)
    with torch.no_grad():   # back to where the trainer had it, for the other tests of this module
        for n, p in model.named_parameters():
            p.copy_(before[n])


def test_collect_keeps_the_informative_groups_with_dynamic_sampling(trainer):
    cfg = load_config(None, ["algorithm.dynamic_sampling=true", "algorithm.max_sampling_rounds=3"])
    calls = []

    def score(batch, epoch):   # every group but the first gets equal rewards: only group 0 is informative
        calls.append(epoch)
        batch.rewards = torch.tensor([float(i % 4) if i < 4 else 1.0 for i in range(len(batch))])
        batch.scorable, batch.reward_columns = None, {}
        return {"m": [1.0]}

    got = collect(trainer.source, trainer.step, score, cfg.algorithm, 3, ONE, trainer.tok.pad_id, trainer.progress,
                  None)
    # three rounds of one informative group each: the three kept groups, renumbered 0..2
    assert got.stats["dynamic_sampling/rounds"] == 3 and got.stats["dynamic_sampling/kept_groups"] == 3
    assert got.batch.group_ids.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    assert got.stats["frac_reward_zero_std"] == pytest.approx(2 / 3)
    assert got.logged == {"m": [1.0, 1.0, 1.0]} and calls == [got.epoch] * 3


def test_a_checkpoint_sampled_ahead_resumes_only_on_its_clock(tmp_path):
    """Every source refuses a checkpoint whose batches in flight came from another train.async_steps."""
    ahead = {"async": {"async_steps": 2, "next_batch": 5, "in_flight": {}}}
    with pytest.raises(ConfigError) as e:
        RolloutSource().restore(ahead, tmp_path, 3)
    assert str(e.value) == (f"train.async_steps: {tmp_path} was written with train.async_steps=2; resume it with "
                            f"the same value (this run has 0)")
    RolloutSource().restore({"async": {"async_steps": 0, "next_batch": 4, "in_flight": {}}}, tmp_path, 3)
    RolloutSource().restore({}, tmp_path, 3)
