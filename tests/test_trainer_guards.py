"""The trainer's ceilings: sizes the memory cannot hold are refused before anything is allocated (issue 34,
failure 6), and an update that makes the weights non-finite is undone and counted, never saved (failure 7)."""

import json

import pytest
import torch
from conftest import run_cli
from safetensors.torch import load_file
from test_grpo import TINY, make_trainer

from grpolab.config import Config
from grpolab.config.load import load_config
from grpolab.errors import ConfigError, TrainingError
from grpolab.models import CharTokenizer, build_builtin
from grpolab.train.finite_step import count_nonfinite, restore, snapshot
from grpolab.train.memory_budget import (
    ModelShape,
    batch_bytes,
    builtin_shape,
    check_memory,
    eval_rows,
    kv_cache_bytes,
    model_shape,
    rollout_rows,
)

# ---------------------------------------------------------------- failure 6: sizes with no ceiling

def test_the_estimate_is_the_plain_count_of_kv_cache_logits_and_buffers():
    s = ModelShape(layers=3, kv_heads=2, head_dim=16, vocab=300, dtype_bytes=2)
    rows, prompt, new = 24, 40, 12
    kv = 2 * 3 * 24 * 2 * (40 + 12) * 16 * 2            # keys and values, every layer, row, head, position
    logits = 24 * 300 * 4 * 2                           # float32 logits and probabilities of one position
    buffers = 24 * (12 * (8 + 4 + 1) + 40 * (8 + 1))    # completion ids/log-probs/mask, prompt ids/mask
    assert kv_cache_bytes(s, rows, prompt + new) == kv
    assert batch_bytes(s, rows, prompt, new) == kv + logits + buffers
    assert rollout_rows(16, 8) == 128 and rollout_rows(16, 8, world_size=4) == 32
    assert eval_rows(8, 512, 200) == 64 * 8                # 512 // 8 problems x 8 samples
    assert eval_rows(1, 512, 200) == 200                   # greedy only: the problems, up to batch_size
    assert eval_rows(100_000_000, 512, 200) == 100_000_000  # one problem's k samples at once


def test_the_shape_is_what_the_caches_really_allocate(tiny_gpt):
    from transformers import LlamaConfig, LlamaForCausalLM
    s = model_shape(tiny_gpt)
    cache = tiny_gpt.new_cache(6, 50)
    assert cache.kv.numel() * cache.kv.element_size() == kv_cache_bytes(s, 6, 50)
    tok = CharTokenizer()
    assert builtin_shape(Config().model, tok.vocab_size) == model_shape(build_builtin(Config().model, tok))
    # grouped-query attention: fewer key/value heads than query heads
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=1, intermediate_size=64)).eval()
    s = model_shape(hf)
    assert (s.layers, s.kv_heads, s.head_dim, s.vocab, s.dtype_bytes) == (2, 1, 16, 100, 4)
    with torch.no_grad():
        past = hf(torch.zeros(3, 7, dtype=torch.long), use_cache=True).past_key_values
    held = sum(t.numel() * t.element_size() for layer in past.layers for t in (layer.keys, layer.values))
    assert held == kv_cache_bytes(s, 3, 7)


def test_the_default_config_fits_and_the_boundary_is_exact():
    cfg = Config()
    shape = builtin_shape(cfg.model, CharTokenizer().vocab_size)
    check_memory(cfg, shape, 60, 200, available=4 * 2 ** 30)   # the demo's sizes: far below 4 GB
    rows = rollout_rows(cfg.rollout.prompts_per_step, cfg.rollout.num_generations)
    need = batch_bytes(shape, rows, 60, cfg.rollout.max_new_tokens)
    cfg.eval.k = 1   # the eval batch smaller than the rollout's
    cfg.eval.batch_size = 1
    check_memory(cfg, shape, 60, 200, available=need)
    with pytest.raises(ConfigError, match=r"rollout\.prompts_per_step=16 x rollout\.num_generations=8"):
        check_memory(cfg, shape, 60, 200, available=need - 1)


def test_a_size_beyond_the_memory_is_one_line_before_the_warm_start(tmp_path):
    r = run_cli("train", *TINY, "rollout.num_generations=1000000000", f"train.output_dir={tmp_path}", timeout=120)
    err = r.stderr.strip()
    assert r.returncode == 2 and len(err.splitlines()) == 1, r.stderr
    assert err.startswith("grpolab: config error: rollout.prompts_per_step=2 x rollout.num_generations=1000000000")
    assert "needs at least" in err and "available" in err
    assert "warm start" not in r.stdout and not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize("override, key", [("rollout.prompts_per_step=100000000", "rollout.prompts_per_step"),
                                           ("eval.k=100000000", "eval.k")])
def test_other_sizes_beyond_the_memory_are_refused_in_build_trainer(override, key, tmp_path):
    """build_trainer refuses before the warm start: with sft.steps=10**9 a warm start would not end."""
    with pytest.raises(ConfigError, match=f"{key}=100000000.*needs at least .* available"):
        make_trainer(tmp_path, override, "sft.steps=1000000000")


def test_a_hugging_face_policy_is_checked_at_trainer_construction(tmp_path):
    from grpolab.models.tiny_hf import save_tiny_model
    base = save_tiny_model(tmp_path / "llama", vocab_size=300, hidden=32, layers=2, heads=2, intermediate=64)
    with pytest.raises(ConfigError, match="rollout.num_generations=1000000000"):
        make_trainer(tmp_path / "run", f"model.name_or_path={base}", "rollout.num_generations=1000000000")


# ---------------------------------------------------------------- failure 7: non-finite weights

def test_an_overflowing_update_is_found_and_undone_exactly():
    """A real AdamW step whose finite gradient pushes a float32 weight past 3.4e38: caught, and the
    weights and optimizer state are back to the bits they had (also when the state existed before)."""
    p = torch.nn.Parameter(torch.tensor([3.3e38, 1.0, -2.0]))
    opt = torch.optim.AdamW([p], lr=2e37, weight_decay=0.0)
    p.grad = torch.tensor([-1.0, 0.5, 0.5])   # the first Adam step moves each weight by lr (sign of -grad)
    saved = snapshot(opt)
    opt.step()
    assert count_nonfinite([p]) == 1 and torch.isinf(p[0])
    restore(opt, saved)
    assert torch.equal(p.detach(), torch.tensor([3.3e38, 1.0, -2.0])) and p not in opt.state
    # with state from an earlier, good step
    opt.param_groups[0]["lr"] = 1e-3
    p.grad = torch.tensor([0.1, 0.1, 0.1])
    opt.step()
    before = p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}
    opt.param_groups[0]["lr"] = 2e37
    p.grad = torch.tensor([-1.0, 0.5, 0.5])
    saved = snapshot(opt)
    opt.step()
    assert count_nonfinite([p]) == 1
    restore(opt, saved)
    assert torch.equal(p.detach(), before[0])
    assert all(torch.equal(opt.state[p][k], v) for k, v in before[1].items())


def test_a_grpo_step_that_overflows_float16_weights_is_undone_counted_and_never_saved(tmp_path):
    """float16 weights (float32 master copies): lr 1e6 keeps the masters finite but overflows the float16
    weights. Every such update is undone and counted like a non-finite loss; the checkpoints hold the
    starting weights; past train.max_bad_steps the run stops with a TrainingError."""
    from grpolab.models.tiny_hf import save_tiny_model
    base = save_tiny_model(tmp_path / "llama", vocab_size=300, hidden=32, layers=2, heads=2, intermediate=64)
    args = [f"model.name_or_path={base}", "model.dtype=float16", "reward.functions=[length]", "optim.lr=1e6",
            "optim.weight_decay=0.0", "train.undo_nonfinite_updates=true"]
    tr = make_trainer(tmp_path / "run", *args, "train.max_steps=2", "train.save_every=1")
    start = {k: v.clone() for k, v in tr.model.state_dict().items()}
    history = tr.train()
    assert tr.bad_steps == 2 and len(history) == 2
    for step in (1, 2):
        saved = load_file(str(tmp_path / "run" / "checkpoints" / f"step_{step}" / "model.safetensors"))
        assert all(torch.isfinite(v).all() for v in saved.values())
    assert all(torch.equal(v, start[k]) for k, v in tr.model.state_dict().items())
    assert all(torch.isfinite(m).all() for m in tr.master.master)
    tr = make_trainer(tmp_path / "stop", *args, "train.max_steps=3", "train.max_bad_steps=0")
    with pytest.raises(TrainingError, match=r"NaN/inf.*update undone"):
        tr.train()


def test_an_offline_step_that_overflows_float16_weights_is_undone(tmp_path):
    from grpolab.jobs.sft import run_sft
    from grpolab.models.tiny_hf import save_tiny_model
    from grpolab.monitor.console import Console
    base = save_tiny_model(tmp_path / "llama", vocab_size=300, hidden=32, layers=2, heads=2, intermediate=64)
    cfg = load_config(None, [*TINY, f"model.name_or_path={base}", "model.dtype=float16", "sft.lr=1e6",
                             "sft.steps=2", "sft.warmup_steps=0", "sft.weight_decay=0.0", "eval.num_problems=2",
                             "eval.k=1", f"train.output_dir={tmp_path / 'run'}", "train.undo_nonfinite_updates=true"])
    run_sft(cfg, Console(quiet=True))
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    saved = load_file(str(tmp_path / "run" / "checkpoints" / "step_2" / "model.safetensors"))
    assert all(torch.isfinite(v).all() for v in saved.values())
    original = load_file(str(base / "model.safetensors"))
    assert all(torch.equal(saved[k], original[k].to(saved[k].dtype)) for k in original if k in saved)


@pytest.mark.slow
def test_by_default_an_overflowing_update_stops_the_run_in_one_line_and_keeps_the_last_checkpoint(tmp_path):
    """Without train.undo_nonfinite_updates (no per-step copy), the first update that overflows the float16
    weights stops the run: exit 2, one line, and no checkpoint holds the broken weights."""
    from grpolab.models.tiny_hf import save_tiny_model
    base = save_tiny_model(tmp_path / "llama", vocab_size=300, hidden=32, layers=2, heads=2, intermediate=64)
    run = tmp_path / "run"
    r = run_cli("train", *TINY, f"model.name_or_path={base}", "model.dtype=float16", "reward.functions=[length]",
                "optim.lr=1e6", "optim.weight_decay=0.0", "train.max_steps=2", "train.save_every=1",
                f"train.output_dir={run}", timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("grpolab:") and "SIG" not in ln]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "step 1: the update made weights NaN/inf" in lines[0] and "train.undo_nonfinite_updates" in lines[0]
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").glob("step_*"))


def test_an_offline_job_refuses_an_eval_batch_beyond_the_memory_before_training(tmp_path):
    from grpolab.jobs.sft import run_sft
    from grpolab.monitor.console import Console
    cfg = load_config(None, [*TINY, "sft.steps=3", "eval.k=100000000", f"train.output_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=r"eval\.k=100000000.*needs at least .* available"):
        run_sft(cfg, Console(quiet=True))
    assert not (tmp_path / "metrics.jsonl").exists()
