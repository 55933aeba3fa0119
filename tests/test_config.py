import pytest
from conftest import run_cli

from grpolab.config import Config
from grpolab.config.load import config_from_dict, load_config
from grpolab.errors import ConfigError


def test_defaults_validate_and_required_keys_exist():
    cfg = load_config()
    for key in ("train.max_steps", "train.output_dir", "train.seed", "train.save_every", "rollout.num_generations",
                "rollout.max_new_tokens", "rollout.temperature", "algorithm.beta", "algorithm.epsilon", "optim.lr"):
        section, name = key.split(".")
        assert hasattr(getattr(cfg, section), name), key


def test_yaml_then_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("rollout:\n  temperature: 0.7\n  num_generations: 4\noptim:\n  lr: 3e-5\n")
    cfg = load_config(p, ["rollout.num_generations=6", "algorithm.epsilon_high=0.28"])
    assert cfg.rollout.temperature == 0.7 and cfg.rollout.num_generations == 6
    assert cfg.optim.lr == pytest.approx(3e-5)  # YAML reads '3e-5' as a string: still a float here
    assert cfg.algorithm.epsilon_high == 0.28
    assert isinstance(Config().to_dict()["rollout"], dict)


@pytest.mark.parametrize("override,msg", [
    ("rollout.temprature=0.5", "unknown config key 'rollout.temprature'; did you mean rollout.temperature?"),
    ("nosuch.key=1", "unknown config key 'nosuch.key'"),
    ("rollout.temperature=hot", "rollout.temperature: expected float, got 'hot'"),
    ("rollout.temperature=0", "rollout.temperature: must be >= 1e-05"),
    ("rollout.temperature=1e-300", "rollout.temperature: must be >= 1e-05"),   # logits / T would overflow float32
    ("rollout.num_generations=1", "rollout.num_generations: must be >= 2"),
    ("algorithm.epsilon=1.5", "algorithm.epsilon: must be in (0, 1)"),
    ("algorithm.beta=-1", "algorithm.beta: must be >= 0"),
    ("optim.lr_schedule=step", "optim.lr_schedule: 'step' is not one of constant, linear, cosine"),
    ("train.strategy=zero3", "train.strategy: 'zero3' is not one of ddp, fsdp"),
    ("reward.functions=[nope]", "reward.functions: unknown reward 'nope'"),
    ("reward.weights=[1.0,2.0]", "reward.weights: 2 weights for 1 functions"),
    ("train.max_steps=2.5", "train.max_steps: expected int, got 2.5"),
    ("model.n_embd=100", "model.n_embd: 100 must be a multiple of 2*model.n_head"),
    ("model.n_embd=12", "model.n_embd: 12 must be a multiple of 2*model.n_head (8) for RoPE"),  # 4 heads of 3: odd
    ("rollout.max_new_tokens", "must look like section.key=value"),
])
def test_bad_values_name_the_key_and_the_fix(override, msg):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert msg in str(e.value)


def test_cli_config_error_is_one_line_exit_2(tmp_path):
    r = run_cli("train", "rollout.temprature=0.5", f"train.output_dir={tmp_path / 'run'}")
    assert r.returncode == 2
    assert r.stderr.strip() == ("grpolab: config error: unknown config key 'rollout.temprature'; "
                                "did you mean rollout.temperature?")
    assert "Traceback" not in r.stdout + r.stderr
    assert not (tmp_path / "run").exists()  # nothing written for a config that does not validate


@pytest.mark.slow
def test_cli_missing_config_file_and_bad_yaml(tmp_path):
    r = run_cli("train", str(tmp_path / "missing.yaml"))
    assert r.returncode == 2 and "not found" in r.stderr and "Traceback" not in r.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout: [1, 2\n")
    r = run_cli("train", str(bad))
    assert r.returncode == 2 and "not valid YAML" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_cli_page_documents_every_command_and_readme_stays_inside_the_repository():
    """Every CLI command is documented on docs/cli.md, and the README points at no file outside the repository."""
    import re

    from conftest import ROOT

    from grpolab.cli import _parser
    cli_page = (ROOT / "docs" / "cli.md").read_text()
    readme = (ROOT / "README.md").read_text()
    commands = _parser()._subparsers._group_actions[0].choices
    assert {"serve", "generate", "eval", "export"} <= set(commands)
    for name in commands:
        assert f"`grpolab {name}" in cli_page, f"grpolab {name} missing from docs/cli.md"
    outside = re.findall(r"(?<![\w.])\.\./[\w./-]+|/work/[\w./-]+|/home/[\w./-]+", readme)
    assert outside == [], outside


def test_pyproject_licence_is_an_spdx_string_with_its_file():
    import tomllib
    from conftest import ROOT
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "MIT" and project["license-files"] == ["LICENSE"]
    assert (ROOT / "LICENSE").read_text().startswith("MIT License")


def test_example_configs_load_and_validate():
    from pathlib import Path
    configs = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))
    assert {p.name for p in configs} >= {"demo.yaml", "code_demo.yaml", "gsm8k_tiny_hf.yaml", "gsm8k_qwen.yaml",
                                         "r1_pipeline.yaml"}
    from grpolab.jobs.pipeline import stage_configs
    for p in configs:
        if "stages:" in p.read_text():   # a pipeline: every stage's config is built and validated
            _, stages = stage_configs(p, [])
            assert [job for job, _ in stages] and all(cfg.train.output_dir for _, cfg in stages)
        else:
            load_config(p)


def test_override_text_keeps_hash_signs():
    cfg = load_config(None, ['data.prompt_suffix=Answer after ####.', "data.system_prompt='quoted # text'"])
    assert cfg.data.prompt_suffix == "Answer after ####."
    assert cfg.data.system_prompt == "quoted # text"


NOTICE = "grpolab: rollout.engine is now rollout.source (read as rollout.source={})"


def test_a_renamed_key_is_read_as_its_new_name_with_one_notice(tmp_path, capsys):
    p = tmp_path / "old.yaml"
    p.write_text("model:\n  name_or_path: some/model\nrollout:\n  engine: vllm\n")
    assert load_config(p).rollout.source == "vllm"   # a YAML file
    assert capsys.readouterr().err.splitlines() == [NOTICE.format("vllm")]
    assert load_config(p, ["rollout.engine=builtin"]).rollout.source == "builtin"   # the file's, then an override
    assert capsys.readouterr().err.splitlines() == [NOTICE.format("builtin")]
    assert config_from_dict({"rollout.engine": "builtin"}).rollout.source == "builtin"   # the Python API's keys
    assert capsys.readouterr().err.splitlines() == [NOTICE.format("builtin")]
    assert load_config(p, ["rollout.source=vllm"]).rollout.source == "vllm"   # both, agreeing
    assert capsys.readouterr().err.splitlines() == [NOTICE.format("vllm")]
    assert "engine" not in load_config(None, ["rollout.engine=builtin"]).to_dict()["rollout"]   # config.yaml's
    assert load_config(None, ["rollout.source=vllm", "model.name_or_path=m"]).rollout.source == "vllm"
    capsys.readouterr()
    load_config(None, ["rollout.source=vllm", "model.name_or_path=m"])
    assert capsys.readouterr().err == ""   # the new key alone: no notice


def test_a_renamed_key_and_its_new_name_disagreeing_is_one_error_naming_both(tmp_path):
    p = tmp_path / "both.yaml"
    p.write_text("rollout:\n  source: builtin\n")
    with pytest.raises(ConfigError) as e:
        load_config(p, ["rollout.engine=vllm"])
    assert str(e.value) == ("rollout.engine='vllm' and rollout.source='builtin' disagree: rollout.engine is now "
                            "rollout.source; give rollout.source alone")


@pytest.mark.slow
def test_the_cli_refuses_a_renamed_key_and_its_new_name_disagreeing_with_exit_2(tmp_path):
    r = run_cli("train", "rollout.engine=vllm", "rollout.source=builtin", f"train.output_dir={tmp_path / 'run'}")
    assert r.returncode == 2 and r.stderr.strip() == ("grpolab: config error: rollout.engine='vllm' and "
                                                      "rollout.source='builtin' disagree: rollout.engine is now "
                                                      "rollout.source; give rollout.source alone"), r.stderr


def test_an_unknown_value_of_a_renamed_key_lists_the_choices_under_the_new_name():
    with pytest.raises(ConfigError, match=r"^rollout.source: 'sglang' is not one of builtin, vllm$"):
        load_config(None, ["rollout.engine=sglang"])


def test_a_pipeline_reads_a_renamed_shared_key_once(tmp_path, capsys):
    p = tmp_path / "pipe.yaml"
    p.write_text("rollout:\n  engine: builtin\nstages:\n  - job: sft\n  - job: train\n")
    from grpolab.jobs.pipeline import stage_configs
    _, stages = stage_configs(p, [])
    assert [cfg.rollout.source for _, cfg in stages] == ["builtin", "builtin"]
    assert capsys.readouterr().err.splitlines() == [NOTICE.format("builtin")]


def test_a_run_saved_with_a_renamed_key_resumes_under_its_new_name(tmp_path):
    from grpolab.models.checkpoint import RUN_CONFIG
    from grpolab.train.resume_rules import check_resume_config
    ckpt = tmp_path / "checkpoints" / "step_2"
    ckpt.mkdir(parents=True)
    (ckpt / RUN_CONFIG).write_text("rollout:\n  engine: builtin\n  temperature: 1.0\n")   # an older run's
    new = load_config(None, ["rollout.temperature=1.0"]).to_dict()
    check_resume_config(new, ckpt, "grpo")   # the same source: resumes
    new["rollout"]["source"] = "vllm"
    with pytest.raises(ConfigError, match=r"rollout.source \('builtin' -> 'vllm'\)"):
        check_resume_config(new, ckpt, "grpo")
