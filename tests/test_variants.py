"""The algorithm family wired into the trainer: presets, dynamic sampling, KL in reward,
truncation masking, entropy bonus, overlong shaping, reference sync. Real tiny model, real steps."""

import copy

import pytest
import torch
from test_grpo import EASY, make_trainer

from grpolab.config.load import load_config
from grpolab.config.presets import PRESETS
from grpolab.errors import ConfigError
from grpolab.jobs.common import setup_torch
from grpolab.jobs.inputs import load_data, load_policy
from grpolab.monitor.console import Console
from grpolab.train.grpo import GRPOTrainer

# A reward that varies within a group only for prompts whose first number is odd: groups of
# even-numbered prompts are all 0 and carry no signal (what dynamic sampling drops).
PARITY_REWARD = """
import re
def parity_len(prompts, completions, **_):
    out = []
    for p, c in zip(prompts, completions):
        first = int(re.search(r"\\d+", p).group())
        out.append(0.0 if first % 2 == 0 else float(len(c)))
    return out
"""


_trainer = make_trainer


def _replay_dynamic_sampling(tr, state):
    """(rounds, first-round share of zero-std groups) of one dynamic-sampling step, recomputed plainly
    by rolling out again from the RNG/data `state` the step started from."""
    tr.gen.set_state(state[0])
    tr.sampler.restore(state[1])
    P, rounds, informative, first = tr.cfg.rollout.prompts_per_step, 0, 0, None
    while rounds < tr.cfg.algorithm.max_sampling_rounds and informative < P:
        rounds += 1
        batch = tr.rollout()
        tr.score(batch)
        groups = [batch.rewards[batch.group_ids == g] for g in range(P)]
        equal = [float(r.max()) == float(r.min()) for r in groups]
        first = sum(equal) / P if first is None else first
        informative += equal.count(False)
    return rounds, first


def _state(tr):
    return tr.gen.get_state(), dict(tr.sampler.state())


def test_preset_sets_its_keys_and_explicit_keys_win():
    cfg = load_config(None, ["algorithm.preset=dapo"])
    for key, value in PRESETS["dapo"].items():
        section, name = key.split(".")
        assert getattr(getattr(cfg, section), name) == value, key
    cfg = load_config(None, ["algorithm.beta=0.1", "algorithm.preset=grpo"])
    assert cfg.algorithm.beta == 0.1 and cfg.algorithm.loss_agg_mode == PRESETS["grpo"]["algorithm.loss_agg_mode"]
    with pytest.raises(ConfigError, match="algorithm.preset: 'nope' is not one of"):
        load_config(None, ["algorithm.preset=nope"])


def test_dynamic_sampling_keeps_only_informative_groups(tmp_path):
    fn = tmp_path / "parity.py"
    fn.write_text(PARITY_REWARD)
    tr = _trainer(tmp_path, f"reward.functions=[{fn}:parity_len]", "algorithm.dynamic_sampling=true",
                  "algorithm.max_sampling_rounds=6", "rollout.prompts_per_step=3")
    start = _state(tr)
    batch, stats = tr.collect()
    after = _state(tr)
    rounds, zero_std = _replay_dynamic_sampling(tr, start)
    assert rounds > 1   # the parity reward leaves groups out, so more rounds were needed
    assert stats["dynamic_sampling/rounds"] == rounds and stats["frac_reward_zero_std"] == zero_std
    assert torch.equal(tr.gen.get_state(), after[0]) and tr.sampler.state() == after[1]   # replay == the step
    groups = batch.group_ids.unique()
    assert len(groups) == 3 and len(batch) == 3 * 4
    for g in groups:   # every kept group has unequal rewards and one prompt
        r = batch.rewards[batch.group_ids == g]
        assert r.max() > r.min()
        assert len({batch.prompts[i] for i in (batch.group_ids == g).nonzero().flatten().tolist()}) == 1
    assert stats["dynamic_sampling/kept_groups"] == 3
    # prompt/completion ids stay aligned with the texts after merging rounds
    for i in range(len(batch)):
        ids = batch.gen.completion_ids[i][batch.gen.completion_mask[i]]
        assert tr.tok.decode(ids.tolist()) == batch.completions[i]
        p = batch.gen.prompt_ids[i][batch.gen.prompt_mask[i]].tolist()
        assert p == tr.tok.render_prompt(batch.prompts[i])
    start = _state(tr)
    m = tr.train_step()
    rounds, zero_std = _replay_dynamic_sampling(tr, start)
    assert m["dynamic_sampling/rounds"] == rounds and m["frac_reward_zero_std"] == zero_std


def test_mask_truncated_completions_leaves_no_loss(tmp_path):
    # no stop token counts (ignore_eos): every completion is truncated at 3 tokens and masked out
    tr = _trainer(tmp_path, "rollout.max_new_tokens=3", "rollout.ignore_eos=true",
                  "algorithm.mask_truncated_completions=true", "reward.functions=[length]")
    before = copy.deepcopy(tr.model.state_dict())
    m = tr.train_step()
    assert m["completions/clipped_ratio"] == 1.0 and m["loss"] == 0.0 and m["grad_norm"] == 0.0
    assert all(torch.equal(before[k], v) for k, v in tr.model.state_dict().items())


def test_kl_in_reward_changes_advantages_not_loss_terms(tmp_path):
    tr = _trainer(tmp_path, "algorithm.beta=0.5", "algorithm.kl_in_reward=true", "algorithm.kl_estimator=k1",
                  "reward.functions=[length]")
    tr.train_step()   # move the policy away from the reference
    batch, _ = tr.collect()
    ref_lp = tr.ref_logprobs(batch)
    out = tr.advantages(batch, ref_lp)
    m = batch.gen.completion_mask
    kl_sum = ((batch.gen.sampler_logprobs - ref_lp) * m).sum(-1)
    shaped = batch.rewards - 0.5 * kl_sum
    # plain GRPO z-score of the shaped rewards, per group of 4
    want = []
    for g in range(len(batch) // 4):
        x = shaped[4 * g:4 * g + 4].double()
        want += ((x - x.mean()) / (x.std(unbiased=False) + 1e-4)).tolist()
    torch.testing.assert_close(batch.advantages.double(), torch.tensor(want, dtype=torch.double), atol=1e-4, rtol=0)
    assert "kl" in out
    assert "kl" not in tr.update(batch, ref_lp)   # not in the loss as well


def test_ref_sync_with_alpha_one_copies_the_policy(tmp_path):
    tr = _trainer(tmp_path, "algorithm.beta=0.04", "algorithm.ref_sync_steps=1", "algorithm.ref_sync_alpha=1.0",
                  "reward.functions=[length]", "optim.lr=1e-2")
    ref0 = copy.deepcopy(tr.ref.state_dict())
    tr.train_step()
    assert any(not torch.equal(ref0[k], v) for k, v in tr.ref.state_dict().items())
    for (k, a), b in zip(tr.model.state_dict().items(), tr.ref.state_dict().values()):
        assert torch.equal(a, b), k


def test_entropy_bonus_raises_the_entropy_and_a_negative_sign_would_not(tmp_path):
    """Zero advantages (one reward for every completion): the entropy bonus is the whole update, so
    after a few steps the policy's entropy on a fixed batch is higher than before. The gradient
    itself is checked against an independent computation in test_trainer_exact.py."""
    # a longer warm start than TINY's, so the policy starts well below the maximum entropy log(vocab)
    tr = _trainer(tmp_path, "algorithm.entropy_coef=1.0", "reward.functions=[length]", "optim.lr=1e-3",
                  "optim.warmup_steps=0", "optim.max_grad_norm=0", "sft.steps=40", "sft.warmup_steps=5")
    batch, _ = tr.collect()
    batch.advantages = torch.zeros(len(batch))
    g = batch.gen

    def entropy():
        with torch.no_grad():
            _, ent = tr.lp(tr.model, g, slice(None), with_entropy=True)
        return float((ent * g.completion_mask).sum() / g.completion_mask.sum())

    seen = [entropy()]
    for _ in range(3):
        tr.update(batch)
        seen.append(entropy())
    assert all(b > a for a, b in zip(seen, seen[1:])) and seen[-1] > seen[0] + 0.1, seen


def test_overlong_shaping_penalises_long_completions(tmp_path):
    tr = _trainer(tmp_path, "algorithm.overlong_buffer=6", "algorithm.overlong_penalty=1.0",
                  "reward.functions=[format]")
    batch, _ = tr.collect()
    L = batch.gen.completion_mask.sum(-1).float()
    want = -((L - 6).clamp(min=0) / 6)
    torch.testing.assert_close(batch.reward_columns["overlong"], want)
    torch.testing.assert_close(batch.rewards, batch.reward_columns["format"] + want)


@pytest.mark.slow
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_trains_without_nan_and_reward_rises(tmp_path, preset, easy_policy):
    """30 steps per preset from the same warm-started model on the easy setting."""
    cfg = load_config(None, EASY + [f"algorithm.preset={preset}", "train.max_steps=30",
                                    f"train.output_dir={tmp_path}"])
    setup_torch(cfg)
    model, tok, train_rows, test_rows = easy_policy
    history = GRPOTrainer(cfg, copy.deepcopy(model), tok, train_rows, test_rows, tmp_path).train()
    for m in history:
        assert all(v == v for v in m.values() if isinstance(v, float)), m   # no NaN
    first = sum(m["reward"] for m in history[:10]) / 10
    last = sum(m["reward"] for m in history[-10:]) / 10
    assert last > first, (preset, first, last)


@pytest.fixture(scope="module")
def easy_policy(tmp_path_factory):
    cfg = load_config(None, EASY + [f"train.output_dir={tmp_path_factory.mktemp('easy')}"])
    setup_torch(cfg)
    train_rows, test_rows = load_data(cfg)
    model, tok = load_policy(cfg, train_rows, Console(quiet=True))
    return model, tok, train_rows, test_rows


def test_non_finite_loss_skips_the_update_then_aborts(tmp_path):
    from grpolab.errors import TrainingError
    tr = _trainer(tmp_path, "reward.functions=[length]", "train.max_bad_steps=1")
    for n in (1, 2):
        batch, _ = tr.collect()
        tr.advantages(batch, None)
        batch.advantages[0] = float("nan")   # a poisoned value reaches the loss
        before = copy.deepcopy(tr.model.state_dict())
        if n == 1:
            tr.update(batch)
            assert tr.bad_steps == 1
            assert all(torch.equal(before[k], v) for k, v in tr.model.state_dict().items())   # no update
        else:
            with pytest.raises(TrainingError, match="non-finite loss .* train.max_bad_steps=1"):
                tr.update(batch)
