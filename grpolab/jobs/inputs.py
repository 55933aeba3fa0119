"""What a job starts from: the reward functions configured, the task's rows, prompts that fit the
model, the starting policy."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ..config import Config
from ..config.names import PACKAGE_TASKS
from ..data.loading import filter_long_prompts, normalize_rows, read_records
from ..data.tasks import arithmetic, pyfunc
from ..data.tasks.gsm8k import load_gsm8k
from ..data.tasks.humaneval import load_humaneval
from ..envs import reasoning_gym, verifiers_env
from ..envs.load import env_rows
from ..errors import DataError
from ..models import CharTokenizer, build_builtin
from ..models.checkpoint import load_model
from ..models.hf import load_hf, resolve_device
from ..monitor.console import Console
from ..rewards import judge
from ..rewards.combine import check_tests
from ..rewards.runtime import RewardRuntime
from ..rollout.tool_decode import build_tool_use
from ..rollout.tools import load_tools
from ..train.sft import model_context, train_sft, warm_start_hook
from .common import model_device


def configure_rewards(cfg: Config, console: Console | None = None) -> RewardRuntime:
    """Before any work: the run's reward runtime (reward.timeout, reward.code_exec's limits), for every
    score() of the run, code_exec and the python tool; when code_exec or the python tool is used, check the
    sandbox works on this machine (a one-line error with the fix if not). A warning on every run when the
    sandbox is off. The judges the run lists are built here too."""
    # the python tool runs programs in the same sandbox
    listed = "code_exec" in cfg.reward.functions or cfg.eval.reward == "code_exec" or "python" in cfg.rollout.tools
    runtime = RewardRuntime.from_config(cfg.reward)
    runtime.check(warn=console.warn if console is not None else None, sandbox=listed)
    if cfg.reward.judges:   # the judges this run asks; answers cached in the run directory
        judge.configure(cfg.reward, Path(cfg.train.output_dir) / "judge_cache")
    if cfg.rollout.tools:   # a bad tool spec fails here, before any warm start
        load_tools(list(cfg.rollout.tools), runtime)
    return runtime


def load_data(cfg: Config, with_test: bool = True) -> tuple[list[dict], list[dict]]:
    """(train rows, test rows), each row with 'prompt', 'answer' and any other columns; without
    `with_test` (a job that reads only the train rows) the files and GSM8K tasks read no test split
    (data.val_size's rows are still held out of the train rows)."""
    d = cfg.data
    if d.task == "arithmetic":
        task = arithmetic.ArithmeticConfig(min_ops=d.min_ops, max_ops=d.max_ops, max_operand=d.max_operand,
                                           max_value=d.max_value, allow_mul=d.allow_mul)
        train = arithmetic.generate("train", d.train_size, cfg.train.seed, task)
        test = arithmetic.generate("test", d.test_size, cfg.train.seed, task)
    elif d.task == "pyfunc":
        train = pyfunc.generate("train", d.train_size, cfg.train.seed)
        test = pyfunc.generate("test", d.test_size, cfg.train.seed)
    elif d.task == "humaneval":   # an eval set: train on it only to smoke-test a setup
        test = load_humaneval(d.test_path)
        train = load_humaneval(d.train_path) if d.train_path else test
    elif d.task == "gsm8k":
        source = d.train_path or "openai/gsm8k"
        train, test = _train_and_test(cfg, source, load_gsm8k, None, with_test)
        # the suffix and system prompt apply to GSM8K as to any dataset
        train, test = (normalize_rows(r, system_prompt=d.system_prompt, prompt_suffix=d.prompt_suffix,
                                      source=source) if r else r for r in (train, test))   # (no test split)
    elif d.task == "env":   # the environment's first observations, one row per seed; test seeds far from train's
        train = env_rows(cfg.env.name, d.train_size, cfg.train.seed, d.system_prompt, cfg.env.timeout)
        test = env_rows(cfg.env.name, d.test_size if with_test and cfg.eval.num_problems else 0,
                        cfg.train.seed + reasoning_gym.TEST_SEED_OFFSET, d.system_prompt, cfg.env.timeout)
    elif d.task.startswith(verifiers_env.TASK_PREFIX):   # one list of tasks: the test rows are data.val_size of it
        train, test = verifiers_env.load_rows(d.task, d.task_config, d.system_prompt), []
        if d.val_size:
            train, test = hold_out(train, d.val_size, cfg.train.seed)
        elif with_test and cfg.eval.num_problems:
            raise DataError(f"data.task={d.task}: a taskset is one list of tasks, so it has no test split for the "
                            f"held-out eval: hold out part of it with data.val_size, or eval.num_problems=0")
    elif d.task.startswith(reasoning_gym.TASK_PREFIX):   # generated: a train and a held-out split of its own
        train, test = reasoning_gym.load_rows(d.task, d.task_config, d.train_size, d.test_size, cfg.train.seed,
                                              d.system_prompt)
        if d.prompt_suffix:
            train, test = (normalize_rows(r, prompt_suffix=d.prompt_suffix, source=d.task) for r in (train, test))
    else:
        train, test = _train_and_test(cfg, d.train_path, lambda path, split: _read_split(d, path, split),
                                      d.test_split, with_test)
    if d.task in ("arithmetic", "pyfunc", "humaneval") and (d.system_prompt or d.prompt_suffix):
        # the generated tasks' prompts take the system prompt and suffix as any dataset's do
        train, test = (normalize_rows(r, system_prompt=d.system_prompt, prompt_suffix=d.prompt_suffix,
                                      source=f"data.task={d.task}") for r in (train, test))
    train = train[:d.train_size] if d.train_size else train
    return _with_data_source(train, d), _with_data_source(test, d)


def check_eval_rows(cfg: Config, test_rows: list[dict]) -> None:
    """The held-out eval's check can score its rows: code_exec needs tests in some row, refused as the training
    reward code_exec is (every completion would score None: every eval metric 0)."""
    if cfg.eval.num_problems and cfg.eval.reward == "code_exec":
        check_tests("eval.reward=code_exec", test_rows, list(test_rows[0]) if test_rows else [], "the held-out rows")


# verl's name for a dataset, for rows without their own data_source column: verl-style rewards
# dispatch on it (verl's default_compute_score knows 'openai/gsm8k')
DATA_SOURCES = {"env": "grpolab/env", "arithmetic": "grpolab/arithmetic", "gsm8k": "openai/gsm8k",
                "pyfunc": "grpolab/pyfunc",
                "humaneval": "openai/openai_humaneval"}


def _with_data_source(rows: list[dict], d) -> list[dict]:
    named = d.task.startswith(PACKAGE_TASKS)
    source = DATA_SOURCES.get(d.task, d.task if named else d.train_path)
    return [r if "data_source" in r else {**r, "data_source": source} for r in rows]


def hold_out(rows: list[dict], val_size: float, seed: int) -> tuple[list[dict], list[dict]]:
    """(train rows, held-out rows): `val_size` of the rows (a share below 1, else a count), drawn with `seed`;
    both keep the file's order."""
    n = round(len(rows) * val_size) if val_size < 1 else int(val_size)
    if not 1 <= n < len(rows):
        raise DataError(f"data.val_size={val_size:g} holds out {n} of the {len(rows)} train rows; it must leave at "
                        f"least one row on each side")
    held = set(torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed))[:n].tolist())
    return [r for i, r in enumerate(rows) if i not in held], [r for i, r in enumerate(rows) if i in held]


def _train_and_test(cfg: Config, source: str, read, test_path_split: str | None,
                    with_test: bool) -> tuple[list[dict], list[dict]]:
    """(train rows, test rows) of a dataset read with `read(path, split)`: the test rows are data.val_size of
    the train rows, else data.test_path's, else none (eval.num_problems=0), else `source`'s data.test_split;
    one file has no test split, and evaluating on its own train rows would only measure memorisation."""
    d = cfg.data
    train = read(source, d.train_split)
    if d.val_size:   # LLaMA-Factory's val_size (never with data.test_path): held out from every job's train rows
        return hold_out(train, d.val_size, cfg.train.seed)
    if not with_test:
        return train, []
    if d.test_path:
        return train, read(d.test_path, test_path_split)
    if not cfg.eval.num_problems:   # no held-out eval: no test split needed (nor downloaded)
        return train, []
    if Path(source).expanduser().is_file():
        raise DataError(f"data.train_path {source!r} is a single file, so it has no test split for the held-out "
                        f"eval: hold out part of it with data.val_size (e.g. 0.05, or 200 rows), give a held-out "
                        f"file in data.test_path, or skip the eval with eval.num_problems=0")
    return train, read(source, d.test_split)


def _read_split(d, path: str, split: str | None) -> list[dict]:
    return normalize_rows(read_records(path, split, d.dataset_config), prompt_key=d.prompt_key,
                          answer_key=d.answer_key, system_prompt=d.system_prompt, prompt_suffix=d.prompt_suffix,
                          source=path)


def fit_prompts(cfg: Config, model, tok, rows: list[dict], console: Console, split: str) -> list[dict]:
    """Drop (or reject) prompts longer than data.max_prompt_length, or than leaves room in the
    model's context for rollout.max_new_tokens (with tools: rollout.max_completion_tokens)."""
    return fit_prompts_to(cfg, model_context(model), tok, rows, console, split)


def fit_prompts_to(cfg: Config, context: int | None, tok, rows: list[dict], console: Console,
                   split: str) -> list[dict]:
    """fit_prompts for a model of `context` tokens (known before the model is: the built-in GPT's
    model.block_size, so prompts that cannot fit are refused before its warm start)."""
    if not rows:   # no test split (eval.num_problems=0)
        return rows
    r = cfg.rollout
    if r.tools:   # a chat template renders the tools into the prompt: measure prompts as they will be
        build_tool_use(r, tok, cfg.model.name_or_path).close()
    limit = given = cfg.data.max_prompt_length
    key, budget = (("max_completion_tokens", r.max_completion_tokens) if r.tools and r.max_completion_tokens
                   else ("max_new_tokens", r.max_new_tokens))
    if context:
        room = context - budget
        if room < 1:
            raise DataError(f"rollout.{key}={budget} leaves no room for a prompt in "
                            f"the model's context of {context} tokens")
        limit = min(limit, room) if limit else room
    if not limit:
        return rows
    def length(prompt) -> int:
        return len(tok.render_prompt(prompt))

    kept, dropped = filter_long_prompts(rows, length, limit, cfg.data.on_long_prompt)
    why = f"data.max_prompt_length={given}" if limit == given else \
        f"what the model's context of {context} tokens leaves beside rollout.{key}={budget}"
    if dropped and kept:
        console.info(f"{split}: dropped {dropped} of {len(rows)} prompts longer than {limit} tokens ({why})")
    if not kept:
        shortest = min(length(x["prompt"]) for x in rows)
        fix = "raise data.max_prompt_length" if limit == given else \
            f"shorten the prompts, lower rollout.{key}, or use a model with a longer context"
        raise DataError(f"{split}: every prompt is longer than {limit} tokens ({why}); the shortest is {shortest} "
                        f"tokens: {fix}")
    return kept


def load_policy(cfg: Config, train_rows: list[dict], console: Console, warm_start: bool = True):
    """The starting policy: a checkpoint (model.init_from), a Hugging Face model
    (model.name_or_path), or a fresh built-in GPT, warm-started with SFT on `train_rows` (unless
    `warm_start` is False: the offline jobs train it themselves)."""
    m = cfg.model
    if m.init_from:
        console.info(f"loading {m.init_from}")
        return load_model(m.init_from, dtype=m.dtype, device=model_device(cfg))
    if m.name_or_path != "builtin":
        model, tok = load_hf(m.name_or_path, dtype=m.dtype, device=model_device(cfg),
                             trust_remote_code=m.trust_remote_code)
        console.info(f"{m.name_or_path}: {model.num_params() / 1e6:.2f}M parameters, {m.dtype}, "
                     f"{next(model.parameters()).device}")
        return model, tok
    tok = CharTokenizer()
    model = build_builtin(cfg.model, tok).to(resolve_device(model_device(cfg)))
    console.info(f"built-in GPT: {model.num_params() / 1e6:.2f}M parameters")
    if cfg.sft.steps and warm_start:
        t0 = time.perf_counter()
        sft_rows = train_rows
        if cfg.sft.tool_fraction and cfg.data.task == "arithmetic":   # worked steps that call the calculator
            sft_rows = [arithmetic.with_calculator(r, cfg.sft.tool_fraction, cfg.train.seed) for r in train_rows]
        train_sft(model, tok, sft_rows, cfg, log=console.info, batch_hook=warm_start_hook(cfg, len(train_rows)))
        console.info(f"warm start done in {time.perf_counter() - t0:.0f}s")
    model.eval()
    return model, tok
