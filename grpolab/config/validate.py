"""Validation: every value of a loaded Config in range, every combination of keys supported, checked
without touching the filesystem (load.check_output_dir does that). The first problem raises one
ConfigError line naming the key and the fix. One function per section; `validate` runs them in a
fixed order, so a config with several problems always reports the same one first.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import string
from typing import Any

from ..errors import ConfigError, RewardError
from .names import (
    ADV_ESTIMATORS,
    AGG_MODES,
    DISTILL_KL,
    DPO_LOSSES,
    KL_ESTIMATORS,
    PACKAGE_TASKS,
    POLICY_LOSSES,
    REWARDS,
    SCALE_REWARDS,
    SOURCES,
    WORKERS,
)
from .reward_spec import parse_call
from .schema import MIN_TEMPERATURE, Config, JudgeConfig


def need(cond: bool, msg: str) -> None:
    """ConfigError(msg) unless `cond`."""
    if not cond:
        raise ConfigError(msg)


def short(value: Any, width: int = 40) -> str:
    """repr(value), cut to `width` characters for an error line."""
    text = repr(value)
    return text if len(text) <= width else text[:width - 3] + "..."


def _choice(key: str, value: str, options) -> None:
    need(value in options, f"{key}: {value!r} is not one of {', '.join(options)}")


def _finite_problem(value: Any) -> bool:
    """A float (alone or inside a list) that is inf or nan."""
    if isinstance(value, float):
        return not math.isfinite(value)
    return isinstance(value, (list, tuple)) and any(_finite_problem(v) for v in value)


def check_finite(section: Any, prefix: str) -> None:
    """Every float in `section` (a dataclass), its nested sections and its dicts of sections (the judges)
    and lists, finite; ConfigError naming the first key that is not. inf and nan slip through range
    checks (nan compares false to everything; inf is > 0): optim.lr=inf saved a checkpoint of NaN weights,
    algorithm.beta=inf skipped every step and exited 0."""
    for f in dataclasses.fields(section):
        key, value = f"{prefix}.{f.name}", getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            check_finite(value, key)
        elif isinstance(value, dict):
            for name, sub in value.items():
                if dataclasses.is_dataclass(sub):
                    check_finite(sub, f"{key}.{name}")
                else:
                    need(not _finite_problem(sub), f"{key}.{name}: must be a finite number, got {short(sub)}")
        else:
            what = "finite numbers" if isinstance(value, list) else "a finite number"
            need(not _finite_problem(value), f"{key}: must be {what}, got {short(value)}")


# seconds: the longest timeout a key accepts (about 115 days); Python's timers overflow on larger ones
MAX_TIMEOUT = 1e7
# rows data.train_size / data.test_size may ask a task that generates them (reasoning_gym:<name>, env) to build:
# all are built at start and held in memory (a reasoning-gym row is about 1 KB and 0.1-0.3 ms to make), and
# 100 million took minutes and gigabytes; a run of 1000 steps of 64 prompts reads 64000 rows
MAX_GENERATED_ROWS = 100_000


def memory_mb() -> int:
    """This machine's physical memory in MB."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2 ** 20


def max_threads() -> int:
    """train.threads ceiling: max(256, 4 x this machine's cores). The thread count fixes the order of
    torch's reductions, so a run is reproduced bit for bit with its own count, possibly from a bigger
    machine (256 covers today's largest two-socket servers); beyond that, more threads than cores only
    queue up, and train.threads=100000 asked OpenMP for 100000 threads."""
    return max(256, 4 * (os.cpu_count() or 1))


# ---------------------------------------------------------------- one function per section

def _finite(cfg: Config) -> None:
    """Every float of every section finite (first: the range checks below assume finite numbers)."""
    for f in dataclasses.fields(cfg):
        check_finite(getattr(cfg, f.name), f.name)


def _model(cfg: Config) -> None:
    """model.*: a model named, a known dtype and device, positive builtin sizes with an even RoPE head
    width, LoRA settings in range."""
    m = cfg.model
    need(bool(m.name_or_path), "model.name_or_path: give 'builtin' or a Hugging Face model directory / hub id")
    _choice("model.dtype", m.dtype, ("float32", "bfloat16", "float16"))
    need(m.device in ("cpu", "cuda", "auto") or m.device.startswith("cuda:"),
         f"model.device: {m.device!r} is not one of cpu, cuda, cuda:N, auto")
    for k in ("n_layer", "n_head", "n_embd", "block_size"):
        need(getattr(m, k) >= 1, f"model.{k}: must be >= 1")
    need(m.lora_rank >= 0, "model.lora_rank: must be >= 0 (0 = full fine-tuning)")
    need(m.lora_alpha > 0, "model.lora_alpha: must be > 0")
    need(0 <= m.lora_dropout < 1, "model.lora_dropout: must be in [0, 1)")
    need(m.lora_target_modules is None or (len(m.lora_target_modules) > 0 and all(
        isinstance(x, str) and x for x in m.lora_target_modules)),
         "model.lora_target_modules: give a list of layer names such as [q_proj, v_proj], or null for all")
    need(m.n_embd % m.n_head == 0 and (m.n_embd // m.n_head) % 2 == 0,
         f"model.n_embd: {m.n_embd} must be a multiple of 2*model.n_head ({2 * m.n_head}) for RoPE")
    if m.name_or_path == "builtin":
        need(builtin_bytes(m.n_layer, m.n_embd, m.block_size) <= memory_mb() * 2 ** 20,
             f"model.n_layer={m.n_layer}, model.n_embd={m.n_embd}, model.block_size={m.block_size}: the built-in "
             f"GPT would need at least {builtin_bytes(m.n_layer, m.n_embd, m.block_size) / 2 ** 30:.1f} GB to train "
             f"(weights, gradients and AdamW's two moments in float32, and its rotary tables), more than this "
             f"machine's {memory_mb() / 2 ** 10:.1f} GB")


def builtin_bytes(n_layer: int, n_embd: int, block_size: int, vocab: int = 256) -> int:
    """A lower bound of the built-in GPT's training memory: 16 bytes per parameter (12 n_embd^2 per block, the
    embeddings and the head of `vocab` at most the character tokenizer's) and its cos/sin tables, float32
    (3 n_embd x block_size each)."""
    return 16 * (12 * n_layer * n_embd ** 2 + 2 * vocab * n_embd) + 2 * 4 * 3 * n_embd * block_size


def _stage_optimizers(cfg: Config) -> None:
    """sft.steps (0 skips the warm start), then the shared step/optimizer keys (schema.StageOptimizer)
    of sft, dpo, rm and distill: counts >= 0, batch_size >= 1, lr > 0, AdamW betas in [0, 1), a known schedule."""
    need(cfg.sft.steps >= 0, "sft.steps: must be >= 0 (0 skips the warm start)")
    for name in ("sft", "dpo", "rm", "distill"):
        s = getattr(cfg, name)
        for k in ("steps", "epochs", "micro_batch_size", "warmup_steps"):
            need(getattr(s, k) >= 0, f"{name}.{k}: must be >= 0")
        need(s.batch_size >= 1, f"{name}.batch_size: must be >= 1")
        need(s.lr > 0, f"{name}.lr: must be > 0")
        need(0 <= s.beta1 < 1 and 0 <= s.beta2 < 1, f"{name}.beta1/{name}.beta2: must be in [0, 1)")
        _choice(f"{name}.lr_schedule", s.lr_schedule, ("linear", "cosine", "constant"))
        need(s.weight_decay >= 0, f"{name}.weight_decay: must be >= 0")
        need(s.max_grad_norm >= 0, f"{name}.max_grad_norm: must be >= 0 (0 = off)")


def _sft(cfg: Config) -> None:
    """sft.*: row length and what to do with longer rows, the bare-answer mix (tool_fraction is
    checked with the tools)."""
    s = cfg.sft
    need(s.max_length >= 0, "sft.max_length: must be >= 0 (0 = the model's context)")
    _choice("sft.on_long", s.on_long, ("truncate", "drop", "error"))
    need(0 <= s.bare_fraction <= 1, "sft.bare_fraction: must be in [0, 1]")
    need(s.bare_steps >= 0, "sft.bare_steps: must be >= 0")


def _dpo(cfg: Config) -> None:
    """dpo.*: beta > 0, a known loss type, label smoothing in [0, 0.5)."""
    p = cfg.dpo
    need(p.beta > 0, "dpo.beta: must be > 0")
    _choice("dpo.loss_type", p.loss_type, DPO_LOSSES)
    need(0 <= p.label_smoothing < 0.5, "dpo.label_smoothing: must be in [0, 0.5)")


def _rm(cfg: Config) -> None:
    """rm.*: held-out size, margin and centring coefficient in range."""
    rmc = cfg.rm
    need(rmc.eval_size is None or rmc.eval_size >= 0,
         "rm.eval_size: must be >= 0 (0 = no held-out pairs) or null (10% of rm.pairs, 1 to 200)")
    need(math.isfinite(rmc.margin), "rm.margin: must be a finite number")
    need(rmc.center_rewards_coefficient >= 0, "rm.center_rewards_coefficient: must be >= 0 (0 = off)")


def _distill(cfg: Config) -> None:
    """distill.*: a known mode and KL direction, a usable temperature."""
    di = cfg.distill
    _choice("distill.mode", di.mode, ("logits", "on_policy"))
    _choice("distill.kl", di.kl, DISTILL_KL)
    need(di.temperature >= MIN_TEMPERATURE, f"distill.temperature: must be >= {MIN_TEMPERATURE}")


def _sample(cfg: Config) -> None:
    """sample.*: enough completions per prompt (two to make a pair), counts and threshold in range."""
    sm = cfg.sample
    need(sm.k >= 1 and (sm.k >= 2 or not sm.pairs), "sample.k: must be >= 1 (>= 2 with sample.pairs)")
    need(sm.num_prompts >= 0, "sample.num_prompts: must be >= 0 (0 = all)")
    need(math.isfinite(sm.min_reward), "sample.min_reward: must be a finite number")
    need(sm.max_per_prompt >= 1, "sample.max_per_prompt: must be >= 1")
    need(sm.batch_size >= 1, "sample.batch_size: must be >= 1")


def _data(cfg: Config) -> None:
    """data.*: a known task (files needs a path), prompt length policy, sizes and the arithmetic task's
    difficulty in range."""
    d = cfg.data
    named = d.task.startswith(PACKAGE_TASKS) and bool(d.task.partition(":")[2])
    need(d.task in DATA_TASKS or named, f"data.task: {d.task!r} is not one of {', '.join(DATA_TASKS)}, "
         f"reasoning_gym:<dataset name> or verifiers:<taskset id>")
    need(not named or "gsm8k_accuracy" not in cfg.reward.functions,
         f"reward.functions: data.task={d.task} is scored by its own checker; set reward.functions="
         f"[{d.task.partition(':')[0]}] (gsm8k_accuracy reads '#### <number>' answers)")
    need(d.task != "env" or cfg.env.name is not None, "data.task: env makes its rows from env.name's first "
         "observations; set env.name")
    need(not d.task_config or named,
         f"data.task_config: configures a reasoning_gym:<name> or verifiers:<id> task, not data.task={d.task}")
    need(d.task != "files" or bool(d.train_path), "data.train_path: data.task=files needs a dataset path or name")
    for key in ("train_path", "test_path"):   # the generated tasks read no file: a path there was ignored
        generated = d.task in ("arithmetic", "pyfunc", "env") or named
        need(not generated or not getattr(d, key),
             f"data.{key}: data.task={d.task} generates its rows and reads no file; set data.task=files (or gsm8k) "
             f"to use {getattr(d, key)!r}")
    need(d.val_size >= 0 and math.isfinite(d.val_size), "data.val_size: must be >= 0 (a share below 1, or rows)")
    need(d.val_size < 1 or d.val_size == int(d.val_size),
         f"data.val_size: {d.val_size:g} is neither a share below 1 nor a whole number of rows")
    need(not d.val_size or (d.task in ("files", "gsm8k") or d.task.startswith("verifiers:")) and not d.test_path,
         "data.val_size: holds out part of data.train_path (data.task=files or gsm8k) or of a verifiers taskset, when "
         "data.test_path is not set")
    need(d.max_prompt_length >= 0, "data.max_prompt_length: must be >= 0 (0 = no limit)")
    _choice("data.on_long_prompt", d.on_long_prompt, ("drop", "error"))
    for name in ("prompt_key", "response_key", "chosen_key", "rejected_key"):
        need(bool(getattr(d, name)), f"data.{name}: must name a column")
    need(d.train_size >= 0 and (d.task not in ("arithmetic", "pyfunc") or d.train_size >= 1),
         "data.train_size: must be >= 1")
    need(d.test_size >= 1, "data.test_size: must be >= 1")
    if d.task == "env" or d.task.startswith("reasoning_gym:"):   # rows built at start, all held in memory
        for key in ("train_size", "test_size"):
            need(getattr(d, key) <= MAX_GENERATED_ROWS, f"data.{key}: {getattr(d, key)} is more than the "
                 f"{MAX_GENERATED_ROWS} rows data.task={d.task} may generate (all are built at start and held in "
                 f"memory)")
    need(1 <= d.min_ops <= d.max_ops, "data.min_ops: must satisfy 1 <= data.min_ops <= data.max_ops")
    need(d.max_operand >= 2, "data.max_operand: must be >= 2")
    need(d.max_value >= 2 * d.max_operand,
         f"data.max_value: must be >= 2 * data.max_operand ({2 * d.max_operand})")


def _rollout(cfg: Config) -> None:
    """rollout.* sampling: prompts and a group of >= 2 completions per step, a length cap, a
    temperature that cannot overflow float32, top-k/top-p, the penalties and min_tokens in range (the
    server's SamplingParams ranges, vLLM's)."""
    r = cfg.rollout
    need(r.prompts_per_step >= 1, "rollout.prompts_per_step: must be >= 1")
    need(r.num_generations >= 2,
         "rollout.num_generations: must be >= 2 (group-relative advantages need a group)")
    need(r.max_new_tokens >= 1, "rollout.max_new_tokens: must be >= 1")
    need(r.temperature >= MIN_TEMPERATURE and math.isfinite(r.temperature),   # below it logits/T overflow float32
         f"rollout.temperature: must be >= {MIN_TEMPERATURE} (RL samples; use eval for greedy)")
    need(r.top_k >= 0, "rollout.top_k: must be >= 0 (0 = off)")
    need(0 < r.top_p <= 1, "rollout.top_p: must be in (0, 1]")
    need(r.repetition_penalty > 0, f"rollout.repetition_penalty: must be > 0 (1.0 = off), got {r.repetition_penalty}")
    for key in ("presence_penalty", "frequency_penalty"):
        need(-2 <= getattr(r, key) <= 2, f"rollout.{key}: must be in [-2, 2] (0.0 = off), got {getattr(r, key)}")
    need(0 <= r.min_tokens <= r.max_new_tokens,
         f"rollout.min_tokens: must be in [0, rollout.max_new_tokens={r.max_new_tokens}], got {r.min_tokens}")
    need(r.max_slots >= 0, f"rollout.max_slots: must be >= 0 (0 = every row at once), got {r.max_slots}")


def _tools(cfg: Config) -> None:
    """The tool keys: rollout.tools a list of names or specs, call and output limits, a completion
    budget no smaller than max_new_tokens; sft.tool_fraction (calculator calls in the warm start)."""
    r = cfg.rollout
    need(isinstance(r.tools, list) and all(isinstance(t, str) and t for t in r.tools),
         "rollout.tools: must be a list of tool names or 'module:fn' specs, e.g. [calculator]")
    need(r.max_tool_calls >= 1, "rollout.max_tool_calls: must be >= 1")
    need(r.max_completion_tokens is None or r.max_completion_tokens >= r.max_new_tokens,
         f"rollout.max_completion_tokens: must be >= rollout.max_new_tokens={r.max_new_tokens} (or null)")
    need(0 < r.tool_timeout <= MAX_TIMEOUT, f"rollout.tool_timeout: must be > 0 and at most {MAX_TIMEOUT:.0f} seconds")
    need(r.tool_output_max_chars >= 1, "rollout.tool_output_max_chars: must be >= 1")
    need(0 <= cfg.sft.tool_fraction <= 1, "sft.tool_fraction: must be in [0, 1]")


def _env(cfg: Config) -> None:
    """env.*: a spec, a turn limit and timeout in range; episodes run on the built-in engine, without tools. The
    `env` reward (training or eval) needs an environment: without one it scores nothing (reward NaN, loss 0)."""
    e, r = cfg.env, cfg.rollout
    if e.name is None:
        need("env" not in cfg.reward.functions, f"reward.functions: env {_NO_ENV}")
        need(cfg.eval.reward != "env", f"eval.reward: env {_NO_ENV}")
        return
    need(isinstance(e.name, str) and ":" in e.name, f"env.name: {e.name!r} is not 'module:make_env', "
         f"'file.py:make_env', 'openenv:<url>' or 'textarena:<game id>'")
    need(e.max_turns >= 1, "env.max_turns: must be >= 1")
    need(0 < e.timeout <= MAX_TIMEOUT, f"env.timeout: must be > 0 and at most {MAX_TIMEOUT:.0f} seconds")
    need(not r.tools, "env.name: an environment's episodes and rollout.tools do not mix yet; give the tools to the "
                      "environment (a verifiers ToolEnv) or drop rollout.tools")
    need(r.source == "builtin" and not cfg.train.worker_count,
         "env.name: episodes run on the built-in engine in the trainer's process (rollout.source=builtin, no "
         "rollout workers)")


_NO_ENV = ("scores an environment's episodes; set env.name (the environment the model talks to between turns), "
           "or score with another reward")


def _vllm(cfg: Config) -> None:
    """rollout.source one of builtin | vllm; with vllm: a Hugging Face model, no tools; vllm.* in range."""
    r, v = cfg.rollout, cfg.vllm
    _choice("rollout.source", r.source, [n for n in SOURCES if n != WORKERS])
    need(0 < v.gpu_memory_utilization <= 1, "vllm.gpu_memory_utilization: must be in (0, 1]")
    need(v.kv_cache_gb is None or v.kv_cache_gb > 0, "vllm.kv_cache_gb: must be > 0 (or null)")
    need(v.max_model_len is None or v.max_model_len > r.max_new_tokens,
         f"vllm.max_model_len: must exceed rollout.max_new_tokens={r.max_new_tokens} (or null)")
    if r.source != "vllm":
        return
    need(cfg.model.name_or_path != "builtin",
         "rollout.source: vllm runs Hugging Face models; the built-in GPT has no vLLM architecture (use "
         "rollout.source=builtin, or `grpolab export` it and train the exported model)")
    need(not r.tools, "rollout.source: vllm does not run tool rollouts yet (a call's result must be fed back "
                      "mid-completion); use rollout.source=builtin with rollout.tools")


def _reward(cfg: Config) -> None:
    """reward.*: at least one function, each a registered name or a spec that parses (judge:<name>
    needs reward.judges.<name>), every judge's keys, the code_exec sandbox's limits, the timeout, no
    function listed twice, one finite weight per function."""
    w = cfg.reward
    need(len(w.functions) >= 1, "reward.functions: list at least one reward, e.g. [gsm8k_accuracy]")
    for name in w.functions:
        need(isinstance(name, str) and bool(name), f"reward.functions: {name!r} is not a reward name")
        need(name in REWARDS or ":" in name,
             f"reward.functions: unknown reward {name!r}; known: {', '.join(sorted(REWARDS))}; or give "
             f"'package.module:function', 'path/to/file.py:function', 'verl:path/to/file.py:compute_score' "
             f"or 'rm:<model dir or hub id>'")
        if name.startswith("judge:"):
            need(name[len("judge:"):] in w.judges, f"reward.functions: {name!r} names no judge; define "
                 f"reward.judges.{name[len('judge:'):]} (base_url, model, ...)")
        elif ":" in name and not name.startswith("rm:"):
            try:
                parse_call(name[len("verl:"):] if name.startswith("verl:") else name)
            except RewardError as e:
                raise ConfigError(f"reward.functions: {e}") from None
    for jname, j in w.judges.items():
        _judge(f"reward.judges.{jname}", j)
    c = w.code_exec
    need(0 < c.timeout <= MAX_TIMEOUT, f"reward.code_exec.timeout: must be > 0 and at most {MAX_TIMEOUT:.0f} seconds")
    need(c.memory_mb >= 64, "reward.code_exec.memory_mb: must be >= 64 (Python alone needs about 30 MB)")
    need(c.max_procs >= 1, "reward.code_exec.max_procs: must be >= 1")
    need(c.max_output >= 1, "reward.code_exec.max_output: must be >= 1 byte")
    need(c.max_concurrent >= 0, "reward.code_exec.max_concurrent: must be >= 0 (0 = the number of cores)")
    need(c.tmp_mb >= 1, "reward.code_exec.tmp_mb: must be >= 1")
    need(c.tmp_mb <= memory_mb(), f"reward.code_exec.tmp_mb: {c.tmp_mb} MB is more than this machine's memory "
         f"({memory_mb()} MB); a program could fill its /tmp with all of it")
    need(c.tmp_inodes >= 16, "reward.code_exec.tmp_inodes: must be >= 16")
    need(c.shm_mb >= 0, "reward.code_exec.shm_mb: must be >= 0 (0 = no shared memory)")
    need(0 <= w.timeout <= MAX_TIMEOUT, f"reward.timeout: must be >= 0 and at most {MAX_TIMEOUT:.0f} seconds "
         f"(0 = no limit)")
    need(len(set(w.functions)) == len(w.functions), "reward.functions: a reward is listed twice; list it once "
         "(give it a larger reward.weights entry to count it more)")
    if w.weights is not None:
        need(len(w.weights) == len(w.functions),
             f"reward.weights: {len(w.weights)} weights for {len(w.functions)} functions; give one per function")
        need(all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in w.weights),
             "reward.weights: must be finite numbers")


def _judge(key: str, j: JudgeConfig) -> None:
    """One reward.judges.<name>: an http(s) address and a model, the API key by variable name only, a
    parser with a valid score range, verdicts, pattern and template, request limits in range."""
    need(bool(j.base_url) and j.base_url.startswith(("http://", "https://")),
         f"{key}.base_url: give the judge server's API address, e.g. http://127.0.0.1:8000/v1")
    need(bool(j.model), f"{key}.model: give the model name the judge server serves")
    need(j.api_key_env is None or bool(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", j.api_key_env)),
         f"{key}.api_key_env: give the NAME of an environment variable holding the key (e.g. OPENAI_API_KEY), "
         f"never the key itself")
    _choice(f"{key}.parser", j.parser, ("number", "verdict"))
    need(len(j.score_range) == 2 and all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
                                         for x in j.score_range)
         and j.score_range[0] < j.score_range[1], f"{key}.score_range: give [lowest, highest], e.g. [0, 10]")
    need(len(j.verdicts) >= 2 and all(isinstance(v, str) and v.strip() for v in j.verdicts)
         and len(set(v.lower() for v in j.verdicts)) == len(j.verdicts),
         f"{key}.verdicts: give at least two distinct words, best first, e.g. [correct, incorrect]")
    if j.pattern is not None:
        try:
            need(re.compile(j.pattern).groups >= 1, f"{key}.pattern: needs a group, e.g. 'Score: (\\d+)'")
        except re.error as e:
            raise ConfigError(f"{key}.pattern: not a valid regex ({e})") from None
    if j.template is not None:
        try:
            names = {f for _, f, _, _ in string.Formatter().parse(j.template) if f is not None}
        except ValueError as e:
            raise ConfigError(f"{key}.template: {e} (write literal braces as {{{{ and }}}})") from None
        known = {"question", "completion", "reference", "rubric", "examples", "min", "max", "verdicts"}
        unknown = sorted(names - known)
        need(not unknown, f"{key}.template: unknown field {{{(unknown or [''])[0]}}}; fields are "
             f"{', '.join('{' + k + '}' for k in sorted(known))}")
        need("completion" in names, f"{key}.template: must contain {{completion}} (the answer to grade)")
    need(j.max_tokens >= 1, f"{key}.max_tokens: must be >= 1")
    need(j.temperature >= 0, f"{key}.temperature: must be >= 0")
    need(j.concurrency >= 1, f"{key}.concurrency: must be >= 1")
    need(j.timeout > 0, f"{key}.timeout: must be > 0 seconds")
    need(j.max_retries >= 0, f"{key}.max_retries: must be >= 0")
    need(j.backoff >= 0, f"{key}.backoff: must be >= 0 seconds")
    need(j.rubric_examples >= 0, f"{key}.rubric_examples: must be >= 0")


def _algorithm_estimator(cfg: Config) -> None:
    """algorithm.* of the advantage estimate: a registered estimator, gamma and lam in range, the
    sampler/trainer correction (mode, level, threshold > 1), RLPR's std filter decay in [0, 1)."""
    a = cfg.algorithm
    _choice("algorithm.adv_estimator", a.adv_estimator, ADV_ESTIMATORS)
    need(0 < a.gamma <= 1, "algorithm.gamma: must be in (0, 1]")
    need(0 <= a.lam <= 1, "algorithm.lam: must be in [0, 1]")
    _choice("algorithm.rollout_correction", a.rollout_correction, ("none", "tis", "mis"))
    _choice("algorithm.rollout_correction_level", a.rollout_correction_level, ("token", "sequence"))
    need(a.rollout_correction_threshold > 1, "algorithm.rollout_correction_threshold: must be > 1")
    need(0 <= a.std_filter_ema < 1, "algorithm.std_filter_ema: must be in [0, 1) (0 = off)")


def _critic(cfg: Config) -> None:
    """critic.* (gae's value model): lr > 0, warmups and clipping in range."""
    c = cfg.critic
    need(c.lr > 0, "critic.lr: must be > 0")
    need(c.warmup_steps >= 0 and c.warmup_updates >= 0, "critic.warmup_steps/critic.warmup_updates: must be >= 0")
    need(c.max_grad_norm >= 0, "critic.max_grad_norm: must be >= 0 (0 = off)")
    need(c.cliprange_value > 0, "critic.cliprange_value: must be > 0")


def _algorithm_loss(cfg: Config) -> None:
    """algorithm.* of the loss: reward scaling, a registered policy loss, KL estimator and aggregation,
    clip ranges, beta >= 0 (and > 0 where the KL in the reward or the reference sync needs it),
    sampling rounds, DAPO's overlong buffer within rollout.max_new_tokens, TR-DPO's sync."""
    a, r = cfg.algorithm, cfg.rollout
    _choice("algorithm.scale_rewards", a.scale_rewards, SCALE_REWARDS)
    _choice("algorithm.policy_loss", a.policy_loss, POLICY_LOSSES)
    _choice("algorithm.kl_estimator", a.kl_estimator, KL_ESTIMATORS)
    _choice("algorithm.loss_agg_mode", a.loss_agg_mode, AGG_MODES)
    need(a.adv_eps >= 0, "algorithm.adv_eps: must be >= 0")
    need(0 < a.epsilon < 1, "algorithm.epsilon: must be in (0, 1), e.g. 0.2")
    need(a.epsilon_high is None or a.epsilon_high > 0, "algorithm.epsilon_high: must be > 0 or null")
    need(a.clip_ratio_c is None or a.clip_ratio_c > 1, "algorithm.clip_ratio_c: must be > 1 or null (off)")
    need(a.beta >= 0, "algorithm.beta: must be >= 0 (0 disables the KL term)")
    need(a.num_iterations >= 1, "algorithm.num_iterations: must be >= 1")
    need(not a.kl_in_reward or a.beta > 0, "algorithm.kl_in_reward: needs algorithm.beta > 0 (the KL coefficient)")
    need(a.entropy_coef >= 0, "algorithm.entropy_coef: must be >= 0")
    need(a.max_sampling_rounds >= 1, "algorithm.max_sampling_rounds: must be >= 1")
    need(0 <= a.overlong_buffer <= r.max_new_tokens,
         f"algorithm.overlong_buffer: must be in [0, rollout.max_new_tokens={r.max_new_tokens}]")
    need(a.overlong_penalty >= 0, "algorithm.overlong_penalty: must be >= 0")
    need(a.ref_sync_steps >= 0, "algorithm.ref_sync_steps: must be >= 0 (0 = off)")
    need(0 < a.ref_sync_alpha <= 1, "algorithm.ref_sync_alpha: must be in (0, 1]")
    need(a.ref_sync_steps == 0 or a.beta > 0, "algorithm.ref_sync_steps: needs algorithm.beta > 0 (a reference)")


def _strategy(cfg: Config) -> None:
    """train.strategy a known one, and what LoRA rules out: FSDP, and a moving reference (the
    reference is the base model with the adapters off)."""
    m, a = cfg.model, cfg.algorithm
    _choice("train.strategy", cfg.train.strategy, ("ddp", "fsdp"))
    need(not (m.lora_rank and cfg.train.strategy == "fsdp"),
         "train.strategy: fsdp with model.lora_rank > 0 is not supported; use ddp (LoRA's trained weights are small)")
    need(not (m.lora_rank and a.ref_sync_steps),
         "algorithm.ref_sync_steps: with model.lora_rank > 0 the reference is the base model (adapters off), "
         "which cannot move; set algorithm.ref_sync_steps=0")


def _optim(cfg: Config) -> None:
    """optim.* (the RL optimizer): lr > 0, log-prob chunking, AdamW betas in [0, 1), warmup, a known
    schedule, clipping and micro-batch in range."""
    o = cfg.optim
    need(o.lr > 0, "optim.lr: must be > 0")
    need(o.logprob_chunk is None or o.logprob_chunk >= 0,
         "optim.logprob_chunk: must be >= 0 (0 = all positions at once) or null (by vocabulary size)")
    need(o.weight_decay >= 0, "optim.weight_decay: must be >= 0")
    need(0 <= o.beta1 < 1 and 0 <= o.beta2 < 1, "optim.beta1/optim.beta2: must be in [0, 1)")
    need(o.warmup_steps >= 0, "optim.warmup_steps: must be >= 0")
    _choice("optim.lr_schedule", o.lr_schedule, ("constant", "linear", "cosine"))
    need(o.max_grad_norm >= 0, "optim.max_grad_norm: must be >= 0 (0 = off)")
    need(o.micro_batch_size >= 0, "optim.micro_batch_size: must be >= 0 (0 = whole batch)")


def _train(cfg: Config) -> None:
    """train.*: steps, run directory, cadences and checkpoint counts in range; threads at most
    max_threads()."""
    t = cfg.train
    need(t.max_steps >= 0, "train.max_steps: must be >= 0")
    need(-2 ** 63 <= t.seed < 2 ** 64, f"train.seed: {t.seed} does not fit in 64 bits (torch's seeds are in "
         f"[-2^63, 2^64))")
    need(bool(t.output_dir), "train.output_dir: must be a directory path")
    for k in ("save_every", "eval_every", "threads"):
        need(getattr(t, k) >= 0, f"train.{k}: must be >= 0")
    need(t.threads <= max_threads(), f"train.threads: {t.threads} is more than {max_threads()} (4 x this machine's "
         f"{os.cpu_count()} cores, at least 256); threads beyond the cores only wait their turn (0 = all cores)")
    need(t.log_every >= 1, "train.log_every: must be >= 1")
    need(t.keep_checkpoints >= 0, "train.keep_checkpoints: must be >= 0 (0 = keep all)")
    need(t.max_bad_steps >= 0, "train.max_bad_steps: must be >= 0")
    _async(cfg)


def _async(cfg: Config) -> None:
    """train.async_steps / rollout_workers / worker_threads in range; what rollout workers do not run yet."""
    t = cfg.train
    for k in ("async_steps", "rollout_workers", "worker_threads"):
        need(getattr(t, k) >= 0, f"train.{k}: must be >= 0")
    need(t.worker_threads <= max_threads(), f"train.worker_threads: {t.worker_threads} is more than {max_threads()}")
    need(0 <= t.worker_stall_timeout <= MAX_TIMEOUT,
         f"train.worker_stall_timeout: must be >= 0 and at most {MAX_TIMEOUT:.0f} seconds (0 = wait forever)")
    cores = os.cpu_count() or 1
    need(t.rollout_workers <= cores, f"train.rollout_workers: {t.rollout_workers} is more than this machine's {cores} "
         f"cores; each worker is a process sampling on at least one core (or one GPU)")
    if not t.worker_count:
        return
    fix = "or set train.async_steps=0 and train.rollout_workers=0 (rollouts in the trainer's process)"
    need(not cfg.algorithm.dynamic_sampling,
         "algorithm.dynamic_sampling: how many prompts a step samples depends on its rewards, which rollout workers "
         f"sampling ahead cannot know; turn it off, {fix}")
    need(not cfg.rollout.tools, f"rollout.tools: rollout workers do not run tool calls yet; drop rollout.tools, {fix}")


def _log(cfg: Config) -> None:
    """log.*: a known level, sample cadence and count in range."""
    lg = cfg.log
    _choice("log.level", lg.level, ("quiet", "normal", "verbose"))
    need(lg.samples_every >= 0, "log.samples_every: must be >= 0 (0 = off)")
    need(lg.samples_per_step >= 1, "log.samples_per_step: must be >= 1")


def _eval(cfg: Config) -> None:
    """eval.*: counts and temperature in range, a known correctness check (code_exec for the code
    tasks)."""
    e = cfg.eval
    need(e.num_problems >= 0, "eval.num_problems: must be >= 0 (0 = no held-out eval; grpolab train only)")
    need(e.k >= 1, "eval.k: must be >= 1")
    need(e.temperature >= MIN_TEMPERATURE, f"eval.temperature: must be >= {MIN_TEMPERATURE} (greedy accuracy is "
         f"measured apart)")
    need(e.batch_size >= 1, "eval.batch_size: must be >= 1")
    if e.reward is not None:   # None (a Config built in code): load.py sets eval_check(cfg) before validating
        _choice("eval.reward", e.reward, EVAL_CHECKS)
    need(cfg.data.task not in ("pyfunc", "humaneval") or e.reward in (None, "code_exec"),
         f"eval.reward: data.task={cfg.data.task} is checked by running the code: train with "
         f"reward.functions=[code_exec] (the eval follows it) or set eval.reward=code_exec")


# the correctness checks the held-out eval can score with (a completion is right when its check gives 1.0)
EVAL_CHECKS = ("gsm8k_accuracy", "math_accuracy", "code_exec", "reasoning_gym", "verifiers", "env")
DATA_TASKS = ("arithmetic", "gsm8k", "pyfunc", "humaneval", "files", "env")


def eval_check(cfg: Config) -> str:
    """The held-out eval's correctness check: eval.reward when set; else the training reward's own check (the
    first reward.functions entry that is one of EVAL_CHECKS), as TRL and verl score their eval with the training
    reward; an environment's episode reward (env); a reasoning_gym:<name> task's own scorer; else gsm8k_accuracy
    (a '#### <number>' or plain-number answer; _eval refuses it for the code tasks)."""
    if cfg.eval.reward is not None:
        return cfg.eval.reward
    if cfg.env.name is not None:   # the episode's reward (1.0: solved)
        return "env"
    if cfg.data.task.startswith(PACKAGE_TASKS):   # the task's own scorer
        return cfg.data.task.partition(":")[0]
    return next((f for f in cfg.reward.functions if f in EVAL_CHECKS), "gsm8k_accuracy")


# the order the checks run in: the first problem found is the one reported
CHECKS = (_finite, _model, _stage_optimizers, _sft, _dpo, _rm, _distill, _sample, _data, _rollout, _tools, _env, _vllm,
          _reward, _algorithm_estimator, _critic, _algorithm_loss, _strategy, _optim, _train, _log, _eval)


def validate(cfg: Config) -> None:
    """Check every section of `cfg` (CHECKS, in order); ConfigError with one line naming the first
    key that is out of range or unsupported, and the fix."""
    for check in CHECKS:
        check(cfg)
