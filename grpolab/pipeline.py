"""The jobs behind the CLI: demo, train, eval. Each wires library pieces in order."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
import yaml

from . import distributed
from .config import Config
from .config.load import check_output_dir
from .errors import ConfigError
from .data.loading import filter_long_prompts, normalize_rows, read_records
from .errors import DataError
from .data.tasks import arithmetic, pyfunc
from .data.tasks.humaneval import load_humaneval
from .data.tasks.gsm8k import load_gsm8k
from .determinism import pin_cpu_numerics
from .eval import evaluate
from .logging.console import Console
from .models import CharTokenizer, build_builtin
from .models.hf import load_hf, resolve_device
from .rollout.tool_decode import build_tool_use
from .train.checkpoint import checkpoint_job, find_resume_checkpoint, load_model
from .train.grpo import GRPOTrainer
from .train.resume_rules import check_resume_config
from .train.memory_budget import builtin_shape, check_eval_memory, check_run_memory
from .train.sft import train_sft, warm_start_hook

EVAL_KEYS = ("greedy_accuracy", "pass@1", "pass@8", "tool_calls_per_completion")


def setup_torch(cfg: Config) -> None:
    """Join the process group when launched with several ranks; fixed thread count (several ranks
    on one machine share its cores), MKL's dynamic threading off, seeded: same bits on an idle or
    busy machine."""
    world = distributed.init(cfg.model.device)
    threads = cfg.train.threads
    if world.size > 1 and not threads:
        threads = max(1, (os.cpu_count() or 1) // world.local_size)
    pin_cpu_numerics(threads)
    torch.manual_seed(cfg.train.seed)


def _device(cfg: Config) -> str:
    """model.device for this process: with several ranks, 'cuda' is cuda:LOCAL_RANK."""
    return distributed.rank_device(cfg.model.device, distributed.world_from_env())


def _console(cfg: Config) -> Console:
    """Rank 0 talks; the other ranks stay quiet (errors still reach stderr)."""
    return Console(level=cfg.log.level) if distributed.world_from_env().main else Console(quiet=True)


def configure_rewards(cfg: Config, console: Console | None = None) -> None:
    """Before any work: reward.code_exec's limits for code_exec (also when a user reward calls it); when
    code_exec scores this run, check the sandbox works on this machine (a one-line error with the fix
    if not). A warning on every run when the sandbox is off."""
    from .rewards import code, combine
    combine.configure(cfg.reward)   # reward.timeout for every score() of this run
    # the python tool runs programs in the same sandbox
    listed = "code_exec" in cfg.reward.functions or cfg.eval.reward == "code_exec" or "python" in cfg.rollout.tools
    code.configure(cfg.reward.code_exec, warn=console.warn if console is not None else None, check=listed)
    if cfg.reward.judges:   # the judges this run asks; answers cached in the run directory
        from .rewards import judge
        judge.configure(cfg.reward, Path(cfg.train.output_dir) / "judge_cache")
    if cfg.rollout.tools:   # a bad tool spec fails here, before any warm start
        from .rollout.tools import load_tools
        load_tools(list(cfg.rollout.tools))


def load_data(cfg: Config) -> tuple[list[dict], list[dict]]:
    """(train rows, test rows), each row with 'prompt', 'answer' and any other columns."""
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
        train = load_gsm8k(source, d.train_split)
        test = load_gsm8k(d.test_path, None) if d.test_path else load_gsm8k(source, d.test_split)
        # the suffix and system prompt apply to GSM8K as to any dataset
        train, test = (normalize_rows(r, system_prompt=d.system_prompt, prompt_suffix=d.prompt_suffix,
                                      source=source) for r in (train, test))
    else:
        train, test = (_read_split(d, path, split) for path, split in
                       ((d.train_path, d.train_split), (d.test_path or d.train_path, d.test_split)))
    train = train[:d.train_size] if d.train_size else train
    return _with_data_source(train, d), _with_data_source(test, d)


# verl's name for a dataset, for rows without their own data_source column: verl-style rewards
# dispatch on it (verl's default_compute_score knows 'openai/gsm8k')
DATA_SOURCES = {"arithmetic": "grpolab/arithmetic", "gsm8k": "openai/gsm8k", "pyfunc": "grpolab/pyfunc",
                "humaneval": "openai/openai_humaneval"}


def _with_data_source(rows: list[dict], d) -> list[dict]:
    source = DATA_SOURCES.get(d.task, d.train_path)
    return [r if "data_source" in r else {**r, "data_source": source} for r in rows]


def _read_split(d, path: str, split: str) -> list[dict]:
    if d.test_path is None and path == d.train_path and split == d.test_split and Path(path).is_file():
        raise DataError(f"data.test_path: {path!r} is a single file, so it has no test split; "
                        f"give a held-out file in data.test_path")
    return normalize_rows(read_records(path, split, d.dataset_config), prompt_key=d.prompt_key,
                          answer_key=d.answer_key, system_prompt=d.system_prompt, prompt_suffix=d.prompt_suffix,
                          source=path)


def fit_prompts(cfg: Config, model, tok, rows: list[dict], console: Console, split: str) -> list[dict]:
    """Drop (or reject) prompts longer than data.max_prompt_length, or than leaves room in the
    model's context for rollout.max_new_tokens (with tools: rollout.max_completion_tokens)."""
    r = cfg.rollout
    if r.tools:   # a chat template renders the tools into the prompt: measure prompts as they will be
        build_tool_use(r, tok, cfg.model.name_or_path).close()
    limit = cfg.data.max_prompt_length
    context = getattr(model.config, "block_size", None) or getattr(model.config, "max_position_embeddings", None)
    if context:
        key, budget = (("max_completion_tokens", r.max_completion_tokens) if r.tools and r.max_completion_tokens
                       else ("max_new_tokens", r.max_new_tokens))
        room = context - budget
        if room < 1:
            raise DataError(f"rollout.{key}={budget} leaves no room for a prompt in "
                            f"the model's context of {context} tokens")
        limit = min(limit, room) if limit else room
    if not limit:
        return rows
    kept, dropped = filter_long_prompts(rows, lambda p: len(tok.render_prompt(p)), limit, cfg.data.on_long_prompt)
    if dropped:
        console.info(f"{split}: dropped {dropped} of {len(rows)} prompts longer than {limit} tokens "
                     f"(data.max_prompt_length)")
    if not kept:
        raise DataError(f"{split}: every prompt is longer than {limit} tokens; raise data.max_prompt_length")
    return kept


def load_policy(cfg: Config, train_rows: list[dict], console: Console, warm_start: bool = True):
    """The starting policy: a checkpoint (model.init_from), a Hugging Face model
    (model.name_or_path), or a fresh built-in GPT, warm-started with SFT on `train_rows` (unless
    `warm_start` is False: the offline jobs train it themselves)."""
    m = cfg.model
    if m.init_from:
        console.info(f"loading {m.init_from}")
        return load_model(m.init_from, dtype=m.dtype, device=_device(cfg))
    if m.name_or_path != "builtin":
        model, tok = load_hf(m.name_or_path, dtype=m.dtype, device=_device(cfg),
                             trust_remote_code=m.trust_remote_code)
        console.info(f"{m.name_or_path}: {model.num_params() / 1e6:.2f}M parameters, {m.dtype}, "
                     f"{next(model.parameters()).device}")
        return model, tok
    tok = CharTokenizer()
    model = build_builtin(cfg.model, tok).to(resolve_device(_device(cfg)))
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


def write_run_config(cfg: Config, run_dir: Path, job: str | None = None) -> None:
    """config.yaml of the run. With train.resume, first: the checkpoint to resume must be usable, of
    `job` (when given; else the checkpoint's job is assumed), and the config may change only the keys
    resume_rules.py allows, so config.yaml keeps describing the weights (ConfigError listing the keys)."""
    check_output_dir(cfg)   # before any work: an unwritable train.output_dir is a config error naming the key
    if distributed.world_from_env().main:
        text = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
        ckpt = find_resume_checkpoint(cfg.train.resume, run_dir) if cfg.train.resume else None
        if ckpt is not None:   # before config.yaml is rewritten: a refused resume leaves it as it was
            if job is not None:
                check_resume_job(ckpt, job)
            check_resume_config(yaml.safe_load(text), ckpt, job)
        (run_dir / "config.yaml").write_text(text)


def check_resume_job(ckpt: str | Path | None, job: str) -> None:
    """A checkpoint to resume must come from the same job (grpo, sft, dpo, distill); ConfigError otherwise.
    Checkpoints without a job (older GRPO ones) count as grpo."""
    if ckpt is None:
        return
    found = checkpoint_job(ckpt)
    if found != job:
        raise ConfigError(f"train.resume: {ckpt} is a {found} checkpoint, not a {job} one; start {job} from it with "
                          f"model.init_from={ckpt}")


def build_trainer(cfg: Config, run_dir: Path, console: Console) -> GRPOTrainer:
    """Data, starting policy (warm-started if built-in), prompt-length filter, trainer."""
    problem = distributed.check_world(distributed.world_from_env(), cfg.rollout.prompts_per_step)
    if problem:   # before any work, not after the warm start
        raise ConfigError(problem)
    # rank 0 finds (and repairs) the checkpoint; the others take its answer (run_dir: a shared filesystem)
    ckpt = None
    if cfg.train.resume and distributed.world_from_env().main:
        ckpt = find_resume_checkpoint(cfg.train.resume, run_dir)
    ckpt = distributed.broadcast_object(ckpt)
    check_resume_job(ckpt, "grpo")
    configure_rewards(cfg, console)
    train_rows, test_rows = load_data(cfg)
    if ckpt is not None:   # the checkpoint holds the policy: no warm start again
        console.info(f"resuming from {ckpt}")
        model, tok = load_model(ckpt, dtype=cfg.model.dtype, device=_device(cfg))
    else:
        if cfg.model.name_or_path == "builtin" and not cfg.model.init_from:   # before the warm start, not after it
            check_run_memory(cfg, builtin_shape(cfg.model, CharTokenizer().vocab_size), CharTokenizer(), train_rows,
                             test_rows, resolve_device(_device(cfg)), distributed.world_from_env(),
                             cfg.model.block_size)
        model, tok = load_policy(cfg, train_rows, console)
    train_rows = fit_prompts(cfg, model, tok, train_rows, console, "train")
    test_rows = fit_prompts(cfg, model, tok, test_rows, console, "test")
    trainer = GRPOTrainer(cfg, model, tok, train_rows, test_rows, run_dir, console)
    if ckpt is not None:
        trainer.restore(ckpt, weights=False)   # the policy was loaded from ckpt above
    return trainer


def run_train(cfg: Config, console: Console | None = None) -> dict:
    """SFT/loading, GRPO for train.max_steps, final eval. Returns the final eval metrics."""
    setup_torch(cfg)
    try:
        return _train(cfg, console or _console(cfg))
    finally:   # also on errors and Ctrl-C: a rank leaves its process group cleanly
        distributed.shutdown()


def _train(cfg: Config, console: Console) -> dict:
    run_dir = Path(cfg.train.output_dir)
    write_run_config(cfg, run_dir, "grpo")
    trainer = build_trainer(cfg, run_dir, console)
    if trainer.world.size > 1:
        console.info(f"{trainer.world.size} ranks ({torch.distributed.get_backend()}), "
                     f"{torch.get_num_threads()} threads each")
    trainer.train(final_eval=True)   # the final eval is logged with the last step (metrics.jsonl, trackers)
    final = trainer.final_eval if trainer.final_eval is not None else trainer.evaluate()
    if trainer.world.main:
        (run_dir / "eval.json").write_text(json.dumps(final, indent=2))
        console.result("final eval: " + "  ".join(f"{k} {v:.3f}" for k, v in final.items()))
        _report(run_dir, console)
    distributed.barrier()   # all ranks leave together: none tears down the group while rank 0 still writes
    return final


def run_demo(cfg: Config, console: Console | None = None) -> dict:
    """Warm start, evaluate, GRPO, evaluate; print a before/after table; write summary.json."""
    t0 = time.perf_counter()
    setup_torch(cfg)
    try:
        return _demo(cfg, console or _console(cfg), t0)
    finally:
        distributed.shutdown()


def _demo(cfg: Config, console: Console, t0: float) -> dict:
    run_dir = Path(cfg.train.output_dir)
    write_run_config(cfg, run_dir, "grpo")
    trainer = build_trainer(cfg, run_dir, console)
    console.info(f"evaluating on {len(trainer.test_rows)} held-out problems ...")
    before = trainer.evaluate()
    console.info(f"GRPO: {cfg.train.max_steps} steps x {cfg.rollout.prompts_per_step} prompts x "
                 f"{cfg.rollout.num_generations} completions")
    history = trainer.train(final_eval=True)
    after = trainer.final_eval if trainer.final_eval is not None else trainer.evaluate()
    wall = time.perf_counter() - t0
    gen_tps = [m["perf/gen_tokens_per_sec"] for m in history]
    summary = {"before": {k: before[k] for k in EVAL_KEYS if k in before},
               "after": {k: after[k] for k in EVAL_KEYS if k in after},
               "steps": cfg.train.max_steps, "seed": cfg.train.seed, "wall_seconds": wall,
               "rollout_tokens_per_sec": sorted(gen_tps)[len(gen_tps) // 2] if gen_tps else None}
    if trainer.world.main:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        console.info("")
        console.table(["metric (held-out)", "before", "after", "change"],
                      [[k, before[k], after[k], after[k] - before[k]] for k in EVAL_KEYS if k in before],
                      always=True)
        console.result(f"\nwall time {wall:.0f}s; summary in {run_dir / 'summary.json'}")
        _report(run_dir, console)
    distributed.barrier()
    return summary


def _report(run_dir: Path, console: Console) -> None:
    from .logging.report import write_report
    console.result(f"report: {write_report(run_dir)}")


def run_eval(checkpoint: str, cfg: Config, console: Console | None = None, out: str | None = None) -> dict:
    """Evaluate a checkpoint (ours, or any Hugging Face model directory) on the test split;
    writes eval.json and eval_samples.jsonl to `out` and prints a table."""
    console = console or Console(level=cfg.log.level)
    setup_torch(cfg)
    model, tok = load_model(checkpoint, dtype=cfg.model.dtype, device=cfg.model.device)
    configure_rewards(cfg, console)
    _, test_rows = load_data(cfg)
    test_rows = fit_prompts(cfg, model, tok, test_rows, console, "test")
    check_eval_memory(cfg, model, tok, test_rows)   # eval.k / eval.batch_size beyond the memory: one line
    e = cfg.eval
    res = evaluate(model, tok, test_rows[:e.num_problems], k=e.k, temperature=e.temperature,
                   max_new_tokens=cfg.rollout.max_new_tokens, batch_size=e.batch_size, seed=cfg.train.seed,
                   reward=e.reward, tools=build_tool_use(cfg.rollout, tok, checkpoint))
    samples = res.pop("samples")
    out_dir = Path(out or checkpoint)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "eval.json").write_text(json.dumps(res, indent=2))
    with open(out_dir / "eval_samples.jsonl", "w") as f:
        for s in samples:
            f.write(json.dumps(s) + "\n")
    console.table(["metric", "value"], [[k, v] for k, v in res.items()], always=True)
    return res
