"""A Python-API script that imports torch before grpolab (the docs' own example imports peft first): its job runs in
a child process started with grpolab's OpenMP settings (grpolab/api/child.py), while its reward functions and
callbacks run in the script's process, with the same bits as a script that imports grpolab first."""

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT

from grpolab.data.tasks import arithmetic
from grpolab.models.tiny_hf import save_tiny_model

# every script starts without the user's OpenMP settings, as a plain shell would
CLEAN = ("OMP_", "GOMP_", "KMP_")

SCRIPT = """
import json, os, sys
order, out, model, bad = sys.argv[1:5]
if order == "torch_first":
    import torch, grpolab
else:
    import grpolab, torch
from grpolab import GRPOConfig, GRPOTrainer

rows = [json.loads(line) for line in open(os.path.join(os.path.dirname(out), "rows.jsonl"))]
seen = {"reward_pids": set(), "children": set()}

def children() -> set:
    kids = set()
    for tid in os.listdir("/proc/self/task"):
        kids |= {int(p) for p in open(f"/proc/self/task/{tid}/children").read().split()}
    return kids

def reward_len(completions, **kwargs):
    seen["reward_pids"].add(os.getpid())
    if bad == "bad":
        raise ValueError("no score for this one")
    return [-abs(20 - len(c)) for c in completions]

class Watch:
    def on_step_end(self, args, state, control, **kwargs):
        for pid in children():
            cmd = open(f"/proc/{pid}/cmdline").read().split("\\0")
            env = dict(kv.split("=", 1) for kv in open(f"/proc/{pid}/environ").read().split("\\0") if "=" in kv)
            seen["children"].add((cmd[2], env.get("OMP_WAIT_POLICY"), env.get("GOMP_SPINCOUNT")))

args = GRPOConfig(output_dir=out, learning_rate=1e-4, per_device_train_batch_size=4, num_generations=4,
                  max_completion_length=8, max_steps=2, logging_steps=1, seed=0)
trainer = GRPOTrainer(model=model, reward_funcs=reward_len, args=args, train_dataset=rows, callbacks=[Watch()])
try:
    trainer.train()
    error = None
except Exception as e:
    error = f"{type(e).__name__}: {e}"
print(json.dumps({"missed": grpolab.determinism.OPENMP_MISSED, "own_pid": os.getpid(),
                  "reward_pids": sorted(seen["reward_pids"]), "children": sorted(seen["children"]),
                  "global_step": trainer.state.global_step, "error": error}))
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    rows = arithmetic.generate("train", 100, seed=0)
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", [r["prompt"] + "\n" + r["answer"] for r in rows],
                           vocab_size=300, hidden=32, layers=2, heads=2, intermediate=64)


def _start(tmp_path, tiny, order: str, bad: bool = False) -> tuple[subprocess.Popen, object]:
    run = tmp_path / f"{order}{'_bad' if bad else ''}"
    run.mkdir()
    (run / "rows.jsonl").write_text("".join(json.dumps({"prompt": r["prompt"]}) + "\n"
                                            for r in arithmetic.generate("train", 8, seed=3)))
    env = {k: v for k, v in os.environ.items() if not k.startswith(CLEAN)}
    cmd = [sys.executable, "-c", SCRIPT, order, str(run / "out"), str(tiny), "bad" if bad else "good"]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), run


def _result(p: subprocess.Popen) -> dict:
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def _metrics(run) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(("time/", "perf/"))}
            for line in open(run / "out" / "metrics.jsonl")]


@pytest.mark.slow
def test_torch_imported_first_trains_in_a_child_with_the_same_bits(tmp_path, tiny):
    procs = [_start(tmp_path, tiny, "torch_first"), _start(tmp_path, tiny, "grpolab_first"),
             _start(tmp_path, tiny, "torch_first", bad=True)]
    (late, late_run), (first, first_run), (bad, _) = [(_result(p), run) for p, run in procs]

    # grpolab first: the job in the script's process, no child
    assert not first["missed"] and first["children"] == [] and first["reward_pids"] == [first["own_pid"]]
    # torch first: the job in one child, started with grpolab's OpenMP settings; the reward function and the
    # callback in the script's process
    assert late["missed"] and late["reward_pids"] == [late["own_pid"]]
    assert len(late["children"]) == 1
    cmd, policy, spin = late["children"][0]
    assert "grpolab.api.child" in cmd and (policy, spin) != (None, None)
    # the same run, bit for bit
    assert late["global_step"] == first["global_step"] == 2 and late["error"] is None is first["error"]
    assert _metrics(late_run) == _metrics(first_run) and len(_metrics(late_run)) == 2
    a = (late_run / "out" / "checkpoints" / "step_2" / "model.safetensors").read_bytes()
    assert a == (first_run / "out" / "checkpoints" / "step_2" / "model.safetensors").read_bytes()
    # a reward that raises in the script's process: the job's one-line RewardError, naming the reward
    assert bad["error"].startswith("RewardError") and "reward_len" in bad["error"], bad["error"]
    assert "no score for this one" in bad["error"] and "\n" not in bad["error"]
