"""Time to accuracy: grpolab's GRPO against TRL's GRPOTrainer, from the same warm start.

1. A tiny Llama (hidden 128, 4 layers, 4 heads, MLP 512, a BPE vocabulary of 512 trained on the
   task's text) is built with random weights and warm-started on the synthetic arithmetic task by
   grpolab's SFT (`grpolab sft`, --sft-steps steps, the demo's SFT settings): an HF checkpoint.
2. From that checkpoint, GRPO on the same task in grpolab and in TRL's GRPOTrainer, each in its own
   process, with the same hyperparameters: 16 prompts x 8 completions per step, at most 32 new tokens
   (a completion ends at EOS), temperature 1, reward `gsm8k_accuracy` (the very same function on
   both sides), beta 0.04 (each holds a frozen reference), the GRPO loss (ours
   `algorithm.preset=grpo`, TRL `loss_type="grpo"`), epsilon 0.2, one update per batch, AdamW
   lr 1e-4 betas (0.9, 0.999), no weight decay, constant LR without warm-up, grad-norm clip 1.0,
   fp32, 2 threads, --steps steps.
3. Every --eval-every steps, the same evaluator scores each side's current weights: greedy accuracy
   on --eval-n held-out problems (`grpolab.eval.evaluate` with k=1, grpolab's engine on both models,
   so the evaluation is identical and is not part of either side's clock).

Clock: each side's training seconds, evaluations excluded: ours, the sum of `train_step()` calls;
TRL, the sum of its steps, each from `on_step_begin` to `on_step_end` (generation, rewards,
reference pass, loss, backward, optimizer). Model loading is outside both.

Result: one JSON line (both curves, TRL's final accuracy, the seconds each side needed to reach it,
their ratio) and a plot of held-out greedy accuracy against training seconds (--plot).
"Reached" = the first evaluation at or above TRL's final accuracy.

    .venv/bin/python bench/race.py [--steps 60] [--sft-steps 600] [--plot docs/race.png]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

P, G, NEW, LR, BETA, THREADS, SEED = 16, 8, 32, 1e-4, 0.04, 2, 0


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def warm_start(work: Path, sft_steps: int) -> Path:
    """The tiny Llama, SFT'd by grpolab on the arithmetic task; returns its HF checkpoint dir."""
    from grpolab.data.tasks import arithmetic
    from grpolab.models.tiny_hf import save_tiny_model
    texts = [r["prompt"] + " " + r["answer"] for r in arithmetic.generate("train", 2000, seed=1)]
    init = save_tiny_model(work / "init", texts=texts, vocab_size=512, hidden=128, layers=4, heads=4,
                           intermediate=512)
    run = work / "sft"
    cmd = [sys.executable, "-m", "grpolab", "sft", f"model.name_or_path={init}", f"sft.steps={sft_steps}",
           f"train.output_dir={run}", f"train.threads={THREADS}", f"train.seed={SEED}", "log.level=quiet"]
    subprocess.run(cmd, check=True, stdout=sys.stderr)
    ckpts = sorted((run / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    return ckpts[-1]


def eval_rows(n: int) -> list[dict]:
    from grpolab.data.tasks import arithmetic
    return arithmetic.generate("test", n, seed=0)


def greedy_accuracy(hf_model, tok, rows: list[dict]) -> float:
    """The shared evaluator: grpolab's engine, greedy, on a Hugging Face model's current weights."""
    import torch

    from grpolab.eval import evaluate
    from grpolab.models.hf import HFPolicy
    was_training = hf_model.training
    hf_model.eval()
    with torch.inference_mode():
        acc = evaluate(HFPolicy(hf_model), tok, rows, k=1, max_new_tokens=NEW)["greedy_accuracy"]
    hf_model.train(was_training)
    return acc


def run_ours(ckpt: Path, steps: int, every: int, n_eval: int) -> list[dict]:
    import torch

    from grpolab.config import config_from_dict
    from grpolab.logging.console import Console
    from grpolab.pipeline import build_trainer
    with tempfile.TemporaryDirectory() as tmp:
        cfg = config_from_dict({
            "model": {"name_or_path": str(ckpt), "dtype": "float32", "device": "cpu"},
            "algorithm": {"preset": "grpo", "beta": BETA, "epsilon": 0.2, "num_iterations": 1},
            "rollout": {"prompts_per_step": P, "num_generations": G, "max_new_tokens": NEW,
                        "temperature": 1.0, "top_k": 0, "top_p": 1.0},
            "reward": {"functions": ["gsm8k_accuracy"]},
            "optim": {"lr": LR, "beta1": 0.9, "beta2": 0.999, "weight_decay": 0.0, "warmup_steps": 0,
                      "lr_schedule": "constant", "max_grad_norm": 1.0},
            "train": {"max_steps": steps, "seed": SEED, "threads": THREADS, "output_dir": tmp},
            "log": {"level": "quiet", "samples_every": 0},
        })
        trainer = build_trainer(cfg, Path(tmp), Console(stream=sys.stderr, level="quiet"))
        rows = eval_rows(n_eval)
        curve = [{"step": 0, "train_s": 0.0, "greedy": greedy_accuracy(trainer.model.hf, trainer.tok, rows)}]
        train_s = 0.0
        for step in range(1, steps + 1):
            t = time.perf_counter()
            trainer.train_step()
            train_s += time.perf_counter() - t
            if step % every == 0 or step == steps:
                curve.append({"step": step, "train_s": round(train_s, 2),
                              "greedy": greedy_accuracy(trainer.model.hf, trainer.tok, rows)})
                log(f"ours  step {step:3d}  {train_s:7.1f} s  greedy {curve[-1]['greedy']:.3f}")
        assert torch.get_num_threads() == THREADS
    return curve


def run_trl(ckpt: Path, steps: int, every: int, n_eval: int) -> list[dict]:
    import dataclasses

    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from grpolab.config import config_from_dict
    from grpolab.models.hf import load_hf
    from grpolab.pipeline import load_data
    from grpolab.rewards.answers import gsm8k_accuracy
    torch.set_num_threads(THREADS)
    train_rows, _ = load_data(config_from_dict({}))   # the task's training problems, as our trainer reads them
    _, tok = load_hf(str(ckpt))                         # our tokenizer wrapper, for the shared evaluator
    rows = eval_rows(n_eval)
    curve: list[dict] = []
    clock = {"train_s": 0.0, "t": 0.0}

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            assert torch.get_num_threads() == THREADS
            clock["t"] = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, **kw):
            clock["train_s"] += time.perf_counter() - clock["t"]
            step = state.global_step
            if step % every == 0 or step == steps:
                curve.append({"step": step, "train_s": round(clock["train_s"], 2),
                              "greedy": greedy_accuracy(model, tok, rows)})
                log(f"TRL   step {step:3d}  {clock['train_s']:7.1f} s  greedy {curve[-1]['greedy']:.3f}")

    names = {f.name for f in dataclasses.fields(GRPOConfig)}
    no_ckpt = {"gradient_checkpointing": False, **({"activation_checkpointing": False}
                                                   if "activation_checkpointing" in names else {})}
    with tempfile.TemporaryDirectory() as tmp:
        args = GRPOConfig(
            output_dir=tmp, max_steps=steps, seed=SEED, per_device_train_batch_size=P * G,
            gradient_accumulation_steps=1, num_generations=G, generation_batch_size=P * G, num_iterations=1,
            max_completion_length=NEW, temperature=1.0, top_p=1.0, top_k=0, beta=BETA, epsilon=0.2,
            loss_type="grpo", scale_rewards="group", learning_rate=LR, lr_scheduler_type="constant",
            warmup_steps=0, optim="adamw_torch", adam_beta1=0.9, adam_beta2=0.999, weight_decay=0.0,
            max_grad_norm=1.0, model_init_kwargs={"dtype": "float32"}, bf16=False, fp16=False, use_cpu=True,
            use_vllm=False, report_to="none", logging_strategy="no", save_strategy="no", eval_strategy="no",
            disable_tqdm=True, dataloader_num_workers=0, log_completions=False, **no_ckpt)
        dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in train_rows])
        trainer = GRPOTrainer(model=str(ckpt), reward_funcs=[gsm8k_accuracy], args=args, train_dataset=dataset,
                              callbacks=[Clock()])
        curve.append({"step": 0, "train_s": 0.0, "greedy": greedy_accuracy(trainer.model, tok, rows)})
        torch.set_num_threads(THREADS)
        trainer.train()
    return curve


def reached(curve: list[dict], target: float) -> float | None:
    """Training seconds at the first evaluation at or above `target`."""
    return next((c["train_s"] for c in curve if c["greedy"] >= target - 1e-12), None)


def plot(ours: list[dict], trl: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for curve, label in ((ours, "grpolab"), (trl, "TRL GRPOTrainer")):
        ax.plot([c["train_s"] for c in curve], [c["greedy"] for c in curve], marker="o", label=label)
    ax.axhline(trl[-1]["greedy"], color="grey", lw=0.8, ls="--", label="TRL's final accuracy")
    ax.set_xlabel("training seconds (evaluations excluded)")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_title("GRPO from the same warm start, same hyperparameters")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--sft-steps", type=int, default=600)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--eval-n", type=int, default=200)
    ap.add_argument("--plot", type=Path, default=Path("docs/race.png"))
    ap.add_argument("--side", choices=("ours", "trl"), help=argparse.SUPPRESS)   # child process
    ap.add_argument("--ckpt", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args()
    import torch
    torch.set_num_threads(THREADS)
    if a.side:   # one side in a fresh process: neither pays for the other's memory or threads
        import contextlib
        stdout = sys.stdout
        with contextlib.redirect_stdout(sys.stderr):
            curve = (run_ours if a.side == "ours" else run_trl)(a.ckpt, a.steps, a.eval_every, a.eval_n)
        print(json.dumps(curve), file=stdout, flush=True)
        return
    import trl
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        log(f"warm start: grpolab sft, {a.sft_steps} steps ...")
        ckpt = warm_start(Path(d), a.sft_steps)
        sft_s = time.perf_counter() - t0
        curves = {}
        for side in ("ours", "trl"):
            log(f"{side}: {a.steps} GRPO steps ...")
            out = subprocess.run([sys.executable, __file__, "--side", side, "--ckpt", str(ckpt), "--steps",
                                  str(a.steps), "--eval-every", str(a.eval_every), "--eval-n", str(a.eval_n)],
                                 stdout=subprocess.PIPE, text=True, check=True,
                                 env={**os.environ, "OMP_NUM_THREADS": str(THREADS)})
            curves[side] = json.loads(out.stdout.strip().splitlines()[-1])
    ours, theirs = curves["ours"], curves["trl"]
    target = theirs[-1]["greedy"]
    t_ours, t_trl_first = reached(ours, target), reached(theirs, target)
    res = {"bench": "race", "steps": a.steps, "prompts": P, "completions": G, "max_new_tokens": NEW, "lr": LR,
           "beta": BETA, "sft_steps": a.sft_steps, "eval_n": a.eval_n, "start_greedy": ours[0]["greedy"],
           "trl_final_greedy": target, "ours_final_greedy": ours[-1]["greedy"],
           "trl_train_s": theirs[-1]["train_s"], "ours_train_s": ours[-1]["train_s"],
           "ours_s_to_trl_final": t_ours, "trl_s_to_own_final_first": t_trl_first,
           "ratio_ours_over_trl_total": None if t_ours is None else round(t_ours / theirs[-1]["train_s"], 3),
           "ratio_ours_over_trl_first": None if t_ours is None or not t_trl_first else round(t_ours / t_trl_first, 3),
           "ours": ours, "trl": theirs, "sft_s": round(sft_s, 1), "wall_s": round(time.perf_counter() - t0, 1),
           "trl_version": trl.__version__, "torch": torch.__version__}
    plot(ours, theirs, a.plot)
    res["plot"] = str(a.plot)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
