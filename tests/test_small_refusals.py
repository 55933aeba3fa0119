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


TINY_RUN = ["model.n_layer=1", "model.n_head=2", "model.n_embd=32", "model.block_size=96", "sft.steps=2",
            "sft.bare_steps=0", "rollout.prompts_per_step=2", "rollout.num_generations=2", "rollout.max_new_tokens=8",
            "train.max_steps=2", "eval.k=2", "train.threads=1"]


def _rows_file(path, n):
    path.write_text("".join(json.dumps({"prompt": f"{i} + 1 =", "answer": str(i + 1)}) + "\n" for i in range(n)))
    return path


def test_one_data_file_names_its_three_ways_to_a_held_out_eval(tmp_path):
    data = _rows_file(tmp_path / "alpaca.jsonl", 20)
    r = run_cli("train", *TINY_RUN, "data.task=files", f"data.train_path={data}", f"train.output_dir={tmp_path / 'a'}",
                timeout=300)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == (f"grpolab: data error: data.train_path {str(data)!r} is a single file, so it has no "
                                f"test split for the held-out eval: hold out part of it with data.val_size (e.g. "
                                f"0.05, or 200 rows), give a held-out file in data.test_path, or skip the eval with "
                                f"eval.num_problems=0"), r.stderr


def test_val_size_holds_out_a_seeded_share_of_the_train_rows(tmp_path):
    from grpolab.config.load import load_config
    from grpolab.jobs.inputs import load_data
    data = _rows_file(tmp_path / "d.jsonl", 40)
    splits = {}
    for size, seed in ((0.25, 0), (0.25, 0), (0.25, 1), (5, 0)):
        cfg = load_config(None, ["data.task=files", f"data.train_path={data}", f"data.val_size={size}",
                                 f"train.seed={seed}"])
        train, test = load_data(cfg)
        prompts = [r["prompt"] for r in train], [r["prompt"] for r in test]
        assert len(prompts[1]) == (10 if size == 0.25 else 5) and len(prompts[0]) + len(prompts[1]) == 40
        assert not set(prompts[0]) & set(prompts[1])
        assert prompts[0] == sorted(prompts[0], key=lambda p: int(p.split()[0]))   # the file's order kept
        splits[(size, seed, len(splits))] = prompts
    runs = list(splits.values())
    assert runs[0] == runs[1] and runs[0] != runs[2]   # the same seed draws the same rows; another seed others
    r = run_cli("train", *TINY_RUN, "data.task=files", f"data.train_path={data}", f"data.test_path={data}",
                "data.val_size=0.1", f"train.output_dir={tmp_path / 'b'}", timeout=300)
    assert r.returncode == 2 and "data.val_size: holds out part of data.train_path" in r.stderr, r.stderr


def test_eval_num_problems_0_skips_the_held_out_eval_of_grpolab_train(tmp_path):
    data = _rows_file(tmp_path / "d.jsonl", 20)
    out = tmp_path / "run"
    r = run_cli("train", *TINY_RUN, "data.task=files", f"data.train_path={data}", "eval.num_problems=0",
                "train.eval_every=1", f"train.output_dir={out}", timeout=300)
    assert r.returncode == 0, r.stderr
    assert "final eval: none (eval.num_problems=0; no eval.json)" in r.stdout + r.stderr
    assert not (out / "eval.json").exists()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and not any(k.startswith("eval/") for row in rows for k in row)
    for job in ("sft", "demo"):   # these report their eval before and after: 0 is refused there
        r = run_cli(job, *TINY_RUN, "eval.num_problems=0", f"train.output_dir={tmp_path / job}", timeout=300)
        assert r.returncode == 2 and "eval.num_problems: 0 (no held-out eval) is for grpolab train" in r.stderr, \
            r.stderr


def test_a_data_path_given_to_a_generated_task_is_refused(tmp_path):
    data = _rows_file(tmp_path / "d.jsonl", 4)
    for key in ("train_path", "test_path"):
        r = run_cli("train", *TINY_RUN, f"data.{key}={data}", f"train.output_dir={tmp_path / key}", timeout=300)
        assert r.returncode == 2, r.stderr
        assert r.stderr.strip() == (f"grpolab: config error: data.{key}: data.task=arithmetic generates its rows "
                                    f"and reads no file; set data.task=files (or gsm8k) to use {str(data)!r}")


def test_the_run_says_when_the_eval_scores_with_another_check_than_the_training_reward():
    from grpolab.config.load import load_config
    from grpolab.jobs.train import eval_check_line
    assert eval_check_line(load_config(None, [])) is None   # gsm8k_accuracy both: nothing to say
    line = eval_check_line(load_config(None, ["reward.functions=[length]", "eval.k=4", "eval.num_problems=50"]))
    assert line == ("eval: greedy accuracy and pass@4 on 50 held-out problems are scored by "
                    "eval.reward=gsm8k_accuracy against each row's answer, not by the training reward (length); "
                    "set eval.reward to the check that fits the data")
    assert eval_check_line(load_config(None, ["reward.functions=[length]", "eval.num_problems=0"])) is None
