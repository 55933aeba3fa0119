"""Small refusals and fixes found by issue 48's hostile user: a tokenizer too small to exist, a run
comparison that an extra timing key must not fail, generated tasks that ignored the system prompt, a NaN answer."""

import json
import subprocess
import sys

from conftest import ROOT, run_cli


def test_tiny_model_refuses_a_vocabulary_below_its_bytes_and_specials(tmp_path):
    for size in ("0", "259"):
        r = run_cli("tiny-model", str(tmp_path / f"m{size}"), "--vocab-size", size, timeout=120)
        assert r.returncode == 2, r.stderr
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert lines == [f"grpolab: config error: --vocab-size: {size} is below 260 (the 256 bytes and 4 special "
                         f"tokens every tokenizer of this kind has)"], r.stderr
        assert not (tmp_path / f"m{size}").exists()   # nothing written


def _run_dir(path, rows):
    path.mkdir()
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _compare(a, b):
    return subprocess.run([sys.executable, str(ROOT / "scripts/compare_runs.py"), str(a), str(b)], capture_output=True,
                          text=True)


def test_compare_runs_ignores_an_extra_timing_key_but_not_an_extra_metric(tmp_path):
    base = _run_dir(tmp_path / "a", [{"step": 1, "reward": 0.5, "time/step": 1.0}])
    # an async resume logs time/worker_start once more: still the same run
    resumed = _run_dir(tmp_path / "b", [{"step": 1, "reward": 0.5, "time/worker_start": 3.0, "time/step": 2.0}])
    r = _compare(base, resumed)
    assert r.returncode == 0 and "IDENTICAL" in r.stdout, r.stdout
    other = _run_dir(tmp_path / "c", [{"step": 1, "reward": 0.5, "kl": 0.0, "time/step": 1.0}])
    r = _compare(base, other)
    assert r.returncode == 1 and "keys differ" in r.stdout, r.stdout
    changed = _run_dir(tmp_path / "d", [{"step": 1, "reward": 0.25, "time/step": 1.0}])
    r = _compare(base, changed)
    assert r.returncode == 1 and "reward: 0.5 vs 0.25" in r.stdout, r.stdout


def test_the_system_prompt_and_suffix_reach_the_generated_tasks_prompts():
    from grpolab.config.load import load_config
    from grpolab.jobs.inputs import load_data
    plain, _ = load_data(load_config(None, ["data.task=arithmetic"]))
    train, test = load_data(load_config(None, ["data.task=arithmetic", "data.system_prompt=Be brief.",
                                               "data.prompt_suffix=Show your work."]))
    assert isinstance(plain[0]["prompt"], str)   # unchanged without them (the demo's prompts)
    for got, was in zip(train[:5], plain[:5]):
        assert got["prompt"] == [{"role": "system", "content": "Be brief."},
                                 {"role": "user", "content": was["prompt"] + " Show your work."}]
        assert got["answer"] == was["answer"]
    assert test[0]["prompt"][0] == {"role": "system", "content": "Be brief."}


def test_a_nan_answer_in_a_jsonl_file_is_a_data_error(tmp_path):
    import pytest

    from grpolab.data.loading import normalize_rows, read_records
    from grpolab.errors import DataError
    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "a?", "answer": 3}\n{"prompt": "b?", "answer": NaN}\n')   # json.loads reads NaN
    with pytest.raises(DataError, match=r"row 2: answer 'answer' is nan \(not a number one can be right about\)"):
        normalize_rows(read_records(str(path), "train", None), source=str(path))
    path.write_text('{"prompt": "a?", "answer": 3}\n{"prompt": "b?", "answer": 2.5}\n')
    assert [r["answer"] for r in normalize_rows(read_records(str(path), "train", None))] == ["3", "2.5"]


T = ["model.n_layer=1", "model.n_head=2", "model.n_embd=32", "model.block_size=96", "sft.steps=2", "sft.bare_steps=0",
     "rollout.prompts_per_step=2", "rollout.num_generations=2", "rollout.max_new_tokens=8", "eval.num_problems=4",
     "eval.k=2", "train.threads=1"]


def test_a_second_run_on_a_live_run_directory_is_refused_naming_the_process(tmp_path):
    import os
    import signal

    from conftest import wait_for_rows
    out = tmp_path / "lk"
    first = subprocess.Popen([sys.executable, "-m", "grpolab.cli", "train", *T, "train.max_steps=400",
                              "train.save_every=1", f"train.output_dir={out}"], cwd=ROOT, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    try:
        wait_for_rows(out / "metrics.jsonl", 2, first)
        assert first.poll() is None, first.stderr.read()
        r = run_cli("train", *T, "train.max_steps=400", f"train.output_dir={out}", "train.resume=auto", timeout=300)
        assert r.returncode == 2, r.stderr
        assert r.stderr.strip().splitlines() == [f"grpolab: config error: train.output_dir: {out} is in use by another "
                                                 f"grpolab run (pid {first.pid}); wait for it to end, or give another "
                                                 f"train.output_dir"], r.stderr
        assert first.poll() is None   # the live run goes on
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    # the kernel released the lock with the process: resuming now works
    r = run_cli("train", *T, "train.max_steps=3", f"train.output_dir={out}", "train.resume=auto", timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (out / ".lock").read_text() != str(first.pid) and os.path.exists(out / "eval.json")


def test_a_run_refused_while_it_is_set_up_leaves_no_run_directory(tmp_path):
    """Malformed data is found after config.yaml is written (the data loads after the run directory is taken):
    the refusal must not leave a run behind. A directory that held something already keeps it."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": \n')
    args = ["model.n_layer=1", "model.n_head=2", "model.n_embd=32", "model.block_size=96", "sft.steps=2",
            "sft.bare_steps=0", "data.task=files", f"data.train_path={bad}", f"data.test_path={bad}", "train.threads=1"]
    fresh = tmp_path / "fresh"
    r = run_cli("train", *args, f"train.output_dir={fresh}", timeout=300)
    assert r.returncode == 2 and "bad.jsonl" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not fresh.exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    r = run_cli("train", *args, f"train.output_dir={kept}", timeout=300)
    assert r.returncode == 2, r.stderr
    assert sorted(p.name for p in kept.iterdir()) == [".lock", "notes.txt"]


def test_prompts_too_long_for_the_context_are_named_before_the_warm_start(tmp_path):
    """It said 'every row is longer than sft.max_length' (the warm start's key) for prompts that the model's
    context cannot take: the line names the prompts' length, the context and rollout.max_new_tokens."""
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps({"prompt": "What is " + "1+" * 150 + "1?", "answer": "151"}) + "\n"
                            for _ in range(8)))
    r = run_cli("train", "model.n_layer=1", "model.n_head=2", "model.n_embd=32", "model.block_size=96",
                "sft.steps=2", "sft.bare_steps=0", "rollout.max_new_tokens=8", "train.threads=1", "data.task=files",
                f"data.train_path={data}", f"data.test_path={data}", f"train.output_dir={tmp_path / 'run'}",
                timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    shortest = len("What is " + "1+" * 150 + "1?")   # characters: the built-in tokenizer's tokens, plus its template
    assert len(lines) == 1 and lines[0].startswith(
        "grpolab: data error: train: every prompt is longer than 88 tokens (what the model's context of 96 tokens "
        "leaves beside rollout.max_new_tokens=8); the shortest is "), lines
    assert int(lines[0].split("the shortest is ")[1].split()[0]) > shortest
    assert "sft.max_length" not in r.stderr and "warm start" not in r.stdout
