"""The held-out split and the check it is scored with (issue 48): GSM8K from one file gets the files task's
refusal and data.val_size instead of an eval on its own train rows; a job that reads only the train rows
reads no test split; the eval's check follows the training reward unless eval.reward names one."""

import json

import pytest
import yaml
from conftest import run_cli
from test_small_refusals import TINY_RUN, _rows_file

from grpolab.config.load import load_config
from grpolab.errors import ConfigError, DataError
from grpolab.jobs.inputs import load_data


def test_gsm8k_from_one_file_is_refused_not_evaluated_on_its_own_train_rows(gsm8k_dir):
    one = gsm8k_dir / "train.jsonl"
    r = run_cli("train", *TINY_RUN, "data.task=gsm8k", f"data.train_path={one}", timeout=300)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == (f"grpolab: data error: data.train_path {str(one)!r} is a single file, so it has no "
                                f"test split for the held-out eval: hold out part of it with data.val_size (e.g. "
                                f"0.05, or 200 rows), give a held-out file in data.test_path, or skip the eval with "
                                f"eval.num_problems=0"), r.stderr
    # the directory has its test split, and data.val_size draws one from the file
    train, test = load_data(load_config(None, ["data.task=gsm8k", f"data.train_path={gsm8k_dir}"]))
    assert (len(train), len(test)) == (5, 8)
    train, test = load_data(load_config(None, ["data.task=gsm8k", f"data.train_path={one}", "data.val_size=2"]))
    assert (len(train), len(test)) == (3, 2) and not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    train, test = load_data(load_config(None, ["data.task=gsm8k", f"data.train_path={one}", "eval.num_problems=0"]))
    assert (len(train), len(test)) == (5, 0)


def test_a_job_that_reads_only_the_train_rows_needs_no_test_split(tmp_path):
    data = _rows_file(tmp_path / "d.jsonl", 10)
    cfg = load_config(None, ["data.task=files", f"data.train_path={data}"])
    with pytest.raises(DataError, match="is a single file, so it has no test split"):
        load_data(cfg)
    train, test = load_data(cfg, with_test=False)
    assert len(train) == 10 and test == []
    # data.val_size's rows stay out of every job's train rows, so a later eval on them is held out
    held = load_config(None, ["data.task=files", f"data.train_path={data}", "data.val_size=0.3"])
    assert load_data(held, with_test=False)[0] == load_data(held)[0] and len(load_data(held)[0]) == 7


def test_val_size_is_a_share_or_a_whole_number_of_rows(tmp_path):
    data = _rows_file(tmp_path / "d.jsonl", 10)
    with pytest.raises(ConfigError, match=r"^data\.val_size: 2\.5 is neither a share below 1 nor a whole number"):
        load_config(None, ["data.task=files", f"data.train_path={data}", "data.val_size=2.5"])
    for size in ("0.95", "10"):   # a share that rounds to every row, a count of every row
        with pytest.raises(DataError, match=rf"^data\.val_size={size} holds out 10 of the 10 train rows"):
            load_data(load_config(None, ["data.task=files", f"data.train_path={data}", f"data.val_size={size}"]))


def test_the_eval_check_follows_the_training_reward_unless_eval_reward_names_one():
    def check(*overrides):
        return load_config(None, list(overrides)).eval.reward
    assert check() == "gsm8k_accuracy"
    assert check("reward.functions=[format,math_accuracy]") == "math_accuracy"
    assert check("reward.functions=[code_exec]", "data.task=pyfunc") == "code_exec"
    assert check("reward.functions=[length]") == "gsm8k_accuracy"   # no check in the training reward
    assert check("reward.functions=[math_accuracy]", "eval.reward=gsm8k_accuracy") == "gsm8k_accuracy"
    with pytest.raises(ConfigError, match=r"^eval\.reward: data\.task=pyfunc is checked by running the code: train "
                                          r"with reward\.functions=\[code_exec\] \(the eval follows it\)"):
        load_config(None, ["data.task=pyfunc"])


def test_a_run_on_its_own_data_and_reward_records_the_check_its_eval_used(tmp_path):
    data = tmp_path / "boxed.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "answer": f"\\boxed{{{i + 1}}}"}) + "\n"
                            for i in range(12)))
    out = tmp_path / "run"
    r = run_cli("train", *TINY_RUN, "data.task=files", f"data.train_path={data}", "data.val_size=4",
                "reward.functions=[math_accuracy]", "eval.num_problems=4", f"train.output_dir={out}", timeout=300)
    assert r.returncode == 0, r.stderr
    assert yaml.safe_load((out / "config.yaml").read_text())["eval"]["reward"] == "math_accuracy"
    assert "greedy_accuracy" in json.loads((out / "eval.json").read_text())
    assert "eval.reward=gsm8k_accuracy" not in r.stdout + r.stderr
