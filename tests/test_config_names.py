"""config/names.py declares each registry once, as plain data: every "module:attr" line loads what its registry
holds (the check that catches a typo there), the presets name declared entries, an unknown name is one line
naming the key and the known names; and loading a config imports no torch."""

import inspect
import subprocess
import sys

import pytest
from conftest import ROOT

from grpolab import rewards
from grpolab.algorithms.estimators import Estimator, get_estimator
from grpolab.config import names, presets, reward_spec
from grpolab.errors import ConfigError
from grpolab.rewards import custom
from grpolab.rollout.source import RolloutSource

TABLES = {"ADV_ESTIMATORS": "algorithm.adv_estimator", "POLICY_LOSSES": "algorithm.policy_loss",
          "KL_ESTIMATORS": "algorithm.kl_estimator", "REWARDS": "reward.functions", "SOURCES": "rollout.source"}


@pytest.mark.parametrize("table", TABLES)
def test_every_declared_entry_loads(table):
    declared = getattr(names, table)
    assert declared
    for name, entry in declared.items():
        module, _, attr = entry.partition(":")
        assert module.startswith("grpolab.") and attr.isidentifier(), (name, entry)
        loaded = names.load(declared, name, TABLES[table])
        if table == "SOURCES":
            assert inspect.isclass(loaded) and issubclass(loaded, RolloutSource), name
        elif table == "ADV_ESTIMATORS":
            assert isinstance(loaded, Estimator) and callable(loaded.fn), name
            assert get_estimator(name) is loaded
        else:
            assert inspect.isfunction(loaded), name


def test_the_rewards_package_holds_the_declared_functions():
    assert rewards.REWARDS == {n: names.load(names.REWARDS, n, "reward.functions") for n in names.REWARDS}
    assert all(p[:-1] in names.REWARDS for p in names.PACKAGE_TASKS)   # a package task's own scorer


def test_an_unknown_name_is_one_line_naming_the_key_and_the_known_names():
    with pytest.raises(ConfigError) as e:
        names.load(names.POLICY_LOSSES, "ppo", "algorithm.policy_loss")
    assert str(e.value) == "algorithm.policy_loss: 'ppo' is not one of clip, gspo, reinforce, cispo"
    with pytest.raises(ConfigError, match="^algorithm.adv_estimator: 'nope' is not one of grpo, dr_grpo, "):
        get_estimator("nope")


def test_presets_name_declared_entries():
    for name, p in presets.PRESETS.items():
        assert p["algorithm.adv_estimator"] in names.ADV_ESTIMATORS, name
        assert p["algorithm.policy_loss"] in names.POLICY_LOSSES, name
        assert p["algorithm.kl_estimator"] in names.KL_ESTIMATORS, name
        assert p["algorithm.loss_agg_mode"] in names.AGG_MODES, name
        assert p["algorithm.scale_rewards"] in names.SCALE_REWARDS, name


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
