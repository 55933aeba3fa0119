"""One GRPO step: our trainer vs TRL's `GRPOTrainer` on the same model, same settings.

--shape tiny (default): a tiny Llama (hidden 128, BPE vocabulary of 512), 1 prompt x 8 completions x
exactly 64 new tokens.
--shape realistic: the Llama of bench/rollout.py --shape realistic (hidden 512, 8 layers, 8 heads, MLP
1024, untied head, ~54M parameters) with a 32,000-entry character-level tokenizer (bench/memory.py's),
8 prompts of exactly 128 tokens x 8 completions x exactly 128 new tokens (not the rollout bench's 256:
a step then takes ~30-60 s per side, and the bench ~15 min). It also measures this machine's matmul
limit in the same run (bench/roofline.py) and reports the step's useful FLOP/s against it.

Both shapes: beta 0.04 (both hold a frozen reference
model), temperature 1.0, AdamW lr 1e-5, fp32, CPU, 2 threads, one optimizer pass per batch
(num_iterations 1), each side's GRPO loss (ours: `algorithm.preset=grpo`; TRL:
`loss_type="grpo"`), the same reward function on both sides (`grpolab.rewards.length`:
closeness of the completion to 50 characters, cheap, and it varies within a group, so the
advantages are not all zero). A "step" is everything: generation, rewards, reference
log-probs, advantages, forward/backward and the optimizer step.

Prints ONE JSON line on stdout (everything else goes to stderr): median seconds per step of
each, the ratio TRL / ours, each one's peak RSS, our step's time breakdown and the versions.

TRL is not a project dependency; it lives in this benchmark's own environment:

    python3 -m venv bench/.venv-trl
    bench/.venv-trl/bin/pip install --upgrade pip
    bench/.venv-trl/bin/pip install torch==2.13.0          # the CPU wheel on this machine's disk
    bench/.venv-trl/bin/pip install -r bench/requirements-trl.txt
    bench/.venv-trl/bin/pip install -e .                    # grpolab itself

    bench/.venv-trl/bin/python bench/step.py [--runs 5] [--warmup 1]

--model smollm2 (or a model directory): a real pretrained model in the setting of bench/_smollm2.py
(SmolLM2-135M-Instruct + LoRA r16 on every block linear, GSM8K-easy chat prompts in the order grpolab's
sampler draws them, rewards gsm8k_accuracy + format, beta 0, lr 1e-4, micro-batches of 8 rows with
gradient accumulation on both sides), --prompts (default 4) x 8 completions of exactly --new-tokens
(default 128) tokens each: the end-of-turn token is masked on both sides as described below, so both do
the same work. The time breakdown of TRL's step (generation, scoring, the rest) is reported too.

    bench/.venv-trl/bin/python bench/step.py --model smollm2 [--runs 2] [--warmup 1] [--prompts 4] [--new-tokens 128]

Run with a Python that has no TRL (e.g. `.venv/bin/python bench/step.py`) it says so in the
JSON (`"trl": null` and a `note`) and measures ours alone, exit status 0.

How the two are made to do exactly the same work
  * Model: `grpolab.models.tiny_hf.save_tiny_model` (random weights, BPE tokenizer trained on
    the spot) saved once to a temporary directory; both trainers load that directory.
  * Prompt: `arithmetic.generate("train", 1, seed=0)[0]`, a plain string on both sides
    (same token ids: the tokenizer adds no BOS).
  * Exactly 64 tokens, ours: `rollout.ignore_eos=true`, so the rollout passes no stop ids to the
    engine (the same thing bench/rollout.py does) and always runs `rollout.max_new_tokens` = 64
    steps. An EOS token may still be sampled; it is just not a stop.
  * Exactly 64 tokens, TRL: `max_completion_length=64` plus `generation_kwargs=
    {"min_new_tokens": 64}`, which transformers' `generate` implements by setting the logits
    of every EOS id (TRL always includes the tokenizer's EOS) to -inf for the first 64
    tokens, so no completion ends or is cut early.
    Both are checked with an assert on every step: 8 x 64 completion tokens, mask all ones.
  * TRL's non-default settings: activation checkpointing off (`gradient_checkpointing=False`,
    and `activation_checkpointing=False`, its new name in transformers 5.23) and `bf16=False`
    (TRL defaults to True for both), `optim="adamw_torch"` (transformers' default on torch >= 2.8
    is the fused AdamW; ours is plain `torch.optim.AdamW`), `lr_scheduler_type="constant"`
    with no warm-up (ours: `optim.warmup_steps=0`, constant), Adam betas (0.9, 0.999) on both
    sides, grad-norm clip 1.0 on both, `use_cpu=True`, no vLLM, `shuffle_dataset=False`,
    logging, saving and evaluation off.

How a step is timed, and why it alternates inside TRL's own loop
  TRL's step only exists inside `Trainer.train()`'s loop (its dataloader, buffered
  generations and accelerate state), so we let that loop run (`max_steps = warmup + runs`)
  and use a `TrainerCallback`: `on_step_begin` first runs and times one step of OUR trainer
  (`GRPOTrainer.train_step()`), then starts TRL's clock; `on_step_end` (after TRL's
  generation, rewards, reference pass, loss, backward, clipping and optimizer step) stops it.
  So the runs alternate ours, TRL, ours, TRL, ... in one process, and the first `--warmup`
  pairs are not counted. Left outside TRL's timed window: fetching the 8 prompt rows from its
  dataloader (before `on_step_begin`) and its log/save/eval check after `on_step_end` (both
  off), i.e. microseconds.

Peak RSS
  Measured in separate processes (this script re-invoked with `--only ours|trl`), each
  loading the model, doing the warm-up and two steps of that trainer alone, and reporting
  its peak resident set size, VmHWM from /proc/self/status (imports included: that is what a
  user pays). Not `getrusage(RUSAGE_SELF).ru_maxrss`: Linux carries that across fork/exec, so
  each child reported the parent's peak (both trainers together) - the same number twice.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _smollm2  # bench/_smollm2.py (this script's folder is on sys.path): the --model setting
import torch

from grpolab.config.load import config_from_dict
from grpolab.data.tasks import arithmetic
from grpolab.jobs.inputs import load_policy
from grpolab.models.tiny_hf import save_tiny_model
from grpolab.monitor.console import Console
from grpolab.rewards import REWARDS
from grpolab.train.grpo import GRPOTrainer

BETA, LR, SEED, THREADS = 0.04, 1e-5, 0, 2
SHAPES = {   # prompts, completions per prompt, prompt tokens (None: the task's own), new tokens
    "tiny": {"prompts": 1, "G": 8, "prompt_tokens": None, "new_tokens": 64},
    "realistic": {"prompts": 8, "G": 8, "prompt_tokens": 128, "new_tokens": 128},
}
P, G, NEW_TOKENS = 1, 8, 64   # set from --shape in main()
REAL: dict | None = None      # --model: {"model": its directory, "setting": _smollm2.Setting}
REWARD = "length"   # grpolab.rewards.length, given to TRL as the very same function
TRL_INSTALL = ("python3 -m venv bench/.venv-trl && bench/.venv-trl/bin/pip install torch==2.13.0 && "
               "bench/.venv-trl/bin/pip install -r bench/requirements-trl.txt && "
               "bench/.venv-trl/bin/pip install -e . ; then run bench/.venv-trl/bin/python bench/step.py")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def trl_version() -> str | None:
    """TRL's version, or None when it cannot be imported in this Python."""
    try:
        import trl
    except ImportError:
        return None
    return trl.__version__


def the_rows(shape: str, steps: int = 1) -> list[dict]:
    """The P arithmetic word problems every step trains on ('prompt', 'answer'); with --model, the
    P x `steps` GSM8K rows grpolab's trainer draws in its first `steps` steps."""
    if REAL:
        return _smollm2.drawn_rows(REAL["setting"], steps, REAL["model"])
    if SHAPES[shape]["prompt_tokens"] is None:
        return arithmetic.generate("train", P, seed=0)
    import memory
    return memory.rows(P, SHAPES[shape]["prompt_tokens"])


def peak_rss_mib() -> float:
    """Peak RSS of this process's own address space, MiB.

    VmHWM, not `getrusage().ru_maxrss`: Linux carries ru_maxrss across fork/exec, so a child
    started by a parent holding both trainers would report the parent's size, not its own.
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024   # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # Linux: KiB; macOS: bytes


# ---------------------------------------------------------------- ours

def build_ours(model_dir: Path, rows: list[dict], run_dir: Path) -> GRPOTrainer:
    """Our trainer on the tiny Llama, configured like the TRL side (see the module docstring)."""
    if REAL:
        trainer = _smollm2.build_ours(model_dir, run_dir, REAL["setting"])
        got = _smollm2.ours_draws(trainer, REAL["setting"], len(rows) // P)
        assert [(r["prompt"], r["answer"]) for r in got] == [(r["prompt"], r["answer"]) for r in rows]
        return trainer
    cfg = config_from_dict({
        "model": {"name_or_path": str(model_dir), "dtype": "float32", "device": "cpu"},
        "algorithm": {"preset": "grpo", "beta": BETA, "num_iterations": 1},
        "rollout": {"prompts_per_step": P, "num_generations": G, "max_new_tokens": NEW_TOKENS,
                    "temperature": 1.0, "top_k": 0, "top_p": 1.0, "ignore_eos": True},
        "reward": {"functions": [REWARD]},
        "optim": {"lr": LR, "beta1": 0.9, "beta2": 0.999, "weight_decay": 0.0, "warmup_steps": 0,
                  "lr_schedule": "constant", "max_grad_norm": 1.0, "micro_batch_size": 0},
        "train": {"max_steps": 10_000, "seed": SEED, "threads": THREADS, "output_dir": str(run_dir)},
        "log": {"level": "quiet", "samples_every": 0},
    })
    console = Console(stream=sys.stderr, level="quiet")
    model, tok = load_policy(cfg, rows, console)
    return GRPOTrainer(cfg, model, tok, rows, [], run_dir, console)


def ours_step(trainer: GRPOTrainer) -> tuple[float, dict]:
    """One full step of our trainer: (seconds, its metrics dict with the time/* breakdown)."""
    t0 = time.perf_counter()
    metrics = trainer.train_step()
    dt = time.perf_counter() - t0
    g = trainer.last_batch.gen
    assert tuple(g.completion_ids.shape) == (P * G, NEW_TOKENS) and bool(g.completion_mask.all()), \
        f"ours produced {tuple(g.completion_ids.shape)} / {int(g.completion_mask.sum())} completion tokens"
    return dt, metrics


# ---------------------------------------------------------------- TRL

def build_trl(model_dir: Path, rows: list[dict], out_dir: Path, max_steps: int, callbacks: list):
    """TRL's GRPOTrainer with the same model, prompt, reward and settings as ours."""
    if REAL:
        return _smollm2.build_trl(model_dir, rows, out_dir, REAL["setting"], max_steps, callbacks)
    from datasets import Dataset
    from trl import GRPOConfig
    from trl import GRPOTrainer as TRLGRPOTrainer

    args = GRPOConfig(
        output_dir=str(out_dir), max_steps=max_steps, seed=SEED,
        # P prompts x G completions per optimizer step, generated once per step
        per_device_train_batch_size=P * G, gradient_accumulation_steps=1, num_generations=G,
        generation_batch_size=P * G, num_iterations=1, shuffle_dataset=False,
        # exactly NEW_TOKENS tokens: EOS is masked out until then (see the module docstring)
        max_completion_length=NEW_TOKENS, generation_kwargs={"min_new_tokens": NEW_TOKENS},
        temperature=1.0, top_p=1.0, top_k=0,
        beta=BETA, loss_type="grpo", scale_rewards="group",
        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch",
        adam_beta1=0.9, adam_beta2=0.999, weight_decay=0.0, max_grad_norm=1.0,
        model_init_kwargs={"dtype": "float32"}, bf16=False, fp16=False, use_cpu=True, use_vllm=False,
        **_no_checkpointing(GRPOConfig),
        report_to="none", logging_strategy="no", save_strategy="no", eval_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0, log_completions=False,
    )
    assert not args.gradient_checkpointing and not getattr(args, "activation_checkpointing", False)
    # The same P rows max_steps times: one epoch covers the whole run (no epoch restarts between steps).
    dataset = Dataset.from_list(rows * max_steps)
    trainer = TRLGRPOTrainer(model=str(model_dir), reward_funcs=[REWARDS[REWARD]], args=args,
                             train_dataset=dataset, callbacks=callbacks)
    return trainer


def _no_checkpointing(config_cls) -> dict:
    """Keyword arguments that turn activation checkpointing off. TRL defaults
    `gradient_checkpointing` to True; transformers 5.23 renamed it `activation_checkpointing`
    (the old name is a deprecated alias that only applies when the new one is unset), so set
    the new name where it exists and the old one always."""
    names = {f.name for f in dataclasses.fields(config_cls)}
    kw = {"gradient_checkpointing": False}
    if "activation_checkpointing" in names:
        kw["activation_checkpointing"] = False
    return kw


def check_trl_batch(trainer) -> None:
    """TRL keeps the step's generated batch in `_buffered_inputs`; check it is G x NEW_TOKENS, all real tokens."""
    ids = torch.cat([b["completion_ids"] for b in trainer._buffered_inputs])   # its micro-batches
    mask = torch.cat([b["completion_mask"] for b in trainer._buffered_inputs])
    assert tuple(ids.shape) == (P * G, NEW_TOKENS) and int(mask.sum()) == P * G * NEW_TOKENS, \
        f"TRL produced {tuple(ids.shape)} / {int(mask.sum())} completion tokens"


def time_trl_generate(trainer) -> list[float]:
    """Wrap the instance's `_generate` (tokenize, generate, decode) to record its seconds per call."""
    seconds: list[float] = []
    inner = trainer._generate

    def timed(*a, **kw):
        t0 = time.perf_counter()
        try:
            return inner(*a, **kw)
        finally:
            seconds.append(time.perf_counter() - t0)

    trainer._generate = timed
    return seconds


def alternating_callback(ours: GRPOTrainer | None, warmup: int):
    """A TrainerCallback that runs one of our steps before each TRL step and times both."""
    from transformers import TrainerCallback

    class Alternate(TrainerCallback):
        def __init__(self) -> None:
            self.trl: list[float] = []
            self.ours: list[float] = []
            self.ours_metrics: list[dict] = []
            self.trainer = None          # set once the TRL trainer exists
            self._t0 = 0.0

        def on_step_begin(self, args, state, control, **kw):
            if ours is not None:
                dt, m = ours_step(ours)
                if state.global_step >= warmup:
                    self.ours.append(dt)
                    self.ours_metrics.append(m)
            assert torch.get_num_threads() == THREADS
            self._t0 = time.perf_counter()   # TRL's step starts right after this returns

        def on_step_end(self, args, state, control, **kw):
            dt = time.perf_counter() - self._t0
            check_trl_batch(self.trainer)
            if state.global_step > warmup:   # global_step already counts this step
                self.trl.append(dt)

    return Alternate()


# ---------------------------------------------------------------- modes

def median_breakdown(metrics: list[dict]) -> dict:
    keys = ("time/generate", "time/reward", "time/ref_and_advantages", "time/update")
    return {k.split("/", 1)[1]: round(statistics.median(m[k] for m in metrics), 4) for k in keys}


def measure_rss(which: str, model_dir: Path, warmup: int, shape: str) -> float:
    """Peak RSS (MiB) of a fresh process running `which` alone (model load, warm-up, 2 steps; --model: 1 step)."""
    cmd = [sys.executable, __file__, "--only", which, "--model-dir", str(model_dir), "--warmup", str(warmup)]
    cmd += ["--model", str(model_dir), "--prompts", str(P), "--new-tokens", str(NEW_TOKENS)] if REAL else \
        ["--shape", shape]
    out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_rss_mib"]


def run_only(which: str, model_dir: Path, warmup: int, shape: str) -> dict:
    """The --only child: one trainer alone, for its peak RSS."""
    steps = 1 if REAL else warmup + 2   # a real model's step takes minutes here; the first one reaches the peak
    rows = the_rows(shape, steps)
    with tempfile.TemporaryDirectory() as tmp:
        if which == "ours":
            trainer = build_ours(model_dir, rows, Path(tmp))
            for _ in range(steps):
                ours_step(trainer)
        else:
            cb = alternating_callback(None, warmup)
            trainer = build_trl(model_dir, rows, Path(tmp), steps, [cb])
            cb.trainer = trainer
            torch.set_num_threads(THREADS)
            trainer.train()
    return {"only": which, "peak_rss_mib": round(peak_rss_mib(), 1)}


def step_flops(model_dir: Path, prompt_tokens: int) -> float:
    """Useful matmul FLOPs of one step, the least work the step needs: each prompt through the model
    once per pass (sampling's prefill, the reference forward, the policy's forward and backward) and
    every completion token once per pass; the head only where a completion token is predicted.
    Forward: 2 x weights per token (projections; the head 2 x hidden x vocab) plus attention's QK and AV
    (4 x layers x hidden x context); backward: twice the forward."""
    from transformers import AutoConfig
    c = AutoConfig.from_pretrained(model_dir)
    trunk = c.num_hidden_layers * (4 * c.hidden_size ** 2 + 3 * c.hidden_size * c.intermediate_size)
    head = c.hidden_size * c.vocab_size
    attn = 4 * c.num_hidden_layers * c.hidden_size
    Lp, C = prompt_tokens, NEW_TOKENS
    prompt = P * (2 * trunk * Lp + attn * Lp * Lp / 2)                      # P prompts, causal context
    completion = P * G * (2 * (trunk + head) * C + attn * C * (Lp + C / 2))  # every row's tokens
    return (prompt + completion) * (1 + 1 + 3)   # sampling, reference, policy forward + backward


def run_bench(model_dir: Path, runs: int, warmup: int, shape: str) -> dict:
    """Timed alternation in this process, then each side's peak RSS in its own process."""
    rows = the_rows(shape, warmup + runs)
    version = trl_version()
    result: dict = {"bench": "step", "shape": shape, "prompts": P, "completions": G, "new_tokens": NEW_TOKENS,
                    "beta": BETA, "runs": runs, "warmup": warmup, "threads": THREADS, "reward": REWARD}
    if REAL:
        result.update({"model": str(model_dir), "setting": dataclasses.asdict(REAL["setting"]),
                       "reward": list(_smollm2.REWARD_NAMES), "beta": REAL["setting"].beta,
                       "loadavg_1m_start": round(os.getloadavg()[0], 2)})
    with tempfile.TemporaryDirectory() as tmp:
        ours = build_ours(model_dir, rows, Path(tmp) / "ours")
        prompt_tokens = len(ours.tok.render_prompt(rows[0]["prompt"]))
        if version is None:
            log("TRL is not installed here: measuring ours alone")
            for _ in range(warmup):
                ours_step(ours)
            timed = [ours_step(ours) for _ in range(runs)]
            ours_s, ours_m = [t for t, _ in timed], [m for _, m in timed]
            trl_s, trl_gen = None, None
        else:
            cb = alternating_callback(ours, warmup)
            trl = build_trl(model_dir, rows, Path(tmp) / "trl", warmup + runs, [cb])
            cb.trainer = trl
            gen_seconds = time_trl_generate(trl) if not REAL else None
            timers = _smollm2.TRLTimers(trl) if REAL else None
            torch.set_num_threads(THREADS)   # again: nothing on the way may have changed it
            log(f"alternating ours / TRL: {warmup} warm-up + {runs} timed steps each")
            trl.train()
            ours_s, ours_m, trl_s = cb.ours, cb.ours_metrics, cb.trl
            if REAL:   # one generation and one scoring call per step
                gen_seconds = timers.generate
                trl_rew = statistics.median(timers.reward[warmup:])
            trl_gen = statistics.median(gen_seconds[warmup:])
        assert len(ours_s) == runs and (trl_s is None or len(trl_s) == runs)
    ours_med = statistics.median(ours_s)
    result["ours_s_per_step"] = round(ours_med, 4)
    result["ours_breakdown_s"] = median_breakdown(ours_m)
    result["ours_runs_s"] = [round(t, 4) for t in ours_s]
    if shape == "realistic":
        import roofline
        limits = roofline.measure()
        flops = step_flops(model_dir, prompt_tokens)
        result["limits"] = limits
        result["useful_gflop_per_step"] = round(flops / 1e9, 1)
        # against the update-shape matmul rate: most of a step's FLOPs are the forward and backward
        result["ours_fraction_of_matmul_limit"] = round(flops / ours_med / 1e9 / limits["update_matmul_gflops"], 3)
    if trl_s is not None:
        trl_med = statistics.median(trl_s)
        result["trl_s_per_step"] = round(trl_med, 4)
        result["trl_generate_s"] = round(trl_gen, 4)
        if REAL:
            result["trl_breakdown_s"] = {"generate": round(trl_gen, 4), "reward": round(trl_rew, 4),
                                         "rest": round(trl_med - trl_gen - trl_rew, 4)}
            result["ratio_trl_over_ours_generate"] = round(trl_gen / result["ours_breakdown_s"]["generate"], 2)
        result["trl_runs_s"] = [round(t, 4) for t in trl_s]
        result["ratio_trl_over_ours"] = round(trl_med / ours_med, 2)
        if shape == "realistic":
            result["trl_fraction_of_matmul_limit"] = round(
                flops / trl_med / 1e9 / result["limits"]["update_matmul_gflops"], 3)
    log("peak RSS: one process per trainer ...")
    result["ours_peak_rss_mib"] = measure_rss("ours", model_dir, warmup, shape)
    if version is None:
        result["trl"] = None
        result["note"] = (f"TRL is not installed in {sys.executable}; ours measured alone. "
                          f"To compare: {TRL_INSTALL}")
    else:
        result["trl_peak_rss_mib"] = measure_rss("trl", model_dir, warmup, shape)
        result["trl_version"] = version
    import transformers
    result["transformers"] = transformers.__version__
    result["torch"] = torch.__version__
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5, help="timed steps of each trainer (median reported)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps of each trainer first")
    ap.add_argument("--shape", choices=tuple(SHAPES), default="tiny", help="the model and batch (see above)")
    ap.add_argument("--only", choices=("ours", "trl"), help=argparse.SUPPRESS)     # peak-RSS child
    ap.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)              # peak-RSS child
    ap.add_argument("--model", help="a real model: 'smollm2' or a model directory (see above)")
    ap.add_argument("--prompts", type=int, default=4, help="--model: prompts per step (x 8 completions)")
    ap.add_argument("--new-tokens", type=int, default=128, help="--model: tokens per completion")
    args = ap.parse_args()
    if args.runs < 1 or args.warmup < 0 or args.prompts < 1 or args.new_tokens < 1:
        ap.error("--runs, --prompts and --new-tokens must be >= 1 and --warmup >= 0")
    global P, G, NEW_TOKENS, REAL
    P, G, NEW_TOKENS = (SHAPES[args.shape][k] for k in ("prompts", "G", "new_tokens"))
    if args.model:
        model = _smollm2.resolve_model(args.model)
        setting = _smollm2.Setting(prompts=args.prompts, max_new=args.new_tokens, exact_length=True)
        REAL = {"model": model, "setting": setting}
        P, G, NEW_TOKENS, args.shape = setting.prompts, setting.completions, setting.max_new, "model"
    sys.path.insert(0, str(Path(__file__).resolve().parent))   # bench/memory.py and bench/roofline.py
    torch.set_num_threads(THREADS)
    torch.manual_seed(SEED)
    stdout = sys.stdout
    # Libraries may print; keep stdout for the one JSON line.
    with contextlib.redirect_stdout(sys.stderr):
        if args.only:
            result = run_only(args.only, args.model_dir, args.warmup, args.shape)
        else:
            t0 = time.perf_counter()
            with tempfile.TemporaryDirectory() as d:
                if REAL:
                    model_dir = REAL["model"]
                elif args.shape == "tiny":
                    model_dir = save_tiny_model(Path(d) / "tiny-llama", vocab_size=512, hidden=128, layers=4,
                                                heads=4, intermediate=512)
                else:
                    import memory
                    model_dir = Path(d) / "llama"
                    memory.build_model(model_dir, layers=8, intermediate=1024, tie=False)
                result = run_bench(model_dir, args.runs, args.warmup, args.shape)
            result["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(result), file=stdout, flush=True)


if __name__ == "__main__":
    main()
