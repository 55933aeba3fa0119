"""config/names.py holds, as plain data, the registry names config validation checks against: each list
equals its registry's keys (in order, as error messages list them), so the two cannot drift apart; and
loading a config imports no torch."""

import subprocess
import sys

from conftest import ROOT

from grpolab.algorithms import advantages, aggregate, kl, losses
from grpolab.algorithms.estimators import ADV_ESTIMATORS
from grpolab.config import names, presets, reward_spec
from grpolab.envs import reasoning_gym, verifiers_env
from grpolab.rewards import REWARDS, custom
from grpolab.rollout.sources import SOURCES


def test_each_name_list_equals_its_registry():
    assert names.ADV_ESTIMATORS == tuple(ADV_ESTIMATORS)
    assert names.ROLLOUT_ENGINES == tuple(n for n in SOURCES if n != "workers")
    assert names.SCALE_REWARDS == tuple(advantages.SCALE_REWARDS)
    assert names.POLICY_LOSSES == tuple(losses.POLICY_LOSSES)
    assert names.KL_ESTIMATORS == tuple(kl.KL_ESTIMATORS)
    assert names.AGG_MODES == tuple(aggregate.AGG_MODES)
    assert names.DPO_LOSSES == tuple(losses.DPO_LOSSES)
    assert names.DISTILL_KL == tuple(losses.DISTILL_KL)
    assert names.REWARDS == tuple(REWARDS)
    assert names.PACKAGE_TASKS == (reasoning_gym.TASK_PREFIX, verifiers_env.TASK_PREFIX)
    assert all(p[:-1] in REWARDS for p in names.PACKAGE_TASKS)


def test_presets_name_registered_algorithms():
    for name, p in presets.PRESETS.items():
        assert p["algorithm.adv_estimator"] in ADV_ESTIMATORS, name
        assert p["algorithm.policy_loss"] in losses.POLICY_LOSSES, name
        assert p["algorithm.kl_estimator"] in kl.KL_ESTIMATORS, name
        assert p["algorithm.loss_agg_mode"] in aggregate.AGG_MODES, name
        assert p["algorithm.scale_rewards"] in advantages.SCALE_REWARDS, name


def test_the_rewards_parse_a_call_with_configs_parser():
    """One parser of 'module:factory(...)' specs: the rewards use the one validation uses."""
    assert custom.parse_call is reward_spec.parse_call


def test_loading_a_config_imports_no_torch():
    probe = ("import sys; from grpolab.config.load import load_config; "
             "load_config(None, ['algorithm.preset=dapo', 'reward.functions=[length, m:f(k=1)]']); "
             "print(sorted(m for m in ('torch', 'grpolab.algorithms', 'grpolab.rewards') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["[]"]
