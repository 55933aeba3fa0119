"""rollout.source and vllm.* as config: what is refused before vLLM is touched, in one line each.
(The engine itself is tested in tests/with_vllm, with vLLM.)"""

import pytest
from conftest import HAS_VLLM, run_cli

from grpolab.config.load import load_config
from grpolab.errors import ConfigError
from grpolab.models.tiny_hf import save_tiny_model


@pytest.mark.parametrize("overrides, message", [
    (["rollout.source=sglang"], "rollout.source: 'sglang' is not one of builtin, vllm"),
    (["rollout.source=vllm"], "rollout.source: vllm runs Hugging Face models; the built-in GPT"),
    (["model.name_or_path=some/model", "rollout.source=vllm", "rollout.tools=[calculator]"],
     "rollout.source: vllm does not run tool rollouts yet"),
    (["vllm.gpu_memory_utilization=0"], "vllm.gpu_memory_utilization: must be in (0, 1]"),
    (["vllm.gpu_memory_utilization=1.5"], "vllm.gpu_memory_utilization: must be in (0, 1]"),
    (["vllm.max_model_len=32", "rollout.max_new_tokens=32"], "vllm.max_model_len: must exceed rollout.max_new_tokens"),
])
def test_bad_engine_settings_are_refused_with_the_key(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert str(e.value).startswith(message), str(e.value)


def test_the_defaults_are_the_builtin_engine():
    cfg = load_config(None, [])
    assert cfg.rollout.source == "builtin" and cfg.vllm.eval is False
    load_config(None, ["model.name_or_path=some/model", "rollout.source=vllm", "vllm.max_model_len=64"])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("m") / "tiny", vocab_size=300, hidden=128, layers=1, heads=4,
                           intermediate=128)


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed in this Python")
@pytest.mark.parametrize("workers", [[], ["--rollout-workers", "1", "train.async_steps=1"]])
def test_without_vllm_installed_the_error_says_how_to_install_it(tiny, tmp_path, workers):
    # with rollout workers too: they import vLLM in their own processes, which used to abort there (exit 134)
    r = run_cli("train", "configs/demo.yaml", f"model.name_or_path={tiny}", "data.task=arithmetic",
                "rollout.source=vllm", "sft.steps=0", "train.max_steps=1", f"train.output_dir={tmp_path}", *workers)
    assert r.returncode == 2, r.stdout + r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("grpolab: config error: rollout.source: vllm needs vLLM in this Python"), r.stderr
    assert "make vllm" in last and "Traceback" not in r.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.slow
def test_vllm_with_several_ranks_is_refused(tiny, tmp_path):
    r = run_cli("train", "configs/demo.yaml", f"model.name_or_path={tiny}", "data.task=arithmetic", "--nproc", "2",
                "rollout.source=vllm", "sft.steps=0", "train.max_steps=1", f"train.output_dir={tmp_path}")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "rollout.source: vllm runs in one process for now" in r.stderr and "Traceback" not in r.stderr
