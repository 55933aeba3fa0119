"""The real-model benchmark setting shared by bench/race.py, bench/step.py and bench/rollout.py (--model).

SmolLM2-135M-Instruct (models/SmolLM2-135M-Instruct, `make smollm2`) + LoRA r=16 alpha=32 on every
linear layer of the blocks (q/k/v/o/gate/up/down_proj), GSM8K's easiest problems (data/gsm8k_easy,
`python scripts/gsm8k_easy.py`) as chat prompts with SYSTEM as the system message, the rewards
gsm8k_accuracy + format (grpolab.rewards: the very same functions on both sides), 4 prompts x 8
completions, at most 128 new tokens (ending at the template's end-of-turn token), temperature 1, beta 0
(no reference model on either side), the GRPO loss, epsilon 0.2, one update per batch, AdamW lr 1e-4
betas (0.9, 0.999) without weight decay, constant LR without warm-up, grad-norm clip 1.0, fp32, CPU,
2 threads, micro-batches of 8 rows (one group) with gradient accumulation on both sides.

grpolab gets these as a config (`ours_config`); TRL's GRPOTrainer as the matching GRPOConfig and a peft
LoraConfig (`build_trl`). Both see the same prompts in the same order: the rows grpolab's RowStream
draws (`drawn_rows`), handed to TRL in that order with its shuffling off.
"""

from __future__ import annotations

import copy
import dataclasses
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from grpolab.config import Config
from grpolab.config.load import config_from_dict
from grpolab.data.stream import RowStream
from grpolab.jobs.inputs import load_data
from grpolab.models.hf import HFPolicy, HFTokenizer
from grpolab.rewards import REWARDS
from grpolab.train.evaluate import evaluate

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"
DATA = ROOT / "data" / "gsm8k_easy"
SYSTEM = ("You are a helpful assistant. Solve the problem step by step, then give the final answer on its own "
          "line as '#### <number>'.")
REWARD_NAMES = ("gsm8k_accuracy", "format")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass
class Setting:
    prompts: int = 4          # prompts per step
    completions: int = 8      # G, completions per prompt
    max_new: int = 128        # new tokens at most
    micro: int = 8            # rows per forward/backward (both sides accumulate gradients over a step)
    lr: float = 1e-4
    beta: float = 0.0
    epsilon: float = 0.2
    lora_r: int = 16
    lora_alpha: float = 32.0
    threads: int = 2
    seed: int = 0
    exact_length: bool = False   # every completion runs exactly max_new tokens (step.py: identical work)


def resolve_model(arg: str) -> Path:
    """'smollm2' = models/SmolLM2-135M-Instruct, fetched like the tests do when absent; else a directory."""
    if arg == "smollm2":
        if not (DEFAULT_MODEL / "config.json").is_file():
            sys.path.insert(0, str(ROOT / "scripts"))
            import fetch_smollm2
            fetch_smollm2.fetch(DEFAULT_MODEL)
        return DEFAULT_MODEL
    path = Path(arg)
    if not (path / "config.json").is_file():
        raise SystemExit(f"bench: --model {arg!r} is not a model directory (no config.json)")
    return path


def ensure_data() -> Path:
    """data/gsm8k_easy, written by scripts/gsm8k_easy.py when absent."""
    if not (DATA / "train.jsonl").is_file():
        subprocess.run([sys.executable, str(ROOT / "scripts" / "gsm8k_easy.py")], check=True, stdout=sys.stderr)
    return DATA


def ours_config(model: Path, run_dir: Path, s: Setting, max_steps: int = 10_000) -> Config:
    """grpolab's config for the setting."""
    return config_from_dict({
        "model": {"name_or_path": str(model), "dtype": "float32", "device": "cpu", "lora_rank": s.lora_r,
                  "lora_alpha": s.lora_alpha, "lora_dropout": 0.0, "lora_target_modules": list(LORA_TARGETS)},
        "data": {"task": "gsm8k", "train_path": str(ensure_data()), "system_prompt": SYSTEM},
        "algorithm": {"preset": "grpo", "beta": s.beta, "epsilon": s.epsilon, "num_iterations": 1},
        "rollout": {"prompts_per_step": s.prompts, "num_generations": s.completions, "max_new_tokens": s.max_new,
                    "temperature": 1.0, "top_k": 0, "top_p": 1.0, "ignore_eos": s.exact_length},
        "reward": {"functions": list(REWARD_NAMES)},
        "optim": {"lr": s.lr, "beta1": 0.9, "beta2": 0.999, "weight_decay": 0.0, "warmup_steps": 0,
                  "lr_schedule": "constant", "max_grad_norm": 1.0, "micro_batch_size": s.micro},
        "train": {"max_steps": max_steps, "seed": s.seed, "threads": s.threads, "output_dir": str(run_dir)},
        "log": {"level": "quiet", "samples_every": 0},
        # the trainer's own eval is not used (the benches evaluate with `greedy_accuracy`); small, so its
        # memory check at start-up does not count a pass@8 batch nobody runs
        "eval": {"num_problems": 1, "k": 1, "batch_size": 64},
    })


def build_ours(model: Path, run_dir: Path, s: Setting, max_steps: int = 10_000):
    """grpolab's GRPOTrainer for the setting (the same path as `grpolab train`: data, policy, LoRA)."""
    from grpolab.jobs.train import build_trainer
    from grpolab.monitor.console import Console
    from grpolab.train.run import Run
    cfg = ours_config(model, run_dir, s, max_steps)
    return build_trainer(cfg, Run(cfg, "grpo"), Console(stream=sys.stderr, level="quiet"))


def drawn_rows(s: Setting, steps: int, model: Path) -> list[dict]:
    """The rows grpolab's trainer trains on in its first `steps` steps, in order (its seeded sampler)."""
    train, _ = load_data(ours_config(model, Path("unused"), s))
    sampler = RowStream(len(train), s.seed, keyed=True)
    return [train[i] for _ in range(steps) for i in sampler.next(s.prompts)]


def ours_draws(trainer, s: Setting, steps: int) -> list[dict]:
    """The same, read off a built trainer (a copy of its sampler): checks `drawn_rows` against it."""
    sampler = copy.deepcopy(trainer.sampler)
    return [trainer.train_rows[i] for _ in range(steps) for i in sampler.next(s.prompts)]


def eval_rows(n: int, model: Path, s: Setting) -> list[dict]:
    """The first n held-out problems (data/gsm8k_easy/test.jsonl), as chat prompts like the training ones."""
    _, test = load_data(ours_config(model, Path("unused"), s))
    return test[:n]


def greedy_accuracy(hf_model, tok: HFTokenizer, rows: list[dict], max_new: int) -> float:
    """The shared evaluator: grpolab's engine, greedy, gsm8k_accuracy, on a transformers (or peft) model's
    current weights. Same code for both sides' models."""
    was_training = hf_model.training
    hf_model.eval()
    with torch.inference_mode():
        acc = evaluate(HFPolicy(hf_model), tok, rows, k=1, max_new_tokens=max_new)["greedy_accuracy"]
    hf_model.train(was_training)
    return acc


def trl_tokenizer(model: Path) -> HFTokenizer:
    """grpolab's tokenizer wrapper without loading a second copy of the weights (for the evaluator)."""
    from transformers import AutoTokenizer, GenerationConfig

    from grpolab.models.hf import _stop_ids_from
    gen = GenerationConfig.from_pretrained(model)
    return HFTokenizer(AutoTokenizer.from_pretrained(model),
                       extra_stop_ids=_stop_ids_from(SimpleNamespace(generation_config=gen)))


def no_checkpointing(config_cls) -> dict:
    """TRL turns activation checkpointing on by default; transformers 5.23 renamed the switch."""
    names = {f.name for f in dataclasses.fields(config_cls)}
    return {"gradient_checkpointing": False, **({"activation_checkpointing": False}
                                                if "activation_checkpointing" in names else {})}


def build_trl(model: Path, rows: list[dict], out_dir: Path, s: Setting, max_steps: int, callbacks: list):
    """TRL's GRPOTrainer with the same model, LoRA, prompts (in `rows`' order), rewards and settings."""
    from datasets import Dataset
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    n = s.prompts * s.completions
    accumulate = n // s.micro
    exact = {"generation_kwargs": {"min_new_tokens": s.max_new}} if s.exact_length else {}
    args = GRPOConfig(
        output_dir=str(out_dir), max_steps=max_steps, seed=s.seed,
        # one generation of P x G rows per optimizer step, trained in micro-batches of s.micro rows
        per_device_train_batch_size=s.micro, gradient_accumulation_steps=accumulate, steps_per_generation=accumulate,
        num_generations=s.completions, num_iterations=1, shuffle_dataset=False,
        max_completion_length=s.max_new, temperature=1.0, top_p=1.0, top_k=0, **exact,
        beta=s.beta, epsilon=s.epsilon, loss_type="grpo", scale_rewards="group",
        learning_rate=s.lr, lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch",
        adam_beta1=0.9, adam_beta2=0.999, weight_decay=0.0, max_grad_norm=1.0,
        model_init_kwargs={"dtype": "float32"}, bf16=False, fp16=False, use_cpu=True, use_vllm=False,
        **no_checkpointing(GRPOConfig),
        report_to="none", logging_strategy="no", save_strategy="no", eval_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0, log_completions=False,
    )
    assert args.generation_batch_size == n, args.generation_batch_size
    lora = LoraConfig(r=s.lora_r, lora_alpha=s.lora_alpha, lora_dropout=0.0, target_modules=list(LORA_TARGETS),
                      task_type="CAUSAL_LM")
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])
    return GRPOTrainer(model=str(model), reward_funcs=[REWARDS[n_] for n_ in REWARD_NAMES], args=args,
                       train_dataset=dataset, peft_config=lora, callbacks=callbacks)


class TRLTimers:
    """Wraps a TRL trainer's `_generate` and `_calculate_rewards` (instance attributes) to record the
    seconds of each call and the rewards it returned: the generation / scoring split of its step."""

    def __init__(self, trainer) -> None:
        self.generate: list[float] = []
        self.reward: list[float] = []
        self.rewards: list[torch.Tensor] = []   # (rows, functions) per call
        gen, rew = trainer._generate, trainer._calculate_rewards

        def timed_generate(*a, **kw):
            t0 = time.perf_counter()
            try:
                return gen(*a, **kw)
            finally:
                self.generate.append(time.perf_counter() - t0)

        def timed_rewards(*a, **kw):
            t0 = time.perf_counter()
            try:
                out = rew(*a, **kw)
                self.rewards.append(out.detach().float().cpu())
                return out
            finally:
                self.reward.append(time.perf_counter() - t0)

        trainer._generate, trainer._calculate_rewards = timed_generate, timed_rewards


def trl_completion_lengths(trainer) -> torch.Tensor:
    """Completion lengths of TRL's last generated batch (all its buffered micro-batches)."""
    return torch.cat([b["completion_mask"].sum(-1).float() for b in trainer._buffered_inputs])


def peak_rss_mib() -> float:
    """This process's peak RSS (VmHWM, MiB): its own, not a parent's (see bench/step.py)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise OSError("no VmHWM in /proc/self/status")


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0: `echo 5 > /proc/self/clear_refs`), so a later
    peak_rss_mib() covers only what ran since. False where the kernel does not allow it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False
