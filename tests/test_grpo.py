"""The RL loop end to end on the real built-in model and task (small settings)."""

import json

import pytest
from conftest import run_cli

from grpolab.config.load import load_config
from grpolab.jobs.common import setup_torch
from grpolab.jobs.inputs import load_data, load_policy
from grpolab.jobs.train import build_trainer
from grpolab.monitor.console import Console
from grpolab.train.grpo import GRPOTrainer
from grpolab.train.run import Run
from grpolab.train.schedule import lr_factor

# An easy setting: two-operation problems over small numbers, a small model, a short warm start.
EASY = ["data.min_ops=2", "data.max_ops=2", "data.max_operand=4", "data.max_value=8", "data.allow_mul=false",
        "data.train_size=2000", "data.test_size=50", "model.n_layer=2", "model.n_embd=64", "model.block_size=96",
        "sft.steps=300", "sft.batch_size=32", "sft.bare_fraction=0.5", "sft.bare_steps=0",
        "rollout.prompts_per_step=8",
        "rollout.num_generations=8", "rollout.max_new_tokens=16", "optim.lr=3e-4", "algorithm.beta=0.0",
        "eval.num_problems=50"]
TINY = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.block_size=128", "sft.steps=10",
        "sft.batch_size=8", "data.train_size=200", "data.test_size=20", "rollout.prompts_per_step=2",
        "rollout.num_generations=4", "rollout.max_new_tokens=12", "eval.num_problems=8", "eval.k=8"]


def make_trainer(out, *overrides, base=TINY):
    """A trainer built as `grpolab train` builds it (data, warm-started policy, prompt filter), in process."""
    cfg = load_config(None, base + [f"train.output_dir={out}", *overrides])
    setup_torch(cfg)
    return build_trainer(cfg, Run(cfg, GRPOTrainer.job), Console(quiet=True))


def _strip_timing(path):
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(("time/", "perf/"))}
            for line in open(path)]


@pytest.mark.slow
def test_short_grpo_run_raises_training_reward(tmp_path):
    cfg = load_config(None, EASY + ["train.max_steps=40", f"train.output_dir={tmp_path}"])
    setup_torch(cfg)
    train_rows, test_rows = load_data(cfg)
    model, tok = load_policy(cfg, train_rows, Console(quiet=True))
    trainer = GRPOTrainer(cfg, model, tok, train_rows, test_rows, tmp_path)
    history = trainer.train()
    first = sum(m["reward"] for m in history[:8]) / 8
    last = sum(m["reward"] for m in history[-20:]) / 20
    assert last > first + 0.12, (first, last)
    # the last step's length metric is the mean over its completions, counted here from the token ids
    lengths = [row.index(tok.eos_id) + 1 if tok.eos_id in row else 16
               for row in trainer.last_batch.gen.completion_ids.tolist()]
    assert history[-1]["completions/mean_length"] == pytest.approx(sum(lengths) / len(lengths), abs=1e-6)


def test_lr_schedule_warmup_then_decay():
    assert [lr_factor(s, 2, 10, "constant") for s in (0, 1, 2, 9)] == [0.5, 1.0, 1.0, 1.0]
    assert lr_factor(2, 2, 10, "linear") == 1.0 and lr_factor(6, 2, 10, "linear") == pytest.approx(0.5)
    assert lr_factor(6, 2, 10, "cosine") == pytest.approx(0.5) and lr_factor(10, 2, 10, "cosine") == pytest.approx(0)


@pytest.mark.slow
def test_train_cli_writes_run_dir_and_same_seed_gives_same_metrics(tmp_path):
    runs = []
    for name in ("a", "b"):
        out = tmp_path / name
        r = run_cli("train", *TINY, "train.max_steps=3", "train.save_every=2", "algorithm.num_iterations=2",
                    "algorithm.beta=0.04", "optim.micro_batch_size=3", f"train.output_dir={out}")
        assert r.returncode == 0, r.stderr
        assert "step 3/3" in r.stdout and "tok/s" in r.stdout and "ETA" in r.stdout
        runs.append(out)
    a = _strip_timing(runs[0] / "metrics.jsonl")
    assert len(a) == 3 and [m["step"] for m in a] == [1, 2, 3]
    for key in ("reward", "reward_std", "frac_reward_zero_std", "kl", "entropy", "loss", "grad_norm", "lr",
                "clip_ratio/region_mean", "completions/mean_length", "completions/clipped_ratio"):
        assert key in a[0], key
    assert a == _strip_timing(runs[1] / "metrics.jsonl")
    for m in map(json.loads, open(runs[0] / "metrics.jsonl")):
        assert {"time/generate", "time/update", "perf/gen_tokens_per_sec"} <= set(m)
    assert (runs[0] / "config.yaml").is_file()
    assert sorted(p.name for p in (runs[0] / "checkpoints").iterdir()) == ["step_2", "step_3"]


@pytest.mark.slow
def test_different_seed_gives_different_metrics(tmp_path):
    outs = []
    for seed in (0, 1):
        r = run_cli("train", *TINY, "train.max_steps=2", f"train.seed={seed}",
                    f"train.output_dir={tmp_path / str(seed)}")
        assert r.returncode == 0, r.stderr
        outs.append(_strip_timing(tmp_path / str(seed) / "metrics.jsonl"))
    assert outs[0] != outs[1]


@pytest.mark.slow
def test_demo_cli_writes_summary_and_eval_cli_reads_the_checkpoint(tmp_path):
    out = tmp_path / "demo"
    r = run_cli("demo", "--steps", "2", "--seed", "3", *TINY, f"train.output_dir={out}")   # as --out does
    assert r.returncode == 0, r.stderr
    summary = json.loads((out / "summary.json").read_text())
    for side in ("before", "after"):
        assert set(summary[side]) == {"greedy_accuracy", "pass@1", "pass@8"}
        # 8 problems: greedy accuracy counts whole problems
        assert summary[side]["greedy_accuracy"] * 8 == round(summary[side]["greedy_accuracy"] * 8)
    assert summary["steps"] == 2 and summary["seed"] == 3
    assert "greedy_accuracy" in r.stdout and "before" in r.stdout and "after" in r.stdout
    ckpt = out / "checkpoints" / "step_2"
    r = run_cli("eval", str(ckpt), "--out", str(tmp_path / "ev"), *TINY, "train.seed=3")
    assert r.returncode == 0, r.stderr
    res = json.loads((tmp_path / "ev" / "eval.json").read_text())
    assert {"greedy_accuracy", "pass@1", "pass@8", "maj@8"} <= set(res)
    # the demo's "after" is the final checkpoint's evaluation: the same numbers from `grpolab eval`
    assert summary["after"] == {k: res[k] for k in summary["after"]}
    recs = [json.loads(x) for x in (tmp_path / "ev" / "eval_samples.jsonl").read_text().splitlines()]
    assert len(recs) == 8
    # and its greedy accuracy is the share of problems whose greedy answer is right, counted here
    assert summary["after"]["greedy_accuracy"] == sum(r["greedy_correct"] for r in recs) / 8
