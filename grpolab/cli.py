"""Command line: grpolab demo | train | sft | dpo | rm | distill | sample | pipeline | eval | export | report |
serve | generate | tiny-model. Thin: parse, build the config, call the verb's job from VERBS."""

from __future__ import annotations

import argparse
import errno
import logging
import os
import re
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import torch.distributed
from safetensors import SafetensorError
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from . import distributed
from .config import Config
from .config.load import load_config
from .errors import CheckpointError, ConfigError, DataError, EnvError, ExportError, RewardError, TrainingError
from .jobs import demo, distill, dpo, export, generate, pipeline, report, rm, sample, serve, sft, tiny_model, train
from .jobs import eval as eval_job
from .utils.files import says_disk_full, torch_write_failed

DEMO_DIR = "runs/demo"

# each verb's job: run(cfg, args), cfg the loaded config (None for a verb without one, see _config);
# jobs.eval comes in as eval_job, as `eval` would hide the builtin
VERBS: dict[str, Callable[[Config | None, argparse.Namespace], Any]] = {
    "demo": demo.run, "train": train.run, "sft": sft.run, "dpo": dpo.run, "rm": rm.run, "distill": distill.run,
    "sample": sample.run, "pipeline": pipeline.run, "eval": eval_job.run, "serve": serve.run,
    "generate": generate.run, "report": report.run, "export": export.run, "tiny-model": tiny_model.run,
}


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (`grpolab: usage error: ...`, exit 2), as every other
    bad input is, with a pointer to the command's --help instead of the whole usage text."""

    def error(self, message: str):
        self.exit(2, f"grpolab: usage error: {message} (see {self.prog} --help)\n")


def _port(text: str) -> int:
    """--port: a TCP port number (0: any free port)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be between 0 and 65535 (0: any free port), got {port}")
    return port


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="grpolab", description="GRPO-family RL post-training for language models.")
    p.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="warm start the built-in model, GRPO, before/after table")
    d.add_argument("--steps", type=int, default=None, help="GRPO steps (default: train.max_steps)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--out", default=None,
                   help=f"run directory (default: a train.output_dir=... override, else {DEMO_DIR})")
    d.add_argument("--nproc", type=int, default=1, help="local processes (ranks) for data-parallel training")
    d.add_argument("--rollout-workers", type=int, default=None, help="rollout worker processes (train.rollout_workers; "
                   "with train.async_steps=k they sample k steps ahead)")
    d.add_argument("--config", default=None, help="YAML config to demo instead of the defaults, e.g. "
                   "configs/code_demo.yaml")
    d.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. optim.lr=1e-4")

    t = sub.add_parser("train", help="run GRPO from a YAML config")
    t.add_argument("config", nargs="?", help="YAML config file (omit for the defaults)")
    t.add_argument("--nproc", type=int, default=1, help="local processes (ranks) for data-parallel training, "
                   "started with torch.distributed.run; or launch with torchrun -m grpolab train ...")
    t.add_argument("--rollout-workers", type=int, default=None, help="rollout worker processes beside the trainer "
                   "(train.rollout_workers; with train.async_steps=k they sample k steps ahead)")
    t.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")

    for name, what in (("sft", "supervised fine-tuning on prompt/completion rows or conversations"),
                       ("dpo", "direct preference optimisation on prompt/chosen/rejected pairs"),
                       ("rm", "train a reward model (Bradley-Terry) on prompt/chosen/rejected pairs; "
                              "use it as reward rm:<checkpoint>"),
                       ("distill", "distil distill.teacher into the model (logits or on-policy)")):
        j = sub.add_parser(name, help=what)
        j.add_argument("config", nargs="?", help="YAML config file (omit for the defaults)")
        j.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")

    sp = sub.add_parser("sample", help="rejection sampling: K scored completions per training prompt; accepted "
                                       "ones as SFT rows (or best/worst pairs for DPO)")
    sp.add_argument("checkpoint", help="checkpoint directory (…/checkpoints/step_N) or Hugging Face model dir")
    sp.add_argument("--out", required=True, help="jsonl file to write")
    sp.add_argument("--k", type=int, default=None, help="completions per prompt (default sample.k)")
    sp.add_argument("--pairs", action="store_true", help="write DPO pairs: each prompt's best vs worst by reward")
    sp.add_argument("--config", default=None, help="YAML config for data/reward/rollout/sample settings "
                    "(default: the run's config.yaml when CHECKPOINT is a run's checkpoints/step_N)")
    sp.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")

    pl = sub.add_parser("pipeline",
                        help="run a config's stages (sft, train, sample, dpo, rm, distill) one after another")
    pl.add_argument("config", help="YAML config with a `stages:` list")
    pl.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, applied to every stage")

    e = sub.add_parser("eval", help="evaluate a checkpoint or Hugging Face model on the held-out split")
    e.add_argument("checkpoint", help="checkpoint directory (…/checkpoints/step_N) or Hugging Face model dir")
    e.add_argument("--config", default=None, help="YAML config for data/eval settings (default: the run's "
                   "config.yaml when CHECKPOINT is a run's checkpoints/step_N)")
    e.add_argument("--out", default=None, help="where to write eval.json (default: the checkpoint dir)")
    e.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")

    v = sub.add_parser("serve", help="serve a checkpoint or Hugging Face model with an OpenAI-compatible API "
                                     "(needs grpolab[serve])")
    v.add_argument("model", help="checkpoint directory (…/checkpoints/step_N), export, or Hugging Face model dir")
    v.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for all)")
    v.add_argument("--port", type=_port, default=8000, help="port to listen on (default 8000; 0: any free port)")
    v.add_argument("--max-batch", type=int, default=64, help="most sequences decoded together (default 64); "
                   "more requests wait their turn")
    v.add_argument("--name", default=None, help="model name clients send (default: MODEL as given)")
    v.add_argument("--max-model-len", type=int, default=None, help="context length: prompt plus completion "
                   "(default: the model's own)")
    v.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    v.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto")
    v.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="uvicorn's log level (info: one line per request)")
    v.add_argument("--api-key", default=os.environ.get("GRPOLAB_API_KEY") or None,
                   help="require 'Authorization: Bearer KEY' on every request but /health (401 without); "
                        "default: $GRPOLAB_API_KEY, else no key")
    v.add_argument("--max-rows-per-request", type=_positive, default=None,
                   help="most rows (prompts × n) one request may ask for; more is a 400 (default 1024)")
    v.add_argument("--max-waiting", type=_positive, default=None,
                   help="most rows waiting for a place in the batch; a request beyond is a 429, which "
                        "clients retry (default 4096)")
    v.add_argument("--max-request-bytes", type=_positive, default=None,
                   help="largest request body; a larger one is a 413 before it is read (default 8388608, 8 MiB)")
    v.add_argument("--prefix-cache-gib", type=float, default=1.0,
                   help="memory for the keys and values of prompt prefixes already seen, reused by later prompts "
                        "that start the same way (default 1.0; 0: prefix caching off). Llama-family models only")
    v.add_argument("--prefill-chunk", type=int, default=512,
                   help="while requests are decoding, prefill at most this many new prompt tokens per step, so a "
                        "long prompt goes in chunks and the running streams keep going (default 512; 0: no limit; "
                        "else at least 16). Llama-family models only")
    v.add_argument("--kernel-cache", type=_positive, default=256,
                   help="compiled CPU matrix-product kernels kept per shape cache, about 0.3 MiB each: bounds how "
                        "far the process grows as batch shapes vary (default 256; PyTorch's own is 1024)")

    g = sub.add_parser("generate", help="offline batch generation for a jsonl of prompts (resumable)")
    g.add_argument("model", help="checkpoint directory (…/checkpoints/step_N), export, or Hugging Face model dir")
    g.add_argument("--in", dest="inp", required=True, help="jsonl: one object per line with a 'prompt' "
                   "(string or chat messages) and any other columns")
    g.add_argument("--out", required=True, help="jsonl to write (rows already there are skipped)")
    g.add_argument("--n", type=int, default=1, help="completions per prompt")
    g.add_argument("--max-batch", type=int, default=64, help="most sequences decoded together")
    g.add_argument("--score", action="store_true", help="score completions with the config's reward.functions")
    g.add_argument("--config", default=None, help="YAML config for --score (default: the run's config.yaml "
                   "when MODEL is a run's checkpoint)")
    g.add_argument("--max-model-len", type=int, default=None, help="context length: prompt plus completion "
                   "(default: the model's own)")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto")
    g.add_argument("overrides", nargs="*", metavar="key=value", help="sampling settings (max_tokens, temperature, "
                   "top_p, top_k, stop, seed) and dotted config overrides for --score")

    r = sub.add_parser("report", help="write RUN_DIR/report.html: plots of metrics.jsonl and sampled completions")
    r.add_argument("run_dir", help="a run directory (train.output_dir or the demo's --out)")

    x = sub.add_parser("export", help="write a standalone Hugging Face model directory from a checkpoint")
    x.add_argument("checkpoint", help="checkpoint directory (…/checkpoints/step_N)")
    x.add_argument("out_dir", help="new directory for the model (weights, config, tokenizer)")
    x.add_argument("--merge", action="store_true", help="merge LoRA adapters into the base weights "
                   "(without: a LoRA checkpoint of an HF model exports as peft's adapter directory)")
    x.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="dtype of the written weights (default float32)")

    m = sub.add_parser("tiny-model", help="write a tiny random Llama + BPE tokenizer (HF layout) for CPU runs")
    m.add_argument("out", help="directory to write (config.json, model.safetensors, tokenizer files)")
    m.add_argument("--data", default=None, help="jsonl file whose 'question'/'prompt' and 'answer' texts "
                                                  "train the tokenizer (default: arithmetic problems)")
    m.add_argument("--vocab-size", type=int, default=512)
    for cmd in sub.choices.values():   # a command's own usage errors point at its own --help
        cmd.set_defaults(cmd_parser=cmd)
    return p


# exit code of a rank that stopped only because another one failed: the launcher names the other
LOST_A_RANK = 3


def _launch(nproc: int, argv: list[str]) -> int:
    """Run `grpolab argv` as `nproc` local ranks with torch's elastic launcher (what torchrun
    --standalone does); its exit code. A failing rank prints its own one-line error; the launcher
    adds one line naming the rank, instead of its report."""
    rest, skip = [], False
    for a in argv:   # drop --nproc N / --nproc=N: each rank runs one process
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            rest.append(a)
    # torchrun would give each rank 1 thread; grpolab gives each its share of the cores (setup_torch)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    for name in [n for n in logging.root.manager.loggerDict if n.startswith("torch.distributed.elastic")]:
        logging.getLogger(name).setLevel(logging.CRITICAL)   # its own report: one line below instead
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0)
    try:
        elastic_launch(config, sys.executable)("-m", "grpolab", *rest)
        return 0
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        # not a cause: a rank that stopped because another left (LOST_A_RANK), or one the launcher itself
        # terminated (SIGTERM) once another had failed
        causes = sorted((f.timestamp, r) for r, f in e.failures.items()
                        if f.exitcode not in (LOST_A_RANK, -signal.SIGTERM))
        if causes:   # the rank that failed first for its own reason, not one that lost it
            rank = causes[0][1]
            failure = e.failures[rank]
        code = failure.exitcode
        if code == 130:   # stopped by a signal: the ranks synced the stop and rank 0 said so
            return 130
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        print(f"grpolab: rank {rank} {how}; the other ranks were stopped", file=sys.stderr)
        return 130 if code == -2 else (code if 0 < code < 128 else 1)
    except (KeyboardInterrupt, SignalException):   # the launcher passed the signal on; rank 0 saved and said so
        return 130


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    # key=value overrides may come before or after options: argparse leaves the later ones unparsed
    args, extra = parser.parse_known_args(argv)
    parser = getattr(args, "cmd_parser", parser)
    stray = [x for x in extra if x.startswith("-") or "=" not in x]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    args.overrides = list(getattr(args, "overrides", [])) + extra
    if getattr(args, "rollout_workers", None) is not None:   # --rollout-workers N is train.rollout_workers=N
        if args.rollout_workers < 0:
            parser.error("--rollout-workers: must be >= 0")
        args.overrides.append(f"train.rollout_workers={args.rollout_workers}")
    if args.debug:   # rollout workers (their own processes) print tracebacks too
        os.environ["GRPOLAB_DEBUG"] = "1"
    nproc = getattr(args, "nproc", 1)
    if nproc < 1:
        parser.error("--nproc: must be >= 1")
    if nproc > 1:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            parser.error("--nproc: already running under torchrun; drop --nproc")
        problem = _config_problem(args, nproc)   # one line here rather than from a rank the launcher may stop
        if problem:
            _error(f"config error: {problem}")
            return 2
        return _launch(nproc, argv)
    try:
        VERBS[args.command](_config(args, parser), args)
        return 0
    except ConfigError as e:
        if args.debug:
            raise
        _error(f"config error: {e}", same_on_every_rank=True)
        return 2
    except (DataError, RewardError, EnvError, TrainingError, CheckpointError, ExportError) as e:
        if args.debug:
            raise
        _error(f"{type(e).__name__.replace('Error', '').lower()} error: {e}",
               same_on_every_rank=isinstance(e, DataError))
        return 2
    except (FileNotFoundError, NotADirectoryError, ImportError) as e:
        if args.debug:
            raise
        _error(f"error: {e}")
        return 2
    except OSError as e:   # the safety net for writes: a full disk, a read-only file system, no permission
        if args.debug:
            raise
        _error(os_error_line(e))
        return 2
    except SafetensorError as e:   # its writer reports a full disk only in its message (os error 28)
        if args.debug:
            raise
        _error("error: disk full while writing a .safetensors file (No space left on device)"
               if says_disk_full(e) else f"error: safetensors: {' '.join(str(e).split())}")
        return 2
    except KeyboardInterrupt as e:
        # str(), not `e or ...`: an exception instance is always truthy, so an empty one printed a blank line
        _error(str(e).strip() or "interrupted", same_on_every_rank=True)
        return 130
    except RuntimeError as e:
        if not args.debug and torch_write_failed(e):   # torch.save's writer hides the OS error
            _error(f"error: writing a file failed ({' '.join(str(e).split())[:200]}); is the disk full?")
            return 2
        if not args.debug and _no_deterministic_kernel(e):
            _error(f"error: a CUDA op has no deterministic kernel ({str(e).strip().splitlines()[0][:160]}); "
                   f"train.cuda_deterministic=false runs it (and runs then differ from run to run)")
            return 2
        if args.debug or not _lost_a_rank(e):
            raise
        # the rank that failed says why, and the launcher names it; this one just says it stopped
        why = re.sub(r"^\[[^\]]*\]\s*", "", str(e).strip().splitlines()[0])[:160]   # without gloo's source path
        _error(f"stopped: another rank left the run ({why})", name_rank=True)
        return LOST_A_RANK


def os_error_line(e: OSError) -> str:
    """One line for an OSError: what happened to which file, in words (no errno numbers)."""
    where = " -> ".join(str(f) for f in (e.filename, e.filename2) if f is not None)
    if e.errno == errno.ENOSPC:
        return f"error: disk full while writing {where or 'a file'} (No space left on device)"
    if e.errno == errno.EDQUOT:
        return f"error: disk quota exceeded while writing {where or 'a file'}"
    if e.errno == errno.EROFS:
        return f"error: read-only file system: {where or 'cannot write'}"
    if e.errno in (errno.EACCES, errno.EPERM):
        return f"error: permission denied: {where or e.strerror or e}"
    what = " ".join((e.strerror or str(e) or type(e).__name__).split())   # a multi-line message as one line
    return f"error: {what}: {where}" if where else f"error: {what}"


def _config(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Config | None:
    """The config the verb runs with: the YAML file and overrides, with the verb's own options folded in
    (demo's --steps/--seed/--out, sample's --k/--pairs); None for a verb that takes none. Usage errors
    that the job itself would only meet later come here, before anything loads."""
    if args.command == "serve" and args.overrides:
        parser.error(f"unrecognized arguments: {' '.join(args.overrides)}")
    if args.command == "generate":
        if args.n < 1 or args.max_batch < 1:
            parser.error("--n and --max-batch must be >= 1")
        if args.n > args.max_batch:   # a prompt's n rows decode together: more would overrun the batch
            parser.error(f"--n {args.n} is more than --max-batch {args.max_batch}: raise --max-batch")
        _, dotted = generate.split_overrides(args.overrides)
        if dotted and not args.score:
            parser.error(f"{dotted[0]}: config overrides only matter with --score")
        return load_config(_run_config(args.model, args.config), dotted) if args.score else None
    if args.command == "demo":
        out = args.out or next((o.split("=", 1)[1] for o in reversed(args.overrides)
                                if o.startswith("train.output_dir=")), DEMO_DIR)
        overrides = list(args.overrides) + [f"train.seed={args.seed}", f"train.output_dir={out}"]
        if args.steps is not None:
            overrides.append(f"train.max_steps={args.steps}")
        return load_config(args.config, overrides)
    if args.command in ("train", "sft", "dpo", "rm", "distill"):
        return load_config(*_config_and_overrides(args))
    if args.command == "sample":
        overrides = list(args.overrides) + ([f"sample.k={args.k}"] if args.k is not None else []) + \
            (["sample.pairs=true"] if args.pairs else [])
        return load_config(_run_config(args.checkpoint, args.config), overrides)
    if args.command == "eval":
        return load_config(_run_config(args.checkpoint, args.config), args.overrides)
    return None   # pipeline (a config per stage), serve, report, export, tiny-model


def _run_config(checkpoint: str, config: str | None) -> str | None:
    """The config for a job on a checkpoint: --config when given, else the config.yaml of the run the
    checkpoint belongs to (RUN_DIR/checkpoints/step_N), else None (the defaults)."""
    if config is not None:
        return config
    p = Path(checkpoint)
    run_cfg = p.parent.parent / "config.yaml"
    if p.parent.name == "checkpoints" and run_cfg.is_file():
        print(f"grpolab: using {run_cfg} (the run's config; --config to use another)", file=sys.stderr)
        return str(run_cfg)
    return None


def _config_problem(args, nproc: int) -> str | None:
    """What is wrong with the config of a `train`/`demo` run on `nproc` ranks, found before any rank starts."""
    if args.command not in ("train", "demo"):
        return None
    try:
        if args.command == "train":
            cfg = load_config(*_config_and_overrides(args))
        else:
            steps = [f"train.max_steps={args.steps}"] if args.steps else []
            cfg = load_config(args.config, list(args.overrides) + steps)
    except ConfigError as e:
        return str(e)
    return distributed.check_world(distributed.World(rank=0, size=nproc, local_rank=0, local_size=nproc),
                                   cfg.rollout.prompts_per_step)


def _config_and_overrides(args) -> tuple[str | None, list[str]]:
    """The optional config file and the overrides (a first `key=value` is an override, not a file)."""
    config_path, overrides = args.config, list(args.overrides)
    if config_path and "=" in config_path and not config_path.endswith((".yaml", ".yml")):
        config_path, overrides = None, [config_path] + overrides
    return config_path, overrides


def _no_deterministic_kernel(e: RuntimeError) -> bool:
    """torch's strict deterministic mode (train.cuda_deterministic) refusing an op that has no deterministic kernel."""
    return "does not have a deterministic implementation" in str(e)


def _lost_a_rank(e: RuntimeError) -> bool:
    """A collective broken because another rank died or failed (under several ranks)."""
    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return False
    return isinstance(e, torch.distributed.DistError) or any(
        s in str(e) for s in ("Connection closed by peer", "Connection reset by peer", "gloo", "NCCL"))


def _error(msg: str, same_on_every_rank: bool = False, name_rank: bool = False) -> None:
    """One line on stderr. Under several ranks, rank 0 alone reports what every rank hits alike
    (a config or data error); other errors name their rank (`name_rank`: rank 0 names itself too)."""
    rank, size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if size > 1 and rank > 0 and same_on_every_rank:
        time.sleep(2.0)   # rank 0 says it; leaving later, so that the launcher does not stop rank 0 before it has
        return
    if size > 1 and (rank > 0 or name_rank):
        msg = f"[rank {rank}] {msg}"
    print(f"grpolab: {msg}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
