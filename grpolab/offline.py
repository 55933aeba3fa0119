"""The offline jobs behind `grpolab sft | dpo | distill`: data, starting model, trainer, held-out
eval before and after, report. Each writes the same run directory as `train`: config.yaml,
metrics.jsonl, checkpoints/step_N, eval.json, summary.json (before/after), report.html."""

from __future__ import annotations

import json
import random
from pathlib import Path

from . import distributed
from .config import Config
from .errors import ConfigError
from .data.loading import normalize_rows, read_records
from .errors import DataError
from .data.preference import fit_pairs, heldout_size, preference_rows
from .data.supervised import MESSAGES_KEY, sft_rows, task_sft_rows
from .monitor.console import Console
from .pipeline import (EVAL_KEYS, _console, _device, _report, check_resume_job, configure_rewards, fit_prompts, load_data, load_policy, setup_torch, write_run_config)
from .models.checkpoint import find_resume_checkpoint, list_checkpoints, load_model
from .train.memory_budget import check_eval_memory
from .train.sft import model_context
from .utils.files import write_json

BUILTIN_TASKS = ("arithmetic", "gsm8k", "pyfunc", "humaneval")


def _read_sft(cfg: Config, path: str, split: str) -> list[dict]:
    d = cfg.data
    return sft_rows(read_records(path, split, d.dataset_config), prompt_key=d.prompt_key, response_key=d.response_key,
                    source=path)


def task_rows(cfg: Config, console: Console) -> tuple[list[dict], list[dict], str | None]:
    """(train rows, test rows for accuracy, why there is no accuracy eval or None). Built-in tasks
    always have answers; a files task is evaluated when its rows have data.prompt_key and data.answer_key."""
    if cfg.data.task in BUILTIN_TASKS:
        configure_rewards(cfg, console)
        train, test = load_data(cfg)
        return train, test, None
    d = cfg.data
    opts = dict(prompt_key=d.prompt_key, system_prompt=d.system_prompt, prompt_suffix=d.prompt_suffix)
    train_records = read_records(d.train_path, d.train_split, d.dataset_config)
    train = normalize_rows(train_records, answer_key=None, source=d.train_path, **opts) \
        if train_records and all(d.prompt_key in r for r in train_records) else []   # prompts (on-policy distill)
    test_src = d.test_path or d.train_path
    records = read_records(test_src, d.test_split, d.dataset_config)
    if not records or not all(d.prompt_key in r and d.answer_key and d.answer_key in r for r in records):
        return train, [], f"{test_src} rows lack data.prompt_key/data.answer_key columns: no accuracy eval"
    return train, normalize_rows(records, answer_key=d.answer_key, source=test_src, **opts), None


def sft_data(cfg: Config, train_task: list[dict], test_task: list[dict], path: str | None) -> tuple[list[dict], list[dict]]:
    """(SFT rows, held-out SFT rows) for sft and logits distillation: `path` (sft.train_path,
    distill.train_path), else the task's (built-in: prompt + worked answer; files: data.train_path's
    prompt/completion or messages rows)."""
    d, s = cfg.data, cfg.sft
    if path:
        rows = _read_sft(cfg, path, d.train_split)
    elif d.task in BUILTIN_TASKS:
        rows = task_sft_rows(train_task)
    else:
        rows = _read_sft(cfg, d.train_path, d.train_split)
        rows = rows[:d.train_size] if d.train_size else rows
    if s.test_path:
        heldout = _read_sft(cfg, s.test_path, d.test_split)
    elif d.task in BUILTIN_TASKS:
        heldout = task_sft_rows(test_task)
    elif d.test_path:   # the held-out file's rows, when they are SFT rows (an RL test file may have no completions)
        records = read_records(d.test_path, d.test_split, d.dataset_config)
        sft_like = records and all(d.response_key in r or MESSAGES_KEY in r for r in records)
        heldout = sft_rows(records, prompt_key=d.prompt_key, response_key=d.response_key,
                           source=d.test_path) if sft_like else []
    else:
        heldout = []
    return rows, heldout


def _start(cfg: Config, job: str, console: Console):
    """Run dir, resume checkpoint (train.resume), task rows; (run_dir, ckpt, train_task, test_task)."""
    if distributed.world_from_env().size > 1:
        raise ConfigError(f"{job} runs in one process; drop --nproc / torchrun (data-parallel {job} is not built yet)")
    run_dir = Path(cfg.train.output_dir)
    write_run_config(cfg, run_dir, job)
    ckpt = find_resume_checkpoint(cfg.train.resume, run_dir) if cfg.train.resume else None
    check_resume_job(ckpt, job)
    train_task, test_task, why = task_rows(cfg, console)
    if why:
        console.info(why)
    return run_dir, ckpt, train_task, test_task


def _model(cfg: Config, ckpt, console: Console):
    if ckpt is not None:
        console.info(f"resuming from {ckpt}")
        return load_model(ckpt, dtype=cfg.model.dtype, device=_device(cfg))
    return load_policy(cfg, [], console, warm_start=False)


def _fresh(cfg: Config) -> bool:
    """The job starts from a newly initialised built-in GPT (nothing to evaluate before it trains)."""
    return cfg.model.name_or_path == "builtin" and not cfg.model.init_from


def _finish(trainer, cfg: Config, run_dir: Path, ckpt, console: Console, before: dict | None) -> dict:
    """Resume (ckpt), train, evaluate, write eval.json / summary.json and the report. `before`: the
    starting model's held-out eval when known (a pipeline's previous stage), else evaluated once
    before training."""
    if trainer.max_steps == 0:
        raise ConfigError(f"{trainer.job}.steps: 0 steps to run; set {trainer.job}.steps or {trainer.job}.epochs")
    # an eval batch the memory cannot hold (eval.k, eval.batch_size): one line now, not at the final eval
    check_eval_memory(cfg, trainer.model, trainer.tok, getattr(trainer, "test_rows", []))
    if ckpt is not None:
        trainer.restore(ckpt, weights=False)
    before_file = run_dir / "eval_before.json"
    if ckpt is None or not before_file.is_file():
        if before is not None:
            before = {f"eval/{k}": v for k, v in before.items()}
        else:   # a freshly initialised model is not worth an evaluation (it is right by chance only)
            before = {} if _fresh(cfg) else trainer.evaluate()
        write_json(before_file, before)
    before = json.loads(before_file.read_text())
    trainer.train(final_eval=True)   # the final eval is logged with the last step (metrics.jsonl, trackers)
    after = trainer.final_eval if trainer.final_eval is not None else trainer.evaluate()
    write_json(run_dir / "eval.json", {k.removeprefix("eval/"): v for k, v in after.items()})
    keys = [k for k in after if k.removeprefix("eval/") in getattr(trainer, "summary_keys", (*EVAL_KEYS, "loss"))]
    # (summary "before" is empty for a fresh model)
    summary = {"job": trainer.job, "before": {k.removeprefix("eval/"): before[k] for k in keys if k in before},
               "after": {k.removeprefix("eval/"): after[k] for k in keys}, "steps": trainer.max_steps,
               "seed": trainer.cfg.train.seed}
    write_json(run_dir / "summary.json", summary)
    if summary["after"]:   # no "before" value (a fresh model; a stage before without this metric): a dash
        b = summary["before"]
        console.table(["metric (held-out)", "before", "after", "change"],
                      [[k, b.get(k), v, v - b[k] if k in b else None] for k, v in summary["after"].items()],
                      always=True)
    _report(run_dir, console)
    return summary


def _run(cfg: Config, job: str, console: Console | None, body) -> dict:
    setup_torch(cfg)
    try:
        return body(console or _console(cfg))
    finally:
        distributed.shutdown()


# ---------------------------------------------------------------- sft

def run_sft(cfg: Config, console: Console | None = None, before: dict | None = None) -> dict:
    """Supervised fine-tuning (`grpolab sft`); returns summary.json's contents."""
    return _run(cfg, "sft", console, lambda c: _sft(cfg, c, before))


def _sft(cfg: Config, console: Console, before: dict | None) -> dict:
    from .train.sft import SFTTrainer, warm_start_hook
    run_dir, ckpt, train_task, test_task = _start(cfg, "sft", console)
    rows, heldout = sft_data(cfg, train_task, test_task, cfg.sft.train_path)
    model, tok = _model(cfg, ckpt, console)
    test_task = fit_prompts(cfg, model, tok, test_task, console, "test") if test_task else []
    s = cfg.sft
    trainer = SFTTrainer(cfg, model, tok, rows, test_rows=test_task, heldout_rows=heldout, run_dir=run_dir,
                         console=console, batch_hook=warm_start_hook(cfg, len(rows)))
    console.info(f"sft: {len(rows)} rows, {trainer.max_steps} steps x {s.batch_size} rows")
    return _finish(trainer, cfg, run_dir, ckpt, console, before)


# ---------------------------------------------------------------- dpo

def read_pairs(cfg: Config, path: str | None) -> list[dict]:
    if not path:
        raise ConfigError("dpo.pairs: give the preference rows (prompt, chosen, rejected), e.g. the file "
                          "`grpolab sample CHECKPOINT --pairs --out pairs.jsonl` writes")
    return preference_rows(read_records(path, cfg.data.train_split, cfg.data.dataset_config), source=path)


def run_dpo(cfg: Config, console: Console | None = None, before: dict | None = None) -> dict:
    """Direct preference optimisation (`grpolab dpo`); returns summary.json's contents."""
    return _run(cfg, "dpo", console, lambda c: _dpo(cfg, c, before))


def _dpo(cfg: Config, console: Console, before: dict | None) -> dict:
    from .train.dpo import DPOTrainer
    pairs = read_pairs(cfg, cfg.dpo.pairs)
    run_dir, ckpt, _, test_task = _start(cfg, "dpo", console)
    model, tok = _model(cfg, ckpt, console)
    pairs, dropped = fit_pairs(pairs, tok, model_context(model) or 10 ** 9, source=cfg.dpo.pairs)
    if dropped:
        console.info(f"dpo: dropped {len(dropped)} of {len(pairs) + len(dropped)} pairs whose prompt fills the "
                     f"model's context (rows {', '.join(map(str, dropped[:10]))}{' ...' if len(dropped) > 10 else ''})")
    test_task = fit_prompts(cfg, model, tok, test_task, console, "test") if test_task else []
    trainer = DPOTrainer(cfg, model, tok, pairs, test_rows=test_task, run_dir=run_dir, console=console)
    console.info(f"dpo: {len(pairs)} pairs, {trainer.max_steps} steps x {cfg.dpo.batch_size} pairs, "
                 f"beta {cfg.dpo.beta}, {cfg.dpo.loss_type}")
    return _finish(trainer, cfg, run_dir, ckpt, console, before)


# ---------------------------------------------------------------- rm

def rm_pairs(cfg: Config) -> tuple[list[dict], list[dict]]:
    """(training pairs, held-out pairs): rm.test_pairs, else rm.eval_size pairs drawn from rm.pairs with
    train.seed (the same split on every run and resume)."""
    r = cfg.rm
    if not r.pairs:
        raise ConfigError("rm.pairs: give the preference rows (prompt, chosen, rejected), e.g. the file "
                          "`grpolab sample CHECKPOINT --pairs --out pairs.jsonl` writes")
    pairs = read_preferences(cfg, r.pairs, margin=True)
    if r.test_pairs:
        return pairs, read_preferences(cfg, r.test_pairs, margin=True)
    k = heldout_size(r.eval_size, len(pairs))
    if not k:
        return pairs, []
    if k >= len(pairs):
        raise ConfigError(f"rm.eval_size: {k} held-out pairs leave none of the {len(pairs)} in rm.pairs "
                          f"to train on; lower rm.eval_size or give rm.test_pairs")
    order = list(range(len(pairs)))
    random.Random(cfg.train.seed).shuffle(order)
    held = set(order[:k])
    return [p for i, p in enumerate(pairs) if i not in held], [p for i, p in enumerate(pairs) if i in held]


def read_preferences(cfg: Config, path: str, margin: bool = False) -> list[dict]:
    return preference_rows(read_records(path, cfg.data.train_split, cfg.data.dataset_config), source=path,
                           margin=margin)


def load_rm(cfg: Config, ckpt, console: Console):
    """The reward model to train: resumed from `ckpt`, or a score head on model.init_from (a policy
    checkpoint: the usual start is the SFT model) / model.name_or_path (a Hugging Face model, or a
    fresh built-in GPT); LoRA (model.lora_rank) applied."""
    from .models import CharTokenizer, build_builtin
    from .models.lora import lora_config
    from .models.reward_head import BUILTIN_RM, BuiltinRewardModel, checkpoint_kind, load_builtin_rm, load_hf_rm
    from .models.hf import DTYPES, resolve_device

    m = cfg.model
    device = str(resolve_device(_device(cfg)))
    source = m.init_from or (None if m.name_or_path == "builtin" else m.name_or_path)
    if ckpt is not None and checkpoint_kind(ckpt) == BUILTIN_RM:
        console.info(f"resuming from {ckpt}")
        return load_builtin_rm(ckpt, device)   # base and adapters together
    if ckpt is not None and not m.lora_rank:
        console.info(f"resuming from {ckpt}")
        source = str(ckpt)
    kind = checkpoint_kind(source) if source else "fresh"
    if kind == "builtin-gpt":
        policy, tok = load_model(source, device=device)
        rm = BuiltinRewardModel(policy, tok)
    elif kind == BUILTIN_RM:
        rm = load_builtin_rm(source, device)
    elif kind == "fresh":
        tok = CharTokenizer()
        rm = BuiltinRewardModel(build_builtin(m, tok), tok)
    elif kind == "adapter":
        raise ConfigError(f"model.init_from: {source} is a LoRA adapter; merge it first (`grpolab export "
                          f"{source} OUT --merge`) and start the reward model from OUT")
    else:
        key = "model.init_from" if m.init_from else "model.name_or_path"
        if source.startswith((".", "/", "~")) and not Path(source).expanduser().is_dir():
            raise ConfigError(f"{key}: {source!r} is not a directory; give a checkpoint, a Hugging Face model "
                              f"directory or a hub id")
        try:
            rm = load_hf_rm(source, dtype=DTYPES[m.dtype], trust_remote_code=m.trust_remote_code)
        except OSError as e:
            raise ConfigError(f"{key}: cannot load a model and tokenizer from {source!r} "
                              f"({(str(e).strip().splitlines() or [''])[0]})") from None
    rm = rm.to(device)
    if m.lora_rank and not rm.lora:
        rm.add_lora(lora_config(m, rm.lora_target()))
        if ckpt is not None:   # a Hugging Face LoRA reward model resumes its adapter on the same base
            import peft
            from safetensors.torch import load_file
            peft.set_peft_model_state_dict(rm.hf, load_file(str(Path(ckpt) / "adapter" / "adapter_model.safetensors")))
            console.info(f"resuming from {ckpt}")
    if m.gradient_checkpointing:
        rm.set_gradient_checkpointing(True)
    return rm


def run_rm(cfg: Config, console: Console | None = None, before: dict | None = None) -> dict:
    """Reward-model training (`grpolab rm`); returns summary.json's contents."""
    return _run(cfg, "rm", console, lambda c: _rm(cfg, c, before))


def _rm(cfg: Config, console: Console, before: dict | None) -> dict:
    from .train.rm import RewardTrainer
    pairs, test_pairs = rm_pairs(cfg)
    if distributed.world_from_env().size > 1:
        raise ConfigError("rm runs in one process; drop --nproc / torchrun")
    run_dir = Path(cfg.train.output_dir)
    write_run_config(cfg, run_dir, "rm")
    ckpt = find_resume_checkpoint(cfg.train.resume, run_dir) if cfg.train.resume else None
    check_resume_job(ckpt, "rm")
    rm = load_rm(cfg, ckpt, console)
    trainer = RewardTrainer(cfg, rm, pairs, test_pairs=test_pairs, run_dir=run_dir, console=console)
    trained = sum(p.numel() for p in rm.parameters() if p.requires_grad)
    console.info(f"rm: {len(pairs)} pairs ({len(test_pairs)} held out), {trainer.max_steps} steps x "
                 f"{cfg.rm.batch_size} pairs, {trained / 1e6:.2f}M trained parameters")
    summary = _finish(trainer, cfg, run_dir, ckpt, console, before)
    final = list_checkpoints(run_dir / "checkpoints")[-1]
    console.result(f"reward model: {final} (use it as reward.functions=[rm:{final}])")
    return summary


# ---------------------------------------------------------------- distill

def check_vocabularies(teacher_tok, student_tok, teacher, student) -> None:
    """Teacher and student must share one vocabulary (same token ids for the same strings)."""
    tv, sv = teacher.config.vocab_size, student.config.vocab_size
    kinds = type(teacher_tok).__name__, type(student_tok).__name__
    if kinds[0] != kinds[1]:
        raise ConfigError(f"distill.teacher: its tokenizer ({kinds[0]}) is not the student's ({kinds[1]}); logit "
                          f"distillation needs one shared vocabulary")
    if hasattr(teacher_tok, "tok") and teacher_tok.tok.get_vocab() != student_tok.tok.get_vocab():
        raise ConfigError("distill.teacher: its vocabulary differs from the student's (token ids map to different "
                          "strings); distil between models that share a tokenizer")
    if tv != sv:
        raise ConfigError(f"distill.teacher: its output layer has {tv} tokens, the student's {sv}; logit distillation "
                          f"needs one shared vocabulary")


def run_distill(cfg: Config, console: Console | None = None, before: dict | None = None) -> dict:
    """Distillation from distill.teacher into the student (`grpolab distill`); returns summary.json's contents."""
    return _run(cfg, "distill", console, lambda c: _distill(cfg, c, before))


def _distill(cfg: Config, console: Console, before: dict | None) -> dict:
    from .train.distill import DistillTrainer
    d = cfg.distill
    if not d.teacher:
        raise ConfigError("distill.teacher: give the teacher, a checkpoint (…/checkpoints/step_N) or a Hugging Face "
                          "model directory")
    run_dir, ckpt, train_task, test_task = _start(cfg, "distill", console)
    teacher, teacher_tok = load_model(d.teacher, dtype=cfg.model.dtype, device=_device(cfg))
    model, tok = _model(cfg, ckpt, console)
    check_vocabularies(teacher_tok, tok, teacher, model)
    test_task = fit_prompts(cfg, model, tok, test_task, console, "test") if test_task else []
    if d.mode == "on_policy":
        if not train_task:
            raise DataError("distill.mode=on_policy: needs prompts; use a task with prompts (data.task)")
        rows = fit_prompts(cfg, model, tok, train_task, console, "train")
    else:
        rows, _ = sft_data(cfg, train_task, test_task, d.train_path)
    trainer = DistillTrainer(cfg, model, tok, teacher, rows, test_rows=test_task, run_dir=run_dir, console=console)
    console.info(f"distill ({d.mode}{', ' + d.kl + ' KL' if d.mode == 'logits' else ''}): teacher {d.teacher}, "
                 f"student {model.num_params() / 1e6:.2f}M parameters, {trainer.max_steps} steps")
    return _finish(trainer, cfg, run_dir, ckpt, console, before)
