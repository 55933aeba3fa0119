"""Data-parallel training on CPU with gloo and 2 local ranks: an N-rank step is the 1-process step."""

import json
import subprocess
import sys

import dist_cases
import pytest
import torch
from conftest import ROOT, run_cli, wait_for_rows
from test_grpo import TINY


def _torchrun(*args, nproc=2, timeout=300):
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc_per_node={nproc}", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def split_and_whole(tmp_path_factory):
    """The same rollouts and rewards, updated once split over 2 ranks and once in this process."""
    d = tmp_path_factory.mktemp("dist_cases")
    dist_cases.make(d)
    res = _torchrun(str(ROOT / "tests" / "dist_cases.py"), "run", str(d), str(d / "two.pt"))
    assert res.returncode == 0, res.stderr[-3000:]
    return torch.load(d / "two.pt", weights_only=False), dist_cases.run(d, None), \
        torch.load(d / "rollouts.pt", weights_only=False)["policy"]


@pytest.mark.slow
def test_update_over_two_ranks_equals_one_process(split_and_whole):
    two, one, start = split_and_whole
    assert set(two) == set(one) == set(dist_cases.CASES) and len(one) == 67
    for case in dist_cases.CASES:
        a, b = one[case], two[case]
        # advantages from every rank's rewards: rank 0's rows are the first half of the 1-process batch
        adv = b["advantages"]
        assert (adv - a["advantages"][:len(adv)]).abs().max() <= 1e-6 and adv.abs().max() > 0, case
        assert (a["kl_in_reward"] is None) == (b["kl_in_reward"] is None), case
        if a["kl_in_reward"] is not None:
            assert b["kl_in_reward"] == pytest.approx(a["kl_in_reward"], abs=1e-6), case
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-6), case
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], abs=1e-6), case
        assert (a["kl"] is None) == (b["kl"] is None) and (a["kl"] is None or abs(a["kl"] - b["kl"]) < 1e-6), case
        assert set(a["grads"]) == set(b["grads"])
        for name, g in a["grads"].items():
            # the gradient the optimizer used: the full batch's, summed over the ranks' shares
            assert (b["grads"][name] - g).abs().max() <= 1e-6, (case, name)
            # the update itself, on the entries with a gradient above float noise: AdamW's first step,
            # lr * g / (|g| + 1e-8), turns 1e-8-level rounding of a near-zero gradient into a visible step
            big = g.abs() > 1e-5
            moved = (one[case]["params"][name] - start[name])[big]
            assert moved.abs().max() > 0, (case, name)
            assert (two[case]["params"][name] - one[case]["params"][name])[big].abs().max() <= 1e-6, (case, name)
    # the cases are not all one case: the losses differ
    assert len({round(one[c]["loss"], 6) for c in dist_cases.CASES}) > 10


@pytest.mark.slow
def test_fsdp_update_equals_ddp_and_one_process_on_a_tiny_llama(tmp_path):
    """train.strategy=fsdp over 2 ranks, a tiny Hugging Face Llama with tied embeddings: the same
    gradients and update as ddp and as one process; the gathered checkpoint is an ordinary
    Hugging Face model directory."""
    dist_cases.make(tmp_path, hf=True)
    runs = {}
    for strategy in ("ddp", "fsdp"):
        res = _torchrun(str(ROOT / "tests" / "dist_cases.py"), "run", str(tmp_path), str(tmp_path / f"{strategy}.pt"),
                        strategy)
        assert res.returncode == 0, res.stderr[-3000:]
        runs[strategy] = torch.load(tmp_path / f"{strategy}.pt", weights_only=False)
    one = dist_cases.run(tmp_path, None)
    start = torch.load(tmp_path / "rollouts.pt", weights_only=False)["policy"]
    assert set(runs["fsdp"]) == set(runs["ddp"]) == set(one) == set(dist_cases.HF_CASES)
    for case in dist_cases.HF_CASES:
        a, b, f = one[case], runs["ddp"][case], runs["fsdp"][case]
        assert set(f["params"]) == set(a["params"]) and set(f["grads"]) == set(a["grads"])
        for name in a["params"]:
            assert (a["params"][name] - start[name]).abs().max() > 0, (case, name)            # the step moved it
            # the update on the entries with a gradient above float noise, as in the test above (AdamW's first
            # step turns 1e-8-level rounding of a near-zero gradient into a visible step)
            g = a["grads"]["hf.model.embed_tokens.weight" if name == "hf.lm_head.weight" else name]   # tied
            big = g.abs() > 1e-5
            assert (f["params"][name] - b["params"][name])[big].abs().max() <= 1e-5, (case, name)  # fsdp == ddp
            assert (f["params"][name] - a["params"][name])[big].abs().max() <= 1e-5, (case, name)  # == one process
        for name in a["grads"]:
            assert (f["grads"][name] - a["grads"][name]).abs().max() <= 1e-6, (case, name)
        assert f["loss"] == pytest.approx(a["loss"], abs=1e-6) and f["grad_norm"] == pytest.approx(b["grad_norm"],
                                                                                                  abs=1e-6), case
    from transformers import AutoModelForCausalLM
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "checkpoints" / "step_0"))
    last = one[dist_cases.HF_CASES[-1]]["params"]
    state = loaded.state_dict()
    assert {f"hf.{k}" for k in state} == set(last)
    for k, v in state.items():
        assert (v - last[f"hf.{k}"]).abs().max() <= 1e-5, k


@pytest.mark.slow
def test_fsdp_on_the_builtin_gpt_equals_one_process(tmp_path):
    """train.strategy=fsdp on the built-in GPT, whose blocks return a view (addmm(...).view): the
    gradients and the update are one process's, so torch's "returned a view tensor ... wrong
    gradients" warning is a false alarm here, and no rank prints it (grpolab/sharding.py)."""
    dist_cases.make(tmp_path)
    res = _torchrun(str(ROOT / "tests" / "dist_cases.py"), "run", str(tmp_path), str(tmp_path / "fsdp.pt"), "fsdp")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "view tensor" not in res.stderr, res.stderr[-3000:]
    f = torch.load(tmp_path / "fsdp.pt", weights_only=False)
    one = dist_cases.run(tmp_path, None, cases=dist_cases.HF_CASES)
    start = torch.load(tmp_path / "rollouts.pt", weights_only=False)["policy"]
    assert set(f) == set(one) == set(dist_cases.HF_CASES)
    for case in dist_cases.HF_CASES:
        a, b = one[case], f[case]
        assert set(b["grads"]) == set(a["grads"]) and len(a["grads"]) >= 6
        for name, g in a["grads"].items():
            assert g.abs().max() > 0 and (b["grads"][name] - g).abs().max() <= 1e-6, (case, name)
        for name in a["params"]:
            assert (a["params"][name] - start[name]).abs().max() > 0, (case, name)
            assert (b["params"][name] - a["params"][name]).abs().max() <= 1e-5, (case, name)
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-6), case


def _train_here(*overrides):
    """`grpolab train OVERRIDES` in this process, as the CLI builds it (without the final eval)."""
    from grpolab.config.load import load_config
    from grpolab.jobs.common import setup_torch
    from grpolab.jobs.train import build_trainer
    from grpolab.monitor.console import Console
    from grpolab.train.run import Run
    cfg = load_config(None, list(overrides))
    setup_torch(cfg)
    build_trainer(cfg, Run(cfg, "grpo"), Console(quiet=True)).train()


@pytest.mark.slow
def test_fsdp_run_resumes_across_world_sizes(tmp_path):
    """A tiny Llama trained for 3 steps in one process, and the same run as 1 process (step 1), then
    2 fsdp ranks (step 2), then 1 process (step 3), each resuming the other's checkpoint: the same
    rewards, losses, grad norms and KL (the reference moves to the policy every 2 steps)."""
    from grpolab.models.tiny_hf import save_tiny_model
    llama = save_tiny_model(tmp_path / "llama", vocab_size=300, hidden=32, layers=2, heads=2, intermediate=64)
    args = [f"model.name_or_path={llama}", "rollout.prompts_per_step=4", "rollout.num_generations=4",
            "rollout.max_new_tokens=16", "eval.num_problems=8", "eval.k=2", "train.threads=1", "train.save_every=1",
            "reward.functions=[length]", "algorithm.beta=0.04", "optim.lr=1e-3",
            "algorithm.ref_sync_steps=2", "algorithm.ref_sync_alpha=0.5"]   # the sharded reference moves at step 2
    _train_here(*args, "train.max_steps=3", f"train.output_dir={tmp_path / 'one'}")
    out = tmp_path / "mixed"
    for steps, nproc in ((1, 1), (2, 2), (3, 1)):
        mixed = [*args, f"train.max_steps={steps}", "train.strategy=fsdp", "train.resume=auto",
                 f"train.output_dir={out}"]
        if nproc == 1:
            _train_here(*mixed)
        else:
            res = run_cli("train", "--nproc", str(nproc), *mixed, timeout=600)
            assert res.returncode == 0, res.stderr[-3000:]
    one, mixed = ([json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
                  for d in (tmp_path / "one", out))
    assert [m["step"] for m in mixed] == [1, 2, 3]
    for a, b in zip(one, mixed):
        for key in ("reward", "loss", "grad_norm", "kl", "entropy"):
            assert b[key] == pytest.approx(a[key], abs=1e-5), (a["step"], key)
    assert one[-1]["kl"] > 0 and one[-1]["grad_norm"] > 0


def _small(out, *extra):
    return [*TINY, "rollout.prompts_per_step=4", "train.max_steps=2", "train.save_every=1", "eval.num_problems=8",
            "eval.k=2", f"train.output_dir={out}", *extra]


DEMO_SMALL = ["sft.steps=10", "sft.bare_steps=0", "train.max_steps=2", "eval.num_problems=16", "eval.k=4",
              "log.samples_every=1", "log.samples_per_step=64", "train.threads=1"]


@pytest.mark.slow
def test_demo_config_on_two_ranks_matches_one_process(tmp_path):
    """configs/demo.yaml for 2 steps, in one process and on 2 ranks, same seed: the same completions
    at step 1 (rank 0 holds the first 8 of the 16 prompts), and the same rewards, losses and grad
    norms over the 2 steps."""
    runs = {}
    for name, extra in [("one", []), ("two", ["--nproc", "2"])]:
        out = tmp_path / name
        res = run_cli("train", "configs/demo.yaml", *extra, *DEMO_SMALL, f"train.output_dir={out}", timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
        assert ("2 ranks (gloo)" in res.stdout + res.stderr) == (name == "two")
        runs[name] = out
    samples = {n: [json.loads(x) for x in (o / "samples.jsonl").read_text().splitlines()] for n, o in runs.items()}
    first = [s["completion"] for s in samples["one"] if s["step"] == 1]
    assert [s["completion"] for s in samples["two"] if s["step"] == 1] == first and len(first) == 64
    assert len(set(first)) > 16
    metrics = {n: [json.loads(x) for x in (o / "metrics.jsonl").read_text().splitlines()] for n, o in runs.items()}
    assert [m["step"] for m in metrics["two"]] == [1, 2]             # written once, by rank 0
    for a, b in zip(metrics["one"], metrics["two"]):
        for key in ("reward", "reward_std", "loss", "grad_norm", "entropy", "completions/mean_length",
                    "rewards/gsm8k_accuracy/mean"):
            assert b[key] == pytest.approx(a[key], abs=1e-4), (a["step"], key)
    # the split evaluation gives the 1-process numbers: every problem has the same samples either way
    assert json.loads((runs["two"] / "eval.json").read_text()) == \
        pytest.approx(json.loads((runs["one"] / "eval.json").read_text()), abs=1e-9)
    # rank 0's checkpoint: the weights of the 1-process run
    from grpolab.models.checkpoint import load_model
    weights = {n: load_model(str(o / "checkpoints" / "step_2"))[0].state_dict() for n, o in runs.items()}
    assert max(float((weights["two"][k] - v).abs().max()) for k, v in weights["one"].items()) <= 1e-6


def test_prompts_must_split_evenly_over_ranks(tmp_path):
    res = run_cli("train", "--nproc", "2", *_small(tmp_path / "run", "rollout.prompts_per_step=3"), timeout=600)
    assert res.returncode != 0
    assert "rollout.prompts_per_step: 3 prompts cannot be split evenly over 2 ranks; give a multiple of 2" \
        in res.stderr


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_launchers_as_two_machines(tmp_path):
    """torchrun --nnodes 2 --nproc_per_node 1 twice, rendezvous on 127.0.0.1: one run of 2 ranks."""
    port, out = _free_port(), tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
           "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=grpolab-test",
           "-m", "grpolab", "train", *_small(out, "train.threads=1", "sft.steps=5")]
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    assert "2 ranks (gloo)" in "".join(logs)
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def _start_long_run(out, rank=1):
    """A 2-rank run that would go on for hours, once it has written 3 steps; (launcher, `rank`'s pid)."""
    import os
    args = _small(out, "train.max_steps=100000", "sft.steps=5")
    # its own session: a signal to the process group reaches the launcher and the ranks, as Ctrl-C in a terminal
    launcher = subprocess.Popen([sys.executable, "-m", "grpolab.cli", "train", "--nproc", "2", *args], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    metrics = out / "metrics.jsonl"
    wait_for_rows(metrics, 3, timeout=120, poll=0.2)
    assert metrics.exists(), launcher.communicate(timeout=60)

    def rank_of(pid):
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            cmd = open(f"/proc/{pid}/cmdline").read().replace("\0", " ")
        except OSError:
            return None
        return next((int(e[5:]) for e in env if e.startswith(b"RANK=")), None) if str(out) in cmd else None
    pids = [int(p) for p in os.listdir("/proc") if p.isdigit() and rank_of(int(p)) == rank]
    assert len(pids) == 1, pids
    return launcher, pids[0]


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 1])
def test_signal_to_one_rank_stops_all_after_the_same_step(tmp_path, rank):
    import os
    import signal
    out = tmp_path / "run"
    launcher, pid = _start_long_run(out, rank)
    os.kill(pid, signal.SIGTERM)
    _, err = launcher.communicate(timeout=90)
    assert launcher.returncode == 130, err
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["step"]
    by = "SIGTERM" if rank == 0 else "a signal to another rank"
    assert err.strip().splitlines()[-1] == (f"grpolab: stopped by {by} after step {last}; "
                                            f"checkpoint saved, continue with train.resume=auto"), err
    assert (out / "checkpoints" / f"step_{last}").is_dir()


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGINT to the process group", "SIGTERM to the launcher"])
def test_signal_to_the_launcher_stops_every_rank_with_one_checkpoint(tmp_path, how):
    """Ctrl-C in the terminal (SIGINT to the launcher and the ranks) or a scheduler's SIGTERM to the
    launcher alone: every rank stops after the same step, rank 0 saves once, exit code 130."""
    import os
    import signal
    out = tmp_path / "run"
    launcher, _ = _start_long_run(out)
    if how.startswith("SIGINT"):
        os.killpg(launcher.pid, signal.SIGINT)
    else:
        os.kill(launcher.pid, signal.SIGTERM)
    _, err = launcher.communicate(timeout=90)
    assert launcher.returncode == 130, err
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["step"]
    assert err.strip().splitlines()[-1] == (f"grpolab: stopped by {how.split()[0]} after step {last}; "
                                            f"checkpoint saved, continue with train.resume=auto"), err
    # one checkpoint, of the last step written (save_every is 1): the stop saved it, complete
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert f"step_{last}" in ckpts and not [c for c in ckpts if not c.startswith("step_")], ckpts
    assert json.loads((out / "checkpoints" / f"step_{last}" / "trainer_state.json").read_text())["step"] == last


@pytest.mark.slow
def test_killed_rank_stops_the_run_and_one_process_resumes(tmp_path):
    import os
    import signal
    import time
    out = tmp_path / "run"
    metrics = out / "metrics.jsonl"
    launcher, rank1 = _start_long_run(out)
    killed = time.time()
    os.kill(rank1, signal.SIGKILL)
    _, err = launcher.communicate(timeout=90)
    assert time.time() - killed < 60
    assert launcher.returncode != 0
    assert err.strip().splitlines()[-1] == "grpolab: rank 1 was killed by signal 9; the other ranks were stopped", err
    # one process continues from the last checkpoint the 2-rank run wrote, and finishes
    last = max(int(p.name.split("_")[1]) for p in (out / "checkpoints").glob("step_*") if p.name[5:].isdigit())
    # the same config but max_steps (sft.steps too: a changed config is refused on resume)
    res = run_cli("train", *_small(out, f"train.max_steps={last + 2}", "sft.steps=5", "train.resume=auto"), timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert [json.loads(x)["step"] for x in metrics.read_text().splitlines()] == list(range(1, last + 3))


RANK_ONE_FAILS = """
import os
def picky(completions, **kwargs):
    if os.environ["RANK"] == "1":
        raise ValueError("rank one dislikes this batch")
    return [0.0] * len(completions)
"""


@pytest.mark.slow
def test_exception_on_one_rank_stops_the_run_with_its_own_error(tmp_path):
    """A reward function that raises on rank 1 only: rank 1 says why in one line, the launcher names
    rank 1, not rank 0, and no traceback. Rank 0 says it stopped because a rank left when it was
    already waiting on rank 1; on a loaded machine the launcher can stop it before it gets there
    (then it prints nothing), so its line is checked only where it printed one."""
    (tmp_path / "picky.py").write_text(RANK_ONE_FAILS)
    res = run_cli("train", "--nproc", "2", *_small(tmp_path / "run", "sft.steps=5",
                                                    f"reward.functions=[{tmp_path / 'picky.py'}:picky]"), timeout=300)
    assert res.returncode == 2, res.stderr[-3000:]
    lines = [x for x in res.stderr.splitlines() if x.startswith("grpolab:")]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    assert any(x.startswith("grpolab: [rank 1] reward error: reward function") and "rank one dislikes this batch" in x
               for x in lines), lines
    rank0 = [x for x in lines if x.startswith("grpolab: [rank 0]")]
    assert all(x.startswith("grpolab: [rank 0] stopped: another rank left the run (") for x in rank0), lines
    assert len(lines) == 2 + len(rank0) and len(rank0) <= 1, lines
    assert lines[-1] == "grpolab: rank 1 exited with code 2; the other ranks were stopped", lines


def test_unstride_restores_the_order_of_a_strided_split():
    from grpolab.distributed import unstride
    items = list(range(11))
    for n in (1, 2, 3, 4):
        assert unstride([items[r::n] for r in range(n)]) == items


@pytest.mark.slow
def test_demo_with_two_ranks(tmp_path):
    """`grpolab demo --nproc 2`: one before/after table and summary.json, from rank 0, with the same
    numbers as the 1-process demo of the same settings."""
    small = ["--steps", "2", "sft.steps=20", "sft.bare_steps=0", "eval.num_problems=16", "eval.k=4",
             "train.threads=1", "model.n_layer=1", "model.n_embd=64", "rollout.prompts_per_step=8"]
    summaries = {}
    for name, extra in [("one", []), ("two", ["--nproc", "2"])]:
        res = run_cli("demo", *extra, "--out", str(tmp_path / name), *small, timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
        assert (res.stdout + res.stderr).count("metric (held-out)") == 1     # one table, not one per rank
        summaries[name] = json.loads((tmp_path / name / "summary.json").read_text())
    for part in ("before", "after"):
        assert summaries["two"][part] == pytest.approx(summaries["one"][part], abs=1e-9), part
    assert summaries["two"]["steps"] == 2


HALF = """
def half(completions, **kwargs):
    # informative (varied) only for completions of prompts whose text has an even length: dynamic sampling
    # then drops some groups and samples more
    return [float(len(c) % 3) if len(p if isinstance(p, str) else p[-1]["content"]) % 2 == 0 else 0.0
            for p, c in zip(kwargs["prompts"], completions)]
"""


@pytest.mark.slow
def test_dynamic_sampling_over_two_ranks(tmp_path):
    """Every rank takes the same number of rounds and keeps its share: metrics.jsonl reports the
    global count of kept groups, and the run finishes (no rank waits on a collective alone)."""
    (tmp_path / "half.py").write_text(HALF)
    out = tmp_path / "run"
    res = run_cli("train", "--nproc", "2", *_small(out, "algorithm.dynamic_sampling=true",
                                                    "algorithm.max_sampling_rounds=4", "train.max_steps=3",
                                                    f"reward.functions=[{tmp_path / 'half.py'}:half]"), timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3]
    assert all(1 <= m["dynamic_sampling/rounds"] <= 4 for m in lines)
    assert all(m["dynamic_sampling/kept_groups"] <= 4 for m in lines)
    assert any(m["dynamic_sampling/rounds"] > 1 for m in lines)          # the filter did drop groups
    assert all(m["frac_reward_zero_std"] > 0 for m in lines)
