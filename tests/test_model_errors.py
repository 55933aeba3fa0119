"""Model loading edges (issue 34): chat rows on a model with no chat template, model.device=cuda on a
machine without CUDA, a LoRA target that matches no layer, and a hub id the hub cannot be asked for.
Each is one line at start-up, exit 2; through the real CLI where the CLI is the promise."""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
from conftest import ROOT, _free_port

from grpolab.config.load import load_config
from grpolab.errors import ConfigError, DataError
from grpolab.models import GPT, CharTokenizer, GPTConfig
from grpolab.models.lora import lora_config
from grpolab.models.tiny_hf import save_tiny_model

QUICK = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "sft.steps=0", "data.train_size=20",
         "data.test_size=4", "rollout.prompts_per_step=2", "rollout.num_generations=2", "rollout.max_new_tokens=4",
         "eval.num_problems=2", "train.max_steps=1"]


def _cli(*args, env=None, timeout=180):
    """The real `grpolab` entry point in a subprocess, with extra environment variables."""
    return subprocess.run([sys.executable, "-m", "grpolab.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout, env={**os.environ, **(env or {})})


def _one_line(r, kind, *want):
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("warning:")]
    assert len(lines) == 1 and lines[0].startswith(f"grpolab: {kind}"), r.stderr
    for text in want:
        assert text in lines[0], (text, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def no_template_dir(tmp_path_factory):
    """A tiny Llama whose tokenizer has no chat template (a base model's)."""
    out = save_tiny_model(tmp_path_factory.mktemp("base") / "llama", vocab_size=300, hidden=32, layers=2, heads=2,
                          intermediate=64)
    (out / "chat_template.jinja").unlink()
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return out


# ---------------------------------------------------------------- chat rows, no chat template

def test_chat_prompt_on_a_tokenizer_without_template_is_a_data_error(no_template_dir):
    from transformers import AutoTokenizer

    from grpolab.models.hf import HFTokenizer
    tok = HFTokenizer(AutoTokenizer.from_pretrained(str(no_template_dir)))
    assert tok.render_prompt("2+2?") == tok.tok("2+2?")["input_ids"]   # text prompts need no template
    with pytest.raises(DataError, match=r"^a prompt is a list of chat messages, but the tokenizer of .*llama has no "
                                        r"chat template; give plain-text"):
        tok.render_prompt([{"role": "user", "content": "2+2?"}])
    with pytest.raises(DataError, match=r"^a row is a conversation \(chat messages\), but the tokenizer"):
        tok.render_conversation([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])


@pytest.mark.slow
def test_cli_chat_rows_on_a_model_without_template_stop_at_start_up(no_template_dir, tmp_path):
    rows = tmp_path / "chat.jsonl"
    rows.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"What is {i}+1?"}],
                                        "answer": str(i + 1)}) + "\n" for i in range(4)))
    r = _cli("train", *QUICK, f"model.name_or_path={no_template_dir}", "data.task=files", f"data.train_path={rows}",
             f"data.test_path={rows}", f"train.output_dir={tmp_path / 'run'}")
    _one_line(r, "data error: ", "a prompt is a list of chat messages", "has no chat template")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()   # nothing trained


# ---------------------------------------------------------------- model.device=cuda without CUDA

def test_cli_cuda_without_cuda_is_a_config_error(tmp_path):
    # CUDA_VISIBLE_DEVICES="" hides every GPU from torch, so this is a machine without CUDA on any host
    r = _cli("train", *QUICK, "model.device=cuda", f"train.output_dir={tmp_path / 'run'}",
             env={"CUDA_VISIBLE_DEVICES": ""})
    _one_line(r, "config error: ", "model.device: 'cuda', but ", "use cpu")


# ---------------------------------------------------------------- LoRA targets

def test_a_lora_target_that_matches_nothing_lists_the_layers():
    model = GPT(GPTConfig(vocab_size=CharTokenizer().vocab_size, n_layer=1, n_head=2, n_embd=32, block_size=96))
    m = load_config(None, ["model.lora_rank=4", "model.lora_target_modules=[qkv, q_proj]"]).model
    with pytest.raises(ConfigError) as e:
        lora_config(m, model)
    # the built-in GPT's linear layers, written out by hand
    assert str(e.value) == ("model.lora_target_modules: 'q_proj' matches no linear layer of the model; its linear "
                            "layers are fc, fc_out, lm_head, proj, qkv")
    m = load_config(None, ["model.lora_rank=4", "model.lora_target_modules=[qkv, blocks.0.fc]"]).model
    assert lora_config(m, model)["target_modules"] == ["qkv", "blocks.0.fc"]   # a dotted tail matches too


def test_cli_lora_target_that_matches_nothing(tmp_path):
    r = _cli("train", *QUICK, "model.lora_rank=4", "model.lora_target_modules=[q_proj]",
             f"train.output_dir={tmp_path / 'run'}")
    _one_line(r, "config error: ", "model.lora_target_modules: 'q_proj' matches no linear layer",
              "fc, fc_out, lm_head, proj, qkv")


# ---------------------------------------------------------------- a hub id, no hub

def _no_hub(tmp_path) -> dict:
    """An empty Hugging Face cache, and a hub endpoint on a local port nothing listens on."""
    return {"HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": f"http://127.0.0.1:{_free_port()}",
            "HF_HUB_OFFLINE": "0"}


def test_cli_unreachable_hub_is_one_line_without_retries(tmp_path):
    t0 = time.monotonic()
    r = _cli("train", *QUICK, "model.name_or_path=nobody/no-such-model", f"train.output_dir={tmp_path / 'run'}",
             env=_no_hub(tmp_path))
    took = time.monotonic() - t0
    _one_line(r, "error: ", "model.name_or_path: 'nobody/no-such-model' is not a local directory nor in the "
              "Hugging Face cache", "cannot be reached")
    assert "Retrying" not in r.stderr and took < 60, (took, r.stderr)   # huggingface_hub alone: ~46 s of retries


def test_cli_hf_hub_offline_is_one_line(tmp_path):
    r = _cli("train", *QUICK, "model.name_or_path=nobody/no-such-model", f"train.output_dir={tmp_path / 'run'}",
             env={**_no_hub(tmp_path), "HF_HUB_OFFLINE": "1"})
    _one_line(r, "error: ", "'nobody/no-such-model' is not a local directory nor in the Hugging Face cache, and "
              "HF_HUB_OFFLINE is set")


@pytest.mark.slow
def test_a_cached_hub_model_loads_when_the_hub_is_unreachable(no_template_dir, tmp_path):
    env = _no_hub(tmp_path)
    snapshot = tmp_path / "hf" / "hub" / "models--someone--tiny" / "snapshots" / ("0" * 40)
    shutil.copytree(no_template_dir, snapshot)   # the cache's layout: a snapshot named by its commit ...
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)   # ... and the branch pointing at it
    code = "from grpolab.models.hf import load_hf; m, t = load_hf('someone/tiny'); print(m.num_params())"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=180,
                       env={**os.environ, **env})
    assert r.returncode == 0, r.stderr[-2000:]
    assert int(r.stdout.split()[-1]) > 0 and "Retrying" not in r.stderr, r.stderr
