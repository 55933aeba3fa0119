"""Config edges a hostile user finds (issue 34): non-finite numbers in any key, duplicate YAML keys,
non-UTF-8 or absurdly nested files, a section given as a scalar, thread counts with no ceiling, the
reward timeout, and the reward model's held-out default. Each is one line naming the key or line."""

import dataclasses
import math
import os

import pytest
from conftest import run_cli

from grpolab.config import Config, JudgeConfig
from grpolab.config.load import load_config
from grpolab.config.validate import max_threads, validate
from grpolab.data.preference import heldout_size
from grpolab.errors import ConfigError

NON_FINITE = ("inf", "-inf", "nan", ".inf", "-.inf", ".nan", "1e999")


def _float_keys(obj, prefix):
    """Every float-typed key of a config section and its nested sections (walked here by hand, not with
    the code under test)."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from _float_keys(value, f"{prefix}{f.name}.")
        elif f.type.replace(" | None", "") == "float":
            yield f"{prefix}{f.name}"


def _one_line(r, *want):
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("warning:")]
    assert len(lines) == 1 and lines[0].startswith("grpolab: config error: "), r.stderr
    for text in want:
        assert text in lines[0], (text, lines[0])
    return lines[0]


ALL_FLOAT_KEYS = [k for f in dataclasses.fields(Config) for k in _float_keys(getattr(Config(), f.name), f.name + ".")] \
    + [f"reward.judges.grader.{k}" for k in _float_keys(JudgeConfig(), "")]


def test_the_walk_finds_the_float_keys():
    assert len(ALL_FLOAT_KEYS) > 40
    for key in ("optim.lr", "algorithm.beta", "reward.timeout", "reward.code_exec.timeout", "dpo.beta",
                "reward.judges.grader.timeout", "algorithm.epsilon_high", "rollout.temperature"):
        assert key in ALL_FLOAT_KEYS, key


@pytest.mark.parametrize("value", NON_FINITE)
def test_every_float_key_refuses_a_non_finite_value(value):
    for key in ALL_FLOAT_KEYS:
        with pytest.raises(ConfigError) as e:
            load_config(None, [f"{key}={value}"])
        assert str(e.value).startswith(f"{key}: must be a finite number, got "), (key, str(e.value))


def test_validate_refuses_non_finite_values_set_in_code():
    """A Config built in code (or from a dict) never went through the override parser: validate walks it."""
    for key in ALL_FLOAT_KEYS:
        for value in (math.inf, -math.inf, math.nan):
            cfg = Config()
            *path, name = key.split(".")
            obj = cfg
            for part in path:
                obj = obj.setdefault(part, JudgeConfig(base_url="http://127.0.0.1:1/v1", model="m")) \
                    if isinstance(obj, dict) else getattr(obj, part)
            setattr(obj, name, value)
            with pytest.raises(ConfigError) as e:
                validate(cfg)
            assert str(e.value).startswith(f"{key}: must be a finite number"), (key, value, str(e.value))
    cfg = Config()
    cfg.reward.weights = [1.0, math.inf]
    cfg.reward.functions = ["gsm8k_accuracy", "length"]
    with pytest.raises(ConfigError, match=r"^reward\.weights: must be finite numbers"):
        validate(cfg)


def test_a_number_too_big_for_a_float_is_refused_not_a_traceback():
    with pytest.raises(ConfigError, match=r"^optim\.lr: must be a finite number, got 1000"):
        load_config(None, ["optim.lr=1" + "0" * 400])


@pytest.mark.slow
@pytest.mark.parametrize("override,key", [("optim.lr=inf", "optim.lr"), ("algorithm.beta=inf", "algorithm.beta")])
def test_cli_refuses_infinite_lr_and_beta_in_one_line(override, key, tmp_path):
    r = run_cli("train", override, f"train.output_dir={tmp_path / 'run'}", timeout=120)
    _one_line(r, f"{key}: must be a finite number, got 'inf'")
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_reward_timeout_is_finite_and_not_negative():
    assert Config().reward.timeout == 300.0
    assert load_config(None, ["reward.timeout=0"]).reward.timeout == 0.0   # 0 = no limit
    with pytest.raises(ConfigError, match=r"^reward\.timeout: must be >= 0 and at most"):
        load_config(None, ["reward.timeout=-1"])
    with pytest.raises(ConfigError, match=r"^reward\.timeout: must be a finite number"):
        load_config(None, ["reward.timeout=inf"])


@pytest.mark.parametrize("key", ["reward.timeout", "reward.code_exec.timeout"])
def test_a_finite_but_huge_timeout_is_refused(key):
    # 1e308 is finite, and used to kill the watchdog thread with an OverflowError while the run went on
    assert load_config(None, [f"{key}=10000000"])
    with pytest.raises(ConfigError, match=rf"^{key}: must be > ?=? ?0 and at most 10000000 seconds"):
        load_config(None, [f"{key}=1e308"])


def test_code_exec_tmp_mb_is_at_most_the_machines_memory():
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2 ** 20   # written out here, not imported
    assert load_config(None, [f"reward.code_exec.tmp_mb={total}"])
    with pytest.raises(ConfigError, match=r"^reward\.code_exec\.tmp_mb: 100000000 MB is more than this machine"):
        load_config(None, ["reward.code_exec.tmp_mb=100000000"])


def test_a_seed_beyond_64_bits_is_one_line(tmp_path):
    for seed in (2 ** 64 - 1, -(2 ** 63)):
        assert load_config(None, [f"train.seed={seed}"]).train.seed == seed
    _one_line(run_cli("train", "train.seed=99999999999999999999999", f"train.output_dir={tmp_path}", timeout=120),
              "train.seed: 99999999999999999999999 does not fit in 64 bits")


def test_a_directory_given_as_the_config_file_says_so(tmp_path):
    _one_line(run_cli("train", str(tmp_path), timeout=120), f"config file {str(tmp_path)!r} is a directory")


def test_a_section_given_as_a_mapping_on_the_command_line_sets_its_keys(tmp_path):
    cfg = load_config(None, ["optim={lr: 0.25, warmup_steps: 3}", "reward.code_exec={timeout: 7}"])
    assert (cfg.optim.lr, cfg.optim.warmup_steps, cfg.reward.code_exec.timeout) == (0.25, 3, 7)
    # a bad value inside it is named by its own key, not called "not a mapping"
    _one_line(run_cli("train", "optim={lr: .inf}", f"train.output_dir={tmp_path}", timeout=120), "optim.lr: must be a "
              "finite number")


def test_rollout_workers_are_at_most_the_cores(tmp_path):
    cores = os.cpu_count()
    assert load_config(None, [f"train.rollout_workers={cores}", "train.async_steps=1"]).train.rollout_workers == cores
    _one_line(run_cli("train", "--rollout-workers", "5000", "train.async_steps=1", f"train.output_dir={tmp_path}",
                      timeout=120), f"train.rollout_workers: 5000 is more than this machine's {cores} cores")


@pytest.mark.parametrize("override", ["model.n_embd=40000", "model.block_size=1000000000"])
def test_a_builtin_model_larger_than_the_machine_is_one_line(override, tmp_path):
    # 40000 wide: 4 blocks x 12 x 40000^2 weights x 16 bytes (weights, gradients, two AdamW moments) ~ 1.2 TB;
    # a 1e9-token context: cos/sin tables of 3 x 128 x 1e9 float32 each ~ 3 TB
    _one_line(run_cli("train", override, "model.n_head=4", f"train.output_dir={tmp_path}", timeout=120),
              "the built-in GPT would need at least", "more than this machine's")
    assert load_config(None, ["model.n_embd=256", "model.block_size=4096"])   # a larger model that fits


def test_a_yaml_alias_bomb_is_one_line_not_a_spin(tmp_path):
    bomb = tmp_path / "bomb.yaml"   # 9^9 values once expanded, all under one valid key
    bomb.write_text("rollout:\n  tools:\n" + "\n".join(
        f"    - &a{i} [{', '.join(['lol'] * 9 if i == 0 else [f'*a{i - 1}'] * 9)}]" for i in range(9)) + "\n")
    _one_line(run_cli("train", str(bomb), f"train.output_dir={tmp_path / 'run'}", timeout=120),
              "its YAML aliases (*name) expand to more than 100,000 values")
    ok = tmp_path / "merge.yaml"   # an ordinary anchor and merge still read
    ok.write_text("optim: &o {lr: 0.001}\ndpo:\n  <<: *o\n")
    assert load_config(str(ok)).dpo.lr == 0.001


def test_train_threads_has_a_ceiling():
    ceiling = max(256, 4 * os.cpu_count())
    assert max_threads() == ceiling
    assert load_config(None, [f"train.threads={ceiling}"]).train.threads == ceiling
    with pytest.raises(ConfigError) as e:
        load_config(None, ["train.threads=100000"])
    assert str(e.value).startswith(f"train.threads: 100000 is more than {ceiling}"), str(e.value)


def test_cli_refuses_train_threads_100000(tmp_path):
    _one_line(run_cli("train", "train.threads=100000", f"train.output_dir={tmp_path}", timeout=120),
              "train.threads: 100000 is more than")


def test_duplicate_yaml_keys_are_refused_naming_the_key_and_lines(tmp_path):
    p = tmp_path / "dup.yaml"
    p.write_text("optim:\n  lr: 1.0e-4\n  warmup_steps: 2\n  lr: 1.0e-2\nsft:\n  lr: 1.0e-3\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert str(e.value) == (f"config file {str(p)!r}: line 4: key 'lr' is given twice in one section (first on "
                            f"line 2); keep one")
    p.write_text("optim:\n  lr: 1.0e-4\ntrain:\n  max_steps: 3\noptim:\n  warmup_steps: 1\n")
    with pytest.raises(ConfigError, match=r"line 5: key 'optim' is given twice in one section \(first on line 1\)"):
        load_config(p)
    # the same name in two sections, and YAML merge keys, are not duplicates
    p.write_text("optim:\n  lr: 2.0e-4\nsft:\n  <<: {lr: 1.0e-3, steps: 5}\n  lr: 3.0e-3\n")
    cfg = load_config(p)
    assert (cfg.optim.lr, cfg.sft.lr, cfg.sft.steps) == (2e-4, 3e-3, 5)


def test_cli_refuses_duplicate_keys_in_one_line(tmp_path):
    p = tmp_path / "dup.yaml"
    p.write_text("rollout:\n  temperature: 0.7\n  temperature: 1.3\n")
    _one_line(run_cli("train", str(p), timeout=120),
              f"config file {str(p)!r}: line 3: key 'temperature' is given twice")


def test_non_utf8_config_names_the_line(tmp_path):
    p = tmp_path / "latin1.yaml"
    line3 = "  output_dir: runs/caf"
    p.write_bytes(f"train:\n  max_steps: 3\n{line3}\u00e9\n".encode("latin-1"))
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert str(e.value) == (f"config file {str(p)!r}: line 3 is not UTF-8 text (byte 0xe9 at column "
                            f"{len(line3) + 1}); save the file as UTF-8")
    _one_line(run_cli("train", str(p), timeout=120), "line 3 is not UTF-8 text")
    p.write_bytes(b"\xef\xbb\xbftrain:\n  max_steps: 3\n")   # a UTF-8 byte-order mark is fine
    assert load_config(p).train.max_steps == 3


def test_deeply_nested_yaml_is_one_line(tmp_path):
    p = tmp_path / "deep.yaml"
    p.write_text("rollout:\n  tools: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(ConfigError, match=r"nested too deeply"):
        load_config(p)


def test_a_section_given_as_a_scalar_says_it_must_be_a_mapping(tmp_path):
    p = tmp_path / "scalar.yaml"
    p.write_text("rollout: 5\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert str(e.value).startswith("rollout: is a section and must be a mapping of its keys"), str(e.value)
    assert str(e.value).endswith("got 5")
    p.write_text("reward:\n  code_exec: 5\n")
    with pytest.raises(ConfigError, match=r"^reward\.code_exec: is a section and must be a mapping"):
        load_config(p)
    with pytest.raises(ConfigError, match=r"^rollout: is a section"):
        load_config(None, ["rollout=5"])
    p.write_text("rollout:\ntrain:\n  max_steps: 4\n")   # an empty section sets nothing
    assert load_config(p).train.max_steps == 4 and load_config(p).rollout == Config().rollout
    p.write_text("rollout: 5\n")
    _one_line(run_cli("train", str(p), timeout=120), "rollout: is a section and must be a mapping")


def test_rm_held_out_pairs_default_to_a_tenth_between_1_and_200():
    assert Config().rm.eval_size is None and load_config(None, ["rm.eval_size=16"]).rm.eval_size == 16
    for n in (1, 2, 9, 10, 25, 199, 2000, 2010, 100000):
        want = 0 if n == 1 else (1 if n < 20 else (n // 10 if n < 2010 else 200))
        assert heldout_size(None, n) == want, n
    assert heldout_size(16, 20) == 16 and heldout_size(0, 5000) == 0 and heldout_size(200, 8595) == 200
    with pytest.raises(ConfigError, match=r"^rm\.eval_size: must be >= 0"):
        load_config(None, ["rm.eval_size=-1"])
