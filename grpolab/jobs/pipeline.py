"""Multi-stage runs (`grpolab pipeline CONFIG`): a config's `stages:` list, run in order.

    train: {output_dir: runs/r1}        # shared settings: every section, for every stage
    stages:
      - job: sft                        # sft | train | sample | dpo | rm | distill
        sft: {steps: 300}               # the stage's own settings (win over the shared ones)
      - job: train                      # GRPO, as `grpolab train` (`grpo`: its older name, still read)
      - job: sample
      ...

Stage n writes RUN_DIR/<n>-<job>/ and starts from the final checkpoint of the last stage before it
that trained (model.init_from). A `sample` stage writes samples.jsonl (or pairs.jsonl with
sample.pairs) there; the next sft stage without sft.train_path trains on the samples, the next dpo
stage without dpo.pairs on the pairs, and so does the next rm stage without rm.pairs. An rm stage
trains a reward model (from the last trained policy, as RLHF starts it from the SFT model) and is
not a policy: the next stages start from the policy before it, and the reward spec 'rm:' alone in
their reward.functions means its final checkpoint. A finished stage leaves stage.json (its final checkpoint,
output file and held-out eval). With train.resume=auto, a finished stage is skipped and the
unfinished one resumes from its last checkpoint, so a killed pipeline ends as an uninterrupted
one. RUN_DIR/pipeline.json and report.html show the held-out eval after every stage.

CLI overrides apply last, to every stage.
"""

from __future__ import annotations

import json
from argparse import Namespace
from pathlib import Path

from ..config import Config
from ..config.load import _apply, _flatten, parse_override, read_yaml, renamed
from ..errors import ConfigError, DataError
from ..models.checkpoint import list_checkpoints
from ..monitor.console import Console
from ..monitor.report import write_pipeline_report
from ..utils.files import write_json
from . import distill, dpo, rm, sample, sft, train

JOBS = ("sft", "train", "sample", "dpo", "rm", "distill")   # each the `grpolab` command it runs
OLD_NAMES = {"grpo": "train"}   # read in existing pipeline files; the stage directory keeps the name written


def read_stages(path: str | Path) -> tuple[dict, list[dict]]:
    """(shared settings, stage specs) of a pipeline config file."""
    p = Path(path)
    data = read_yaml(p)
    stages = data.pop("stages", None)
    if not isinstance(stages, list) or not stages:
        raise ConfigError(f"{p}: `stages:` must be a non-empty list of {{job: {'|'.join(JOBS)}, ...settings}}")
    for i, st in enumerate(stages, start=1):
        if not isinstance(st, dict) or OLD_NAMES.get(st.get("job"), st.get("job")) not in JOBS:
            got = st.get("job") if isinstance(st, dict) else st
            raise ConfigError(f"stages[{i}].job: {got!r} is not one of {', '.join(JOBS)}")
        bad = [k for k, v in st.items() if k != "job" and not isinstance(v, dict)]
        if bad:
            raise ConfigError(f"stages[{i}].{bad[0]}: stage settings are sections (e.g. sft: {{steps: 100}})")
    return data, stages


def stage_configs(path: str | Path, overrides: list[str]) -> tuple[Path, list[tuple[str, Config]]]:
    """(pipeline run dir, [(job, config)]) with every stage's config validated before anything runs."""
    shared, stages = read_stages(path)
    # renamed keys read once here (one notice), not again in every stage's config
    base = renamed(list(_flatten(shared).items()))
    cli = renamed([parse_override(o) for o in overrides])
    root = Path(_apply(Config(), base + cli).train.output_dir)
    out = []
    for i, st in enumerate(stages, start=1):
        own = list(_flatten({k: v for k, v in st.items() if k != "job"}).items())
        try:
            cfg = _apply(Config(), base + own + cli + [("train.output_dir", str(root / f"{i}-{st['job']}"))])
        except ConfigError as e:
            raise ConfigError(f"stages[{i}] ({st['job']}): {e}") from None
        out.append((st["job"], cfg))
    return root, out


def _final_checkpoint(run_dir: Path) -> str:

    found = list_checkpoints(run_dir / "checkpoints")
    if not found:
        raise ConfigError(f"{run_dir}: the stage wrote no checkpoint")
    return str(found[-1])


def run(cfg: None, args: Namespace) -> list[dict]:
    """`grpolab pipeline CONFIG`: no one config (each stage builds its own from the file)."""
    return run_pipeline(args.config, list(args.overrides))


def run_pipeline(path: str | Path, overrides: list[str], console: Console | None = None) -> list[dict]:
    """Run (or, with train.resume=auto, finish) the stages; returns each stage's record."""
    root, stages = stage_configs(path, overrides)
    console = console or Console(level=stages[0][1].log.level)
    resume = bool(stages[0][1].train.resume)
    root.mkdir(parents=True, exist_ok=True)
    last: dict | None = None         # the record of the last stage that trained (its final checkpoint, eval)
    reward_model: str | None = None  # the last rm stage's final checkpoint ('rm:' in reward.functions)
    samples: dict[str, str] = {}     # 'samples' / 'pairs' -> the last sample stage's file
    records = []
    for n, (job, cfg) in enumerate(stages, start=1):
        run_dir = Path(cfg.train.output_dir)
        done = run_dir / "stage.json"
        if resume and done.is_file():
            rec = json.loads(done.read_text())
            console.result(f"stage {n}/{len(stages)} ({job}): done, skipped")
        else:
            console.result(f"\n=== stage {n}/{len(stages)}: {job} -> {run_dir}")
            rec = _run_stage(n, job, cfg, last, samples, resume, console, reward_model)
            write_json(done, rec)
        records.append(rec)
        if rec.get("checkpoint"):
            last = rec
        reward_model = rec.get("reward_model") or reward_model
        if rec.get("output"):
            samples["pairs" if rec.get("pairs") else "samples"] = rec["output"]
        write_json(root / "pipeline.json", {"stages": records})
    console.result(f"report: {write_pipeline_report(root)}")
    return records


def _run_stage(n: int, job: str, cfg: Config, last: dict | None, samples: dict, resume: bool,
               console: Console, reward_model: str | None = None) -> dict:
    run_dir = Path(cfg.train.output_dir)
    model_from = last["checkpoint"] if last else None
    if model_from:
        cfg.model.init_from = model_from
    cfg.train.resume = "auto" if resume else None
    rec: dict = {"stage": n, "job": job, "dir": str(run_dir)}
    if "rm:" in cfg.reward.functions:   # the reward model an earlier rm stage trained
        if not reward_model:
            raise ConfigError(f"stages[{n}] ({job}): reward 'rm:' names the last rm stage's model, and no rm stage "
                              f"came before this one")
        cfg.reward.functions = [f"rm:{reward_model}" if f == "rm:" else f for f in cfg.reward.functions]
    if job == "rm":
        if not cfg.rm.pairs:
            if not samples.get("pairs"):
                raise ConfigError(f"stages[{n}] (rm): no rm.pairs and no earlier sample stage with sample.pairs: true")
            cfg.rm.pairs = samples["pairs"]
        summary = rm.run_rm(cfg, console)
        return {**rec, "reward_model": _final_checkpoint(run_dir), "rm_eval": summary["after"]}
    if job == "sample":
        if not model_from:
            raise ConfigError(f"stages[{n}] (sample): needs a trained model from an earlier stage")
        run_dir.mkdir(parents=True, exist_ok=True)
        out = run_dir / ("pairs.jsonl" if cfg.sample.pairs else "samples.jsonl")
        stats = sample.run_sample(model_from, cfg, out, console)
        if not stats.get("pairs", stats.get("accepted")):
            what = "pairs" if cfg.sample.pairs else "completion reached sample.min_reward"
            raise DataError(f"stages[{n}] (sample): no {what}"
                            f" among {stats['samples']} samples, so the next stage has nothing to train on; lower "
                            f"sample.min_reward, raise sample.k / sample.num_prompts, or train longer before it")
        return {**rec, "output": str(out), "pairs": cfg.sample.pairs, "sample": stats}
    if job == "sft" and not cfg.sft.train_path and samples.get("samples"):
        cfg.sft.train_path = samples["samples"]
    if job == "dpo" and not cfg.dpo.pairs:
        if not samples.get("pairs"):
            raise ConfigError(f"stages[{n}] (dpo): no dpo.pairs and no earlier sample stage with sample.pairs: true")
        cfg.dpo.pairs = samples["pairs"]
    if OLD_NAMES.get(job, job) == "train":
        ev = train.run_train(cfg, console)
    else:
        run = {"sft": sft.run_sft, "dpo": dpo.run_dpo, "distill": distill.run_distill}[job]
        # the model this stage starts from was evaluated at the end of the last stage: reused when the
        # eval is set up the same way (same problems, settings and seed: the same numbers)
        same = last is not None and last.get("eval_setup") == _eval_setup(cfg)
        summary = run(cfg, console, before=last["eval"] if same else None)
        ev = summary["after"]
    return {**rec, "checkpoint": _final_checkpoint(run_dir),
            "eval": {k.removeprefix("eval/"): v for k, v in ev.items() if isinstance(v, (int, float))},
            "eval_setup": _eval_setup(cfg)}


def _eval_setup(cfg: Config) -> str:
    """What a held-out eval depends on besides the model: equal setups give equal numbers."""
    return json.dumps([cfg.eval.__dict__, cfg.data.__dict__, cfg.rollout.max_new_tokens, cfg.train.seed],
                      sort_keys=True)
