"""Memory ceilings: what a config's rollout and eval batches need, checked before anything is allocated.

A rollout decodes rollout.prompts_per_step x rollout.num_generations rows (per rank) at once, and an
eval batch up to eval.batch_size rows (k samples of each problem together), each row holding a KV
cache over its prompt and completion. Sizes with no ceiling (num_generations=1e9) used to grow until
the kernel's OOM killer stopped the run (or another process); the trainer now refuses them at
construction with one line naming the keys, the estimate and the memory available.

The estimate is a lower bound (what a batch cannot do without), so a refusal is never a false alarm:
    KV cache      2 (keys, values) x layers x rows x kv_heads x tokens x head_dim x bytes per weight
    logits        rows x vocab x 4 bytes x 2 (float32 logits and their probabilities, one position)
    token buffers rows x (completion tokens x (8 + 4 + 1) + prompt tokens x (8 + 1)) bytes
                  (ids, sampler log-probs and masks of the completions; ids and masks of the prompts)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .. import distributed as dist
from ..errors import ConfigError


@dataclass(frozen=True)
class ModelShape:
    """What a batch's memory depends on: the model's layers, key/value heads, head width, vocabulary
    and bytes per weight (its dtype)."""

    layers: int
    kv_heads: int
    head_dim: int
    vocab: int
    dtype_bytes: int


def model_shape(model) -> ModelShape | None:
    """The shape of a built-in GPT or a Hugging Face policy (its config); None when the config does not
    say (an unknown architecture: no check rather than a wrong one)."""
    c = model.config
    c = getattr(c, "text_config", None) or c   # multimodal configs keep the language model's inside
    p = next(model.parameters())
    if hasattr(c, "n_layer") and hasattr(c, "n_head"):   # the built-in GPT
        return ModelShape(c.n_layer, c.n_head, c.n_embd // c.n_head, c.vocab_size, p.element_size())
    layers, heads = getattr(c, "num_hidden_layers", None), getattr(c, "num_attention_heads", None)
    vocab, hidden = getattr(c, "vocab_size", None), getattr(c, "hidden_size", None)
    if not (layers and heads and vocab and (hidden or getattr(c, "head_dim", None))):
        return None
    kv = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or hidden // heads
    return ModelShape(int(layers), int(kv), int(head_dim), int(vocab), p.element_size())


def builtin_shape(model_cfg, vocab: int) -> ModelShape:
    """The built-in GPT's shape from the `model` config section, before it is built (float32)."""
    return ModelShape(model_cfg.n_layer, model_cfg.n_head, model_cfg.n_embd // model_cfg.n_head, vocab, 4)


def kv_cache_bytes(shape: ModelShape, rows: int, tokens: int) -> int:
    return 2 * shape.layers * rows * shape.kv_heads * tokens * shape.head_dim * shape.dtype_bytes


def batch_bytes(shape: ModelShape, rows: int, prompt_tokens: int, new_tokens: int) -> int:
    """At least what decoding `rows` rows of up to `prompt_tokens` + `new_tokens` tokens holds at once:
    the KV cache, one position's float32 logits and probabilities, and the token buffers."""
    logits = rows * shape.vocab * 4 * 2
    buffers = rows * (new_tokens * (8 + 4 + 1) + prompt_tokens * (8 + 1))
    return kv_cache_bytes(shape, rows, prompt_tokens + new_tokens) + logits + buffers


def rollout_rows(prompts_per_step: int, num_generations: int, world_size: int = 1) -> int:
    """Rows one rank decodes together in a rollout: its share of the prompts, G completions each."""
    return max(1, prompts_per_step // max(1, world_size)) * num_generations


def eval_rows(k: int, batch_size: int, problems: int) -> int:
    """The most rows an eval batch decodes together: greedy batches of eval.batch_size problems, and
    sampled batches of max(1, batch_size // k) problems x k samples (evaluate() in eval.py)."""
    problems = max(1, problems)
    rows = min(batch_size, problems)
    if k > 1:
        rows = max(rows, min(max(1, batch_size // k), problems) * k)
    return rows


def available_bytes(device: torch.device | str) -> int | None:
    """Memory free for new tensors: the GPU's free memory, or the host's MemAvailable (/proc/meminfo);
    None when unknown (no check)."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if n < 1024 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PB"


def check_memory(cfg, shape: ModelShape | None, prompt_tokens: int, eval_problems: int, available: int | None,
                 world_size: int = 1, local_ranks: int = 1, context: int | None = None, rollout: bool = True) -> None:
    """ConfigError naming the keys when the rollout batch (unless not `rollout`: the offline jobs) or an
    eval batch needs more than `available` bytes (`local_ranks` processes share a host's memory: each
    needs its own batch)."""
    if shape is None or available is None:
        return
    r, e = cfg.rollout, cfg.eval
    new = r.max_completion_tokens if r.tools and r.max_completion_tokens else r.max_new_tokens
    if context:   # prompts are cut to fit the context with the completion (pipeline.fit_prompts)
        prompt_tokens = max(1, min(prompt_tokens, context - min(new, context - 1)))
    share = max(1, local_ranks)
    rows = rollout_rows(r.prompts_per_step, r.num_generations, world_size)
    need = batch_bytes(shape, rows, prompt_tokens, new) * share
    if rollout and need > available:
        raise ConfigError(
            f"rollout.prompts_per_step={r.prompts_per_step} x rollout.num_generations={r.num_generations}: a "
            f"rollout decodes {rows} rows of up to {prompt_tokens + new} tokens together"
            f"{f' on each of {share} ranks' if share > 1 else ''}, which needs at least {fmt_bytes(need)} (KV "
            f"cache and logits), more than the {fmt_bytes(available)} available; lower them "
            f"(or rollout.max_new_tokens)")
    if eval_problems:
        rows = eval_rows(e.k, e.batch_size, math.ceil(eval_problems / max(1, world_size)))
        need = batch_bytes(shape, rows, prompt_tokens, r.max_new_tokens) * share
        if need > available:
            raise ConfigError(
                f"eval.k={e.k}, eval.batch_size={e.batch_size}: an eval batch decodes {rows} rows of up to "
                f"{prompt_tokens + r.max_new_tokens} tokens together, which needs at least {fmt_bytes(need)} (KV "
                f"cache and logits), more than the {fmt_bytes(available)} available; lower eval.k or eval.batch_size")


def longest_prompt(tokenizer, rows: list[dict], limit: int = 256) -> int:
    """The longest rendered prompt among the first `limit` rows: a lower bound of the longest of all
    (cheap, and a lower bound keeps the estimate one)."""
    return max((len(tokenizer.render_prompt(x["prompt"])) for x in rows[:limit]), default=1)


def check_run_memory(cfg, shape: ModelShape | None, tokenizer, train_rows: list[dict], test_rows: list[dict],
                     device, world, context: int | None) -> None:
    """`check_memory` for a GRPO run: the prompts' length from the rows, the memory of `device`; several
    ranks on the host's memory (cpu) each need their own batch."""
    device = torch.device(device)
    prompt = max(longest_prompt(tokenizer, train_rows), longest_prompt(tokenizer, test_rows))
    available = available_bytes(device)
    if world.size > 1:   # every rank decides alike (on the least memory of any), or some would wait forever
        found = dist.gather_objects(available)
        available = None if None in found else min(found)
    check_memory(cfg, shape, prompt, min(len(test_rows), cfg.eval.num_problems), available,
                 world_size=world.size, local_ranks=1 if device.type == "cuda" else world.local_size,
                 context=context)


def check_eval_memory(cfg, model, tokenizer, test_rows: list[dict]) -> None:
    """The eval batches' check alone (the offline jobs' and `grpolab eval`'s held-out eval)."""
    if not test_rows:
        return
    c = model.config
    check_memory(cfg, model_shape(model), longest_prompt(tokenizer, test_rows),
                 min(len(test_rows), cfg.eval.num_problems), available_bytes(next(model.parameters()).device),
                 context=getattr(c, "block_size", None) or getattr(c, "max_position_embeddings", None), rollout=False)
