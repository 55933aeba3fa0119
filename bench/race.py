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
   on --eval-n held-out problems (`grpolab.train.evaluate.evaluate` with k=1, grpolab's engine on both models,
   so the evaluation is identical and is not part of either side's clock).

Clock: each side's training seconds, evaluations excluded: ours, the sum of `train_step()` calls;
TRL, the sum of its steps, each from `on_step_begin` to `on_step_end` (generation, rewards,
reference pass, loss, backward, optimizer). Model loading is outside both.

Result: one JSON line (both curves, TRL's final accuracy, the seconds each side needed to reach it,
their ratio) and a plot of held-out greedy accuracy against training seconds (--plot).
"Reached" = the first evaluation at or above TRL's final accuracy.

    .venv/bin/python bench/race.py [--steps 60] [--sft-steps 600] [--plot docs/race.png]

--model smollm2 (or a model directory): the race on a real pretrained model instead, in the setting of
bench/_smollm2.py (SmolLM2-135M-Instruct + LoRA r16, GSM8K-easy chat prompts, gsm8k_accuracy + format,
4 prompts x 8 completions x at most 128 new tokens, beta 0, lr 1e-4, micro-batches of 8 rows), no warm
start. Both trainers live in their own process for the whole race and take turns, one step at a time
(ours, TRL, then TRL, ours, ...; the idle one waits on a pipe), so background load falls on both alike.
Per step and side: seconds (generation / scoring / update), rewards, mean completion length, and the
process's peak RSS during training steps (VmHWM reset before each step; evaluations and loading are
outside it; the whole-process peak is reported too). Every --eval-every steps (and at the end) both
are evaluated by the same evaluator (grpolab's engine, greedy, --eval-n held-out problems of
data/gsm8k_easy/test.jsonl, outside the clocks); at step 0 both are the base model (LoRA's B starts at
zero), evaluated once. Needs TRL (see bench/step.py's docstring for its venv):

    bench/.venv-trl/bin/python bench/race.py --model smollm2 [--steps 6] [--eval-every 3] [--eval-n 32] \
        [--plot docs/race_smollm2.png]
"""

from __future__ import annotations

import argparse
import contextlib
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
    """The shared evaluator (bench/_smollm2.py's, at this race's NEW tokens)."""
    import _smollm2
    return _smollm2.greedy_accuracy(hf_model, tok, rows, NEW)


def run_ours(ckpt: Path, steps: int, every: int, n_eval: int) -> list[dict]:
    import torch

    from grpolab.config.load import config_from_dict
    from grpolab.jobs.train import build_trainer
    from grpolab.monitor.console import Console
    from grpolab.train.run import Run
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
        trainer = build_trainer(cfg, Run(cfg, "grpo"), Console(stream=sys.stderr, level="quiet"))
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

    from grpolab.config.load import config_from_dict
    from grpolab.jobs.inputs import load_data
    from grpolab.models.hf import load_hf
    from grpolab.rewards.accuracy import gsm8k_accuracy
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


# ---------------------------------------------------------------- the real-model race (--model)

def _serve(proto_in, proto_out, handlers: dict, until: str | None) -> str:
    """Answer the parent's commands (one per line) with one JSON line each, until `until` (returned,
    not answered here) or 'quit'."""
    while True:
        cmd = proto_in.readline().strip()
        if cmd == until or cmd in ("quit", ""):
            return cmd or "quit"
        proto_out.write(json.dumps(handlers[cmd]()) + "\n")
        proto_out.flush()


class _Peak:
    """Peak RSS during training steps (VmHWM reset before each step) and over the whole process."""

    def __init__(self) -> None:
        import _smollm2
        self.m, self.train, self.whole = _smollm2, 0.0, 0.0

    def before_step(self) -> None:
        self.whole = max(self.whole, self.m.peak_rss_mib())
        self.resettable = self.m.reset_peak_rss()

    def after_step(self) -> float:
        peak = self.m.peak_rss_mib()
        self.train = max(self.train, peak) if self.resettable else float("nan")
        self.whole = max(self.whole, peak)
        return peak

    def report(self) -> dict:
        return {"train_peak_rss_mib": round(self.train, 1),
                "process_peak_rss_mib": round(max(self.whole, self.m.peak_rss_mib()), 1)}


def real_side(side: str, model: Path, rows_file: Path, steps: int, eval_n: int, setting: dict) -> None:
    """One trainer in this process, driven step by step over stdin/stdout by `race_real`."""
    import _smollm2 as sm
    import torch
    s = sm.Setting(**setting)
    torch.set_num_threads(s.threads)
    proto_out = os.fdopen(os.dup(1), "w")   # the protocol; anything libraries print goes to stderr
    os.dup2(2, 1)
    proto_in = sys.stdin
    rows = json.loads(rows_file.read_text())
    peak = _Peak()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        if side == "ours":
            trainer = sm.build_ours(model, Path(tmp), s, steps)
            got = [(r["prompt"], r["answer"]) for r in sm.ours_draws(trainer, s, steps)]
            assert got == [(r["prompt"], r["answer"]) for r in rows], "ours would train on other prompts"
            tok, hf = trainer.tok, (lambda: trainer.model.hf)
        else:
            from transformers import TrainerCallback
            tok = sm.trl_tokenizer(model)
            state: dict = {}

            class Driver(TrainerCallback):
                def on_step_begin(self, args, st, control, **kw):
                    if _serve(proto_in, proto_out, handlers, until="step") == "quit":
                        raise SystemExit(0)
                    assert torch.get_num_threads() == s.threads
                    state["n_gen"], state["n_rew"] = len(timers.generate), len(timers.reward)
                    peak.before_step()
                    state["t"] = time.perf_counter()

                def on_step_end(self, args, st, control, **kw):
                    dt = time.perf_counter() - state["t"]
                    rss = peak.after_step()
                    gen = sum(timers.generate[state["n_gen"]:])
                    rew = sum(timers.reward[state["n_rew"]:])
                    r = timers.rewards[-1]   # (rows, functions), this step's generation
                    lengths = sm.trl_completion_lengths(trainer)
                    proto_out.write(json.dumps({
                        "step": st.global_step, "s": dt, "generate_s": gen, "reward_s": rew, "update_s": dt - gen - rew,
                        "reward": float(r.sum(-1).mean()),
                        **{f"reward/{n}": float(r[:, i].mean()) for i, n in enumerate(sm.REWARD_NAMES)},
                        "mean_length": float(lengths.mean()), "clipped": float((lengths >= s.max_new).float().mean()),
                        "step_peak_rss_mib": round(rss, 1)}) + "\n")
                    proto_out.flush()

            trainer = sm.build_trl(model, rows, Path(tmp), s, steps, [Driver()])
            timers = sm.TRLTimers(trainer)
            hf = lambda: trainer.model
        erows = sm.eval_rows(eval_n, model, s)

        def do_eval() -> dict:
            t = time.perf_counter()
            return {"greedy": sm.greedy_accuracy(hf(), tok, erows, s.max_new), "eval_s": time.perf_counter() - t}

        def do_step() -> dict:
            peak.before_step()
            t = time.perf_counter()
            m = trainer.train_step()
            dt = time.perf_counter() - t
            rss = peak.after_step()
            return {"step": m["step"], "s": dt, "generate_s": m["time/generate"], "reward_s": m["time/reward"],
                    "update_s": m["time/ref_and_advantages"] + m["time/update"], "reward": m["reward"],
                    **{f"reward/{n}": m[f"rewards/{n}/mean"] for n in sm.REWARD_NAMES},
                    "mean_length": m["completions/mean_length"], "clipped": m["completions/clipped_ratio"],
                    "step_peak_rss_mib": round(rss, 1)}

        handlers = {"eval": do_eval, "peak": peak.report, "step": do_step}
        proto_out.write(json.dumps({"ready": side, "load_s": time.perf_counter() - t0}) + "\n")
        proto_out.flush()
        if side == "trl":
            torch.set_num_threads(s.threads)
            trainer.train()   # steps happen in Driver's callbacks, on the parent's word
        _serve(proto_in, proto_out, handlers, until=None)


class _Child:
    def __init__(self, side: str, model: Path, rows_file: Path, steps: int, eval_n: int, setting: dict) -> None:
        self.side = side
        self.p = subprocess.Popen([sys.executable, __file__, "--side", side, "--model", str(model), "--rows",
                                   str(rows_file), "--steps", str(steps), "--eval-n", str(eval_n),
                                   "--setting", json.dumps(setting)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                  env={**os.environ, "OMP_NUM_THREADS": "2"})
        self.ready = self.read()

    def read(self) -> dict:
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.side} process ended early (exit {self.p.wait()}); see its stderr above")
        return json.loads(line)

    def ask(self, cmd: str) -> dict:
        self.p.stdin.write(cmd + "\n")
        self.p.stdin.flush()
        return self.read()

    def close(self) -> None:
        self.p.stdin.write("quit\n")
        self.p.stdin.flush()
        self.p.wait(timeout=300)


def _median(xs: list[float]) -> float:
    import statistics
    return round(statistics.median(xs), 2)


def race_real(model_arg: str, steps: int, every: int, eval_n: int, plot_path: Path, setting: dict) -> dict:
    """Both trainers alive in their own processes, stepping in turn; see the module docstring."""
    import dataclasses
    import platform

    import _smollm2 as sm
    import torch
    import transformers
    import trl
    s = sm.Setting(**setting)
    model = sm.resolve_model(model_arg)
    t0 = time.perf_counter()
    load0 = os.getloadavg()
    res: dict = {"bench": "race_real_model", "model": str(model), "setting": dataclasses.asdict(s),
                 "system_prompt": sm.SYSTEM, "rewards": list(sm.REWARD_NAMES), "steps": steps, "eval_n": eval_n}
    with tempfile.TemporaryDirectory() as d:
        rows_file = Path(d) / "rows.json"
        rows_file.write_text(json.dumps(sm.drawn_rows(s, steps, model)))
        log("loading both trainers (one process each) ...")
        kids = {side: _Child(side, model, rows_file, steps, eval_n, setting) for side in ("ours", "trl")}
        log(f"loaded: ours {kids['ours'].ready['load_s']:.1f} s, TRL {kids['trl'].ready['load_s']:.1f} s")
        log(f"step 0: the base model for both (LoRA's B starts at zero), eval on {eval_n} problems ...")
        e0 = kids["ours"].ask("eval")
        curves = {side: {"steps": [], "evals": [{"step": 0, "train_s": 0.0, "greedy": e0["greedy"]}]}
                  for side in kids}
        clock = {side: 0.0 for side in kids}
        for step in range(1, steps + 1):
            for side in (("ours", "trl") if step % 2 else ("trl", "ours")):
                r = kids[side].ask("step")
                clock[side] += r["s"]
                r["train_s"] = round(clock[side], 2)
                curves[side]["steps"].append(r)
                log(f"{side:4s} step {step:3d}  {r['s']:7.1f} s (gen {r['generate_s']:.1f}, score {r['reward_s']:.2f}, "
                    f"update {r['update_s']:.1f})  reward {r['reward']:.3f}  len {r['mean_length']:.0f}  "
                    f"rss {r['step_peak_rss_mib']:.0f} MiB")
            if step % every == 0 or step == steps:
                for side, kid in kids.items():
                    e = kid.ask("eval")
                    curves[side]["evals"].append({"step": step, "train_s": round(clock[side], 2),
                                                  "greedy": e["greedy"]})
                    log(f"{side:4s} eval at step {step}: greedy {e['greedy']:.3f} ({e['eval_s']:.0f} s)")
        for side, kid in kids.items():
            curves[side].update(kid.ask("peak"))
            kid.close()
    for side, c in curves.items():
        st = c["steps"]
        c["median_s"] = {k: _median([x[k] for x in st]) for k in ("s", "generate_s", "reward_s", "update_s")}
        c["mean_length"] = round(sum(x["mean_length"] for x in st) / len(st), 1)
        c["generated_tokens"] = round(sum(x["mean_length"] for x in st) * s.prompts * s.completions)
        c["gen_tokens_per_s"] = round(c["generated_tokens"] / sum(x["generate_s"] for x in st), 1)
        c["load_s"] = round(kids[side].ready["load_s"], 1)
    o, t = curves["ours"], curves["trl"]
    pairs = [b["s"] / a["s"] for a, b in zip(o["steps"], t["steps"])]
    res.update({
        "ratio_trl_over_ours_median_step": round(t["median_s"]["s"] / o["median_s"]["s"], 2),
        "ratio_trl_over_ours_total": round(t["steps"][-1]["train_s"] / o["steps"][-1]["train_s"], 2),
        "ratio_trl_over_ours_per_step": [round(x, 2) for x in pairs],
        "ratio_trl_over_ours_generate": round(t["median_s"]["generate_s"] / o["median_s"]["generate_s"], 2),
        "ratio_trl_over_ours_update": round(t["median_s"]["update_s"] / o["median_s"]["update_s"], 2),
        "rss_ours_over_trl": round(o["train_peak_rss_mib"] / t["train_peak_rss_mib"], 2),
        "ours": o, "trl": t, "wall_s": round(time.perf_counter() - t0, 1),
        "loadavg_1m_start_end": [round(load0[0], 2), round(os.getloadavg()[0], 2)],
        "machine": f"{platform.machine()}, {os.cpu_count()} cores", "threads": s.threads,
        "trl_version": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__})
    plot_real(o, t, s, plot_path, res)
    res["plot"] = str(plot_path)
    return res


def plot_real(o: dict, t: dict, s, path: Path, res: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    sides = ((o, "grpolab", "C0"), (t, "TRL GRPOTrainer", "C1"))
    for c, label, color in sides:
        axes[0].plot([x["train_s"] for x in c["steps"]], [x["reward"] for x in c["steps"]], marker="o", color=color,
                     label=label)
        axes[1].plot([e["train_s"] for e in c["evals"]], [e["greedy"] for e in c["evals"]], marker="s", color=color,
                     label=label)
    axes[0].set(xlabel="training seconds", ylabel="mean reward (accuracy + format)", title="reward per step")
    axes[1].set(xlabel="training seconds (evaluations excluded)", ylabel=f"greedy accuracy, {res['eval_n']} held out",
                title="held-out accuracy")
    parts = (("generate_s", "generation"), ("reward_s", "scoring"), ("update_s", "update"))
    for i, (c, label, _) in enumerate(sides):
        bottom = 0.0
        for j, (k, name) in enumerate(parts):
            v = c["median_s"][k]
            axes[2].bar(i, v, bottom=bottom, color=f"C{j + 2}", label=name if i == 0 else None)
            bottom += v
        axes[2].text(i, bottom, f"median step {c['median_s']['s']:.0f} s\n"
                     f"peak RSS {c['train_peak_rss_mib'] / 1024:.1f} GiB", ha="center", va="bottom", fontsize=8)
    axes[2].set_xticks([0, 1], ["grpolab", "TRL"])
    axes[2].set(ylabel="seconds (median of each part)", title="where a step's time goes")
    axes[2].margins(y=0.2)
    for ax in axes:
        ax.legend(fontsize=8)
    fig.suptitle(f"SmolLM2-135M-Instruct + LoRA r{s.lora_r}, GSM8K-easy, {s.prompts}x{s.completions} completions "
                 f"<= {s.max_new} tokens, 2-core CPU shared with other jobs (load {res['loadavg_1m_start_end']})",
                 fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, help="GRPO steps per side (default 60; --model: 6)")
    ap.add_argument("--sft-steps", type=int, default=600)
    ap.add_argument("--eval-every", type=int, help="steps between evaluations (default 5; --model: 3)")
    ap.add_argument("--eval-n", type=int, help="held-out problems per evaluation (default 200; --model: 32)")
    ap.add_argument("--plot", type=Path, default=None, help="default docs/race.png (--model: docs/race_smollm2.png)")
    ap.add_argument("--model", help="race on a real model: 'smollm2' or a model directory (see above)")
    ap.add_argument("--side", choices=("ours", "trl"), help=argparse.SUPPRESS)   # child process
    ap.add_argument("--ckpt", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--rows", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--setting", type=json.loads, default={}, help=argparse.SUPPRESS)
    ap.add_argument("--prompts", type=int, help="--model: prompts per step (default 4)")
    ap.add_argument("--completions", type=int, help="--model: completions per prompt (default 8)")
    ap.add_argument("--max-new", type=int, help="--model: new tokens at most (default 128)")
    a = ap.parse_args()
    import torch
    torch.set_num_threads(THREADS)
    sys.path.insert(0, str(Path(__file__).resolve().parent))   # bench/_smollm2.py
    defaults = (6, 3, 32) if a.model else (60, 5, 200)
    a.steps, a.eval_every, a.eval_n = (v if v is not None else dv for v, dv in
                                       zip((a.steps, a.eval_every, a.eval_n), defaults))
    if min(a.steps, a.eval_every, a.eval_n) < 1:
        ap.error("--steps, --eval-every and --eval-n must be >= 1")
    if a.model:
        if a.side:   # one trainer of the real-model race, driven over stdin/stdout
            real_side(a.side, Path(a.model), a.rows, a.steps, a.eval_n, a.setting)
            return
        setting = {k: v for k, v in (("prompts", a.prompts), ("completions", a.completions), ("max_new", a.max_new))
                   if v is not None}
        with contextlib.redirect_stdout(sys.stderr):
            res = race_real(a.model, a.steps, a.eval_every, a.eval_n, a.plot or Path("docs/race_smollm2.png"),
                            setting)
        print(json.dumps(res), flush=True)
        return
    a.plot = a.plot or Path("docs/race.png")
    if a.side:   # one side in a fresh process: neither pays for the other's memory or threads
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
