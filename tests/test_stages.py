"""The offline jobs (sft, dpo, distill), rejection sampling and multi-stage pipelines, end to end on the
built-in model: run directories, exact resume, the warm start being the sft job, bad inputs."""

import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import ROOT
from safetensors.torch import load_file

from grpolab.cli import main
from grpolab.config.load import load_config
from grpolab.jobs.sample import select_accepted, select_pair

TINY = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "data.train_size=300", "data.test_size=16",
        "eval.num_problems=16", "eval.k=2", "log.level=quiet"]
SFT = [*TINY, "sft.steps=40", "sft.batch_size=16", "sft.bare_steps=10", "sft.bare_fraction=0.5"]


def _cfg(out, *over):
    return load_config(None, [*TINY, f"train.output_dir={out}", *over])


def _lines(run_dir: Path) -> list[dict]:
    """metrics.jsonl without the wall-clock keys (time/*, perf/*)."""
    return [{k: v for k, v in json.loads(ln).items() if not k.startswith(("time/", "perf/"))}
            for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _weights(ckpt: Path) -> dict:
    return load_file(str(ckpt / "model.safetensors"))


def _same_weights(a: Path, b: Path) -> bool:
    wa, wb = _weights(a), _weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """A tiny built-in model after `grpolab sft` (the warm start recipe), every 20 steps checkpointed."""
    from grpolab.jobs.sft import run_sft
    out = tmp_path_factory.mktemp("sft") / "run"
    run_sft(_cfg(out, "sft.steps=40", "sft.batch_size=16", "sft.bare_steps=10", "train.save_every=20",
                 "train.keep_checkpoints=0"))
    return out


def test_sft_job_is_the_demo_warm_start(warm, tmp_path):
    from grpolab.jobs.common import setup_torch
    from grpolab.jobs.inputs import load_data, load_policy
    from grpolab.monitor.console import Console
    cfg = _cfg(tmp_path, "sft.steps=40", "sft.batch_size=16", "sft.bare_steps=10")
    setup_torch(cfg)
    model, _ = load_policy(cfg, load_data(cfg)[0], Console(quiet=True))
    sd = _weights(warm / "checkpoints" / "step_40")
    assert all(torch.equal(v, sd[k]) for k, v in model.state_dict().items())   # same code, same bits
    summary = json.loads((warm / "summary.json").read_text())
    assert summary["before"] == {}   # a fresh model is not evaluated
    assert summary["after"]["loss"] < _lines(warm)[0]["loss"] - 1.0   # held-out loss well below the first step's
    rows = _lines(warm)
    assert [r["step"] for r in rows] == list(range(1, 41)) and rows[-1]["epoch"] == pytest.approx(40 * 16 / 300)
    assert (warm / "report" / "loss.png").is_file() and not (warm / "report" / "reward.png").exists()


def test_sft_resume_replays_the_mixer_and_matches_the_uninterrupted_run(warm, tmp_path):
    """Resumed from the step-20 checkpoint (the bare-answer mixer starts at step 30 and draws from a
    seeded stream), steps 21-40 and the final weights equal the uninterrupted run's."""
    from grpolab.jobs.sft import run_sft
    run_sft(_cfg(tmp_path, "sft.steps=40", "sft.batch_size=16", "sft.bare_steps=10",
                 f"train.resume={warm / 'checkpoints' / 'step_20'}"))
    assert _lines(tmp_path) == _lines(warm)[20:]
    assert _same_weights(tmp_path / "checkpoints" / "step_40", warm / "checkpoints" / "step_40")


def test_sft_on_conversations_trains_the_assistant_tokens_only(tmp_path):
    from grpolab.jobs.sft import run_sft
    conv = [{"messages": [{"role": "system", "content": "Solve it."}, {"role": "user", "content": f"{a} + {b}?"},
                          {"role": "assistant", "content": f"#### {a + b}"}]} for a in range(10) for b in range(3)]
    path = tmp_path / "conv.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in conv))
    run_sft(_cfg(tmp_path / "run", f"sft.train_path={path}", "sft.steps=3", "sft.batch_size=4", "sft.packing=true"))
    rows = _lines(tmp_path / "run")
    # "#### N" + <|end|>: 6 to 8 tokens per row (N < 12), 4 rows a step; nothing of the system or user turns
    assert all(24 <= r["tokens"] <= 32 for r in rows), rows


def test_dpo_trains_on_self_generated_pairs_and_resumes_exactly(warm, tmp_path):
    from grpolab.jobs.dpo import run_dpo
    from grpolab.jobs.sample import run_sample
    ckpt = warm / "checkpoints" / "step_40"
    pairs = tmp_path / "pairs.jsonl"
    stats = run_sample(str(ckpt), _cfg(tmp_path, "reward.functions=[length]", "sample.pairs=true",
                                       "sample.num_prompts=40"), pairs)
    rows = [json.loads(x) for x in pairs.read_text().splitlines()]
    assert stats["pairs"] == len(rows) > 10
    assert all(r["chosen_reward"] > r["rejected_reward"] and r["chosen"] != r["rejected"] for r in rows)
    over = [f"model.init_from={ckpt}", f"dpo.pairs={pairs}", "dpo.steps=6", "dpo.batch_size=4", "dpo.lr=1e-3",
            "train.save_every=3", "train.keep_checkpoints=0"]
    run_dpo(_cfg(tmp_path / "a", *over))
    a = _lines(tmp_path / "a")
    assert a[-1]["rewards/margins"] > 0 and a[-1]["rewards/accuracies"] > 0.5   # chosen pulled above rejected
    assert set(a[0]) >= {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                         "logps/chosen", "logps/rejected"}
    assert (tmp_path / "a" / "report" / "preference.png").is_file()
    run_dpo(_cfg(tmp_path / "b", *over, f"train.resume={tmp_path / 'a' / 'checkpoints' / 'step_3'}"))
    assert _lines(tmp_path / "b") == a[3:]   # the reference came back from the checkpoint too
    assert _same_weights(tmp_path / "b" / "checkpoints" / "step_6", tmp_path / "a" / "checkpoints" / "step_6")


def test_on_policy_distillation_resumes_exactly(warm, tmp_path):
    from grpolab.jobs.distill import run_distill
    over = [f"distill.teacher={warm / 'checkpoints' / 'step_40'}", "distill.mode=on_policy", "distill.steps=4",
            "distill.batch_size=8", "train.save_every=2", "train.keep_checkpoints=0"]
    run_distill(_cfg(tmp_path / "a", *over))
    a = _lines(tmp_path / "a")
    assert all(r["kl"] > 0 for r in a)
    run_distill(_cfg(tmp_path / "b", *over, f"train.resume={tmp_path / 'a' / 'checkpoints' / 'step_2'}"))
    assert _lines(tmp_path / "b") == a[2:]   # the student's samples are keyed by draw: the same after a resume


def test_logit_distillation_lowers_the_kl_to_the_teacher(warm, tmp_path):
    from grpolab.jobs.distill import run_distill
    run_distill(_cfg(tmp_path, f"distill.teacher={warm / 'checkpoints' / 'step_40'}", "distill.steps=30",
                     "distill.batch_size=16", "model.n_embd=16"))
    kl = [r["kl"] for r in _lines(tmp_path)]
    assert sum(kl[-5:]) / 5 < 0.5 * sum(kl[:5]) / 5


def test_sample_selection_rules():
    texts = ["a", "b", "a", "c", " ", "d"]
    rewards = [1.0, 0.5, 1.0, 2.0, 3.0, float("nan")]
    assert select_accepted(texts, rewards, 1.0, 5) == [3, 0]   # best first, distinct, never empty or unscored
    assert select_accepted(texts, rewards, 1.0, 1) == [3]
    assert select_pair(texts, rewards) == (3, 1)                # best vs worst among the non-empty scored ones
    assert select_pair(["x", "y"], [1.0, 1.0]) is None           # a tie: no pair


def test_sample_writes_accepted_rows_deterministically(warm, tmp_path):
    ckpt = str(warm / "checkpoints" / "step_40")
    args = ["sample", ckpt, "--k", "4", *TINY, "reward.functions=[length]", "sample.num_prompts=20",
            "sample.min_reward=-0.5", "sample.max_per_prompt=2"]
    assert main([*args, "--out", str(tmp_path / "a.jsonl")]) == 0
    assert main([*args, "--out", str(tmp_path / "b.jsonl"), "sample.batch_size=3"]) == 0
    a = (tmp_path / "a.jsonl").read_text()
    assert a == (tmp_path / "b.jsonl").read_text()   # keyed samples: batching does not change them
    rows = [json.loads(x) for x in a.splitlines()]
    assert rows and all(r["reward"] >= -0.5 and r["completion"].strip() for r in rows)
    per_prompt = {}
    for r in rows:
        per_prompt.setdefault(r["prompt"], []).append(r)
    assert max(len(v) for v in per_prompt.values()) <= 2
    assert all(len({r["completion"] for r in v}) == len(v) for v in per_prompt.values())
    assert all(v == sorted(v, key=lambda r: -r["reward"]) for v in per_prompt.values())


@pytest.mark.parametrize("case", ["missing_completion", "empty_chosen", "missing_rejected", "vocab", "vocab_hf",
                                  "no_teacher"])
def test_bad_inputs_give_one_line_errors(case, warm, tmp_path, capsys):
    ckpt = str(warm / "checkpoints" / "step_40")
    f = tmp_path / "rows.jsonl"
    if case == "missing_completion":
        f.write_text(json.dumps({"prompt": "1+1?", "response": "2"}) + "\n")
        args, want = ["sft", f"sft.train_path={f}"], "row 1: no 'completion' column"
    elif case in ("empty_chosen", "missing_rejected"):
        good = {"prompt": "1+1?", "chosen": "#### 2", "rejected": "#### 3"}
        bad = {**good, "chosen": ""} if case == "empty_chosen" else {"prompt": "1+1?", "chosen": "#### 2"}
        f.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
        args = ["dpo", f"dpo.pairs={f}", f"model.init_from={ckpt}"]
        want = "row 2: 'chosen' is empty" if case == "empty_chosen" else "row 2: no 'rejected' column"
    elif case == "vocab":
        from grpolab.models.tiny_hf import save_tiny_model
        llama = save_tiny_model(tmp_path / "llama", vocab_size=300, hidden=32, layers=1, heads=2, intermediate=64)
        args, want = ["distill", f"distill.teacher={llama}", f"model.init_from={ckpt}"], "not the student's"
    elif case == "vocab_hf":   # two Hugging Face models whose tokenizers differ
        from grpolab.models.tiny_hf import save_tiny_model
        kw = dict(hidden=32, layers=1, heads=2, intermediate=64)
        teacher = save_tiny_model(tmp_path / "t", vocab_size=300, **kw)
        student = save_tiny_model(tmp_path / "s", ["other words entirely " * 3] * 20, vocab_size=280, **kw)
        args, want = ["distill", f"distill.teacher={teacher}", f"model.name_or_path={student}"], "vocabulary differs"
    else:
        args, want = ["distill", f"distill.teacher={tmp_path / 'nowhere'}"], "is not a checkpoint"
    capsys.readouterr()
    code = main([*args, *TINY, f"train.output_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and want in err, err
    assert not (tmp_path / "run" / "checkpoints").exists()   # nothing half-written


def test_train_refuses_a_pipeline_config(tmp_path, capsys):
    f = tmp_path / "p.yaml"
    f.write_text("stages:\n  - job: sft\n")
    assert main(["train", str(f)]) == 2
    assert "run it with `grpolab pipeline" in capsys.readouterr().err


def test_pipeline_rejects_an_unknown_job(tmp_path, capsys):
    f = tmp_path / "p.yaml"
    f.write_text("stages:\n  - job: sft\n  - job: rlhf\n")
    assert main(["pipeline", str(f)]) == 2
    assert "stages[2].job: 'rlhf' is not one of" in capsys.readouterr().err


# ---------------------------------------------------------------------------- the R1 pipeline

# configs/r1_pipeline.yaml shrunk by overrides (they apply to every stage): same five stages
SMALL_R1 = [*TINY, "sft.steps=30", "sft.epochs=0", "sft.bare_steps=0", "train.max_steps=2", "sample.num_prompts=0",
            "sample.min_reward=0", "rollout.prompts_per_step=4", "rollout.num_generations=4"]


def _pipeline(out: Path, *extra) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "grpolab", "pipeline", "configs/r1_pipeline.yaml", *SMALL_R1,
                             f"train.output_dir={out}", *extra], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_r1_pipeline_killed_in_its_third_stage_resumes_to_the_same_result(tmp_path):
    a = _pipeline(tmp_path / "a")
    b = _pipeline(tmp_path / "b")
    stage3 = tmp_path / "b" / "3-sample"
    while not stage3.is_dir() and b.poll() is None:
        time.sleep(0.005)
    b.send_signal(signal.SIGKILL)
    b.wait()
    assert not (stage3 / "stage.json").exists()   # it died inside stage 3
    assert (tmp_path / "b" / "2-train" / "stage.json").is_file()
    _, err = a.communicate(timeout=600)
    assert a.returncode == 0, err
    r = _pipeline(tmp_path / "b", "train.resume=auto")
    out, err = r.communicate(timeout=600)
    assert r.returncode == 0, err
    assert "stage 1/5 (sft): done, skipped" in out
    pa, pb = (json.loads((tmp_path / x / "pipeline.json").read_text())["stages"] for x in ("a", "b"))
    assert [s["job"] for s in pa] == ["sft", "train", "sample", "sft", "train"]
    assert [s.get("eval") for s in pa] == [s.get("eval") for s in pb]
    assert (tmp_path / "a" / "3-sample" / "samples.jsonl").read_text() == (stage3 / "samples.jsonl").read_text()
    assert _lines(tmp_path / "a" / "5-train") == _lines(tmp_path / "b" / "5-train")
    final = [Path(s["checkpoint"]) for s in (pa[-1], pb[-1])]
    assert _same_weights(*final)
    # stage 4 trained on stage 3's samples; the report shows every stage
    assert yaml.safe_load((tmp_path / "a" / "4-sft" / "config.yaml").read_text())["sft"]["train_path"] == \
        str(tmp_path / "a" / "3-sample" / "samples.jsonl")
    html = (tmp_path / "a" / "report.html").read_text()
    assert all(f"{n}-{j}" in html for n, j in enumerate(["sft", "train", "sample", "sft", "train"], start=1))


def test_sft_on_a_files_task_evaluates_accuracy_without_a_heldout_loss(tmp_path):
    """data.task=files: SFT rows from data.train_path (prompt/completion); the test file has prompts and
    answers but no completions, so accuracy is evaluated and there is no held-out loss."""
    from grpolab.jobs.sft import run_sft
    train = [{"prompt": f"{a} plus {b}?", "completion": f"{a}+{b}={a + b}\n#### {a + b}", "answer": str(a + b)}
             for a in range(12) for b in range(5)]
    test = [{"prompt": f"{a} plus {b}?", "answer": str(a + b)} for a, b in [(20, 1), (3, 30), (7, 7)]]
    for name, rows in (("train", train), ("test", test)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = run_sft(_cfg(tmp_path / "run", "data.task=files", f"data.train_path={tmp_path / 'train.jsonl'}",
                           f"data.test_path={tmp_path / 'test.jsonl'}", "sft.steps=3", "sft.batch_size=8"))
    assert set(summary["after"]) == {"greedy_accuracy", "pass@1"}
    assert [r["tokens"] for r in _lines(tmp_path / "run")] and summary["steps"] == 3


def test_a_diverging_sft_run_stops_with_one_line_and_no_checkpoint(tmp_path, capsys):
    code = main(["sft", *TINY, f"train.output_dir={tmp_path}", "sft.lr=1e30", "sft.max_grad_norm=0",
                 "train.max_bad_steps=0", "sft.steps=5", "sft.warmup_steps=0"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "non-finite loss" in err and "sft.lr" in err, err
    assert not (tmp_path / "checkpoints").exists()


# ---------------------------------------------------------------------------- the RLHF pipeline

def test_rlhf_pipeline_trains_a_reward_model_and_rl_uses_it_from_the_policy_before_it(tmp_path):
    """configs/rlhf_pipeline.yaml's stages, small, with pairs labelled by the length reward (a tiny
    model is never right): sft -> sample pairs -> rm -> grpo with reward 'rm:'. The rm stage starts
    from the SFT model and trains on the sampled pairs; GRPO starts from the SFT model, not the reward
    model, and is rewarded by the rm stage's final checkpoint alone."""
    from grpolab.jobs.pipeline import run_pipeline
    shipped = yaml.safe_load((ROOT / "configs" / "rlhf_pipeline.yaml").read_text())
    assert [s["job"] for s in shipped["stages"]] == ["sft", "sample", "rm", "train"]
    assert shipped["stages"][3]["reward"] == {"functions": ["rm:"]}
    conf = tmp_path / "rlhf.yaml"
    conf.write_text(yaml.safe_dump({"reward": {"functions": ["length"]}, "stages": [
        {"job": "sft", "sft": {"steps": 20}}, {"job": "sample", "sample": {"pairs": True, "k": 4, "num_prompts": 32}},
        {"job": "rm", "rm": {"steps": 6, "batch_size": 8, "eval_size": 4}},
        # `grpo`: the older name of `train`, still read (and kept as the stage directory's name)
        {"job": "grpo", "reward": {"functions": ["rm:"]}, "train": {"max_steps": 2}}]}))
    out = tmp_path / "rlhf"
    records = run_pipeline(conf, [*TINY, "rollout.prompts_per_step=4", "rollout.num_generations=4",
                                  f"train.output_dir={out}"])
    assert [r["job"] for r in records] == ["sft", "sample", "rm", "grpo"]
    sft_ckpt, pairs = records[0]["checkpoint"], records[1]["output"]
    rm_cfg = yaml.safe_load((out / "3-rm" / "config.yaml").read_text())
    assert rm_cfg["model"]["init_from"] == sft_ckpt and rm_cfg["rm"]["pairs"] == pairs
    assert records[2]["reward_model"] == str(out / "3-rm" / "checkpoints" / "step_6") and "checkpoint" not in records[2]
    assert 0 <= records[2]["rm_eval"]["accuracy"] <= 1
    grpo_cfg = yaml.safe_load((out / "4-grpo" / "config.yaml").read_text())
    assert grpo_cfg["model"]["init_from"] == sft_ckpt
    assert grpo_cfg["reward"]["functions"] == [f"rm:{records[2]['reward_model']}"]
    metrics = [json.loads(x) for x in (out / "4-grpo" / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(m["rewards/rm_step_6/mean"]) and m["rewards/rm_step_6/std"] > 0 for m in metrics)
    assert "reward model: held-out pair accuracy" in (out / "report.html").read_text()
