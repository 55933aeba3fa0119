"""Dataset loading: real files in tmp_path, real datasets/pyarrow, no network."""

import json
import os
import re
import subprocess
import sys

import pytest
from conftest import GSM8K_DIR, GSM8K_SAMPLE

from grpolab.data.loading import filter_long_prompts, normalize_rows, read_records
from grpolab.data.tasks.gsm8k import load_gsm8k
from grpolab.errors import DataError

ROWS = [{"prompt": "1+1?", "answer": "2", "level": 1},
        {"prompt": "2+3?", "answer": "5", "level": 2}]


def write_jsonl(path, rows, blank_lines=False):
    lines = [json.dumps(r) for r in rows]
    path.write_text(("\n\n" if blank_lines else "\n").join(lines) + "\n")
    return path


# ---------------------------------------------------------------- reading


def test_jsonl_round_trip_skips_blank_lines(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS, blank_lines=True)
    assert read_records(str(path)) == ROWS


def test_json_list_and_data_object(tmp_path):
    (tmp_path / "list.json").write_text(json.dumps(ROWS))
    (tmp_path / "obj.json").write_text(json.dumps({"data": ROWS, "version": 1}))
    assert read_records(str(tmp_path / "list.json")) == ROWS
    assert read_records(str(tmp_path / "obj.json")) == ROWS
    (tmp_path / "bad.json").write_text(json.dumps({"rows": ROWS}))
    with pytest.raises(DataError, match=r"bad\.json.*'data'.*\['rows'\]"):
        read_records(str(tmp_path / "bad.json"))


def test_parquet_round_trip(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "d.parquet")
    assert read_records(str(tmp_path / "d.parquet")) == ROWS


def test_save_to_disk_dataset_and_dataset_dict(tmp_path):
    import datasets

    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "single"))
    assert read_records(str(tmp_path / "single")) == ROWS
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS),
                               "test": datasets.Dataset.from_list(ROWS[:1])})
    dd.save_to_disk(str(tmp_path / "dict"))
    assert read_records(str(tmp_path / "dict"), split="train") == ROWS
    assert read_records(str(tmp_path / "dict"), split="test") == ROWS[:1]
    with pytest.raises(DataError, match=r"splits \['test', 'train'\]; choose one"):
        read_records(str(tmp_path / "dict"))
    with pytest.raises(DataError, match=r"no split 'dev'"):
        read_records(str(tmp_path / "dict"), split="dev")


def test_directory_of_split_files(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    write_jsonl(tmp_path / "train.jsonl", ROWS)
    pq.write_table(pa.Table.from_pylist(ROWS[:1]), tmp_path / "test.parquet")
    assert read_records(str(tmp_path), split="train") == ROWS
    assert read_records(str(tmp_path), split="test") == ROWS[:1]
    with pytest.raises(DataError, match=r"no split 'dev'; splits here are \['test', 'train'\]"):
        read_records(str(tmp_path), split="dev")
    # hub-style parquet shards are read in order as one split
    shards = tmp_path / "shards"
    shards.mkdir()
    for k, row in enumerate(ROWS):
        pq.write_table(pa.Table.from_pylist([row]), shards / f"train-0000{k}-of-00002.parquet")
    assert read_records(str(shards)) == ROWS


def test_malformed_jsonl_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n\n" + '{"prompt": "x", "answer": \n')
    with pytest.raises(DataError, match=r"bad\.jsonl: line 3: invalid JSON") as e:
        read_records(str(path))
    assert "\n" not in str(e.value)
    path.write_text('["not", "an", "object"]\n')
    with pytest.raises(DataError, match=r"line 1: expected a JSON object, got list"):
        read_records(str(path))


def test_missing_file_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match=r"nope\.jsonl: file not found"):
        read_records(str(tmp_path / "nope.jsonl"))
    with pytest.raises(DataError, match=r"unsupported file type '\.tsv'"):
        (tmp_path / "d.tsv").write_text("prompt\tanswer\n")
        read_records(str(tmp_path / "d.tsv"))


def test_unreachable_hub_name_is_a_data_error():
    # a subprocess with the hub in offline mode: no network is touched and no retries are waited out
    code = ("from grpolab.data.loading import read_records, DataError\n"
            "try:\n    read_records('grpolab-test-owner/no-such-dataset', split='train')\n"
            "except DataError as e:\n    print('DataError:', e)\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert "DataError: grpolab-test-owner/no-such-dataset: not found locally" in out.stdout, out.stderr
    assert "Hugging Face Hub failed" in out.stdout


# ---------------------------------------------------------------- normalizing


def test_normalize_keeps_columns_and_stringifies_numbers():
    rows = normalize_rows([{"prompt": "a", "answer": 18, "id": 7}, {"prompt": "b", "answer": 2.5, "id": 8}])
    assert rows == [{"prompt": "a", "answer": "18", "id": 7}, {"prompt": "b", "answer": "2.5", "id": 8}]


def test_prompt_and_answer_key_mapping():
    records = [{"question": "How many?", "label": 3, "extra": "x"}]
    rows = normalize_rows(records, prompt_key="question", answer_key="label")
    assert rows[0]["prompt"] == "How many?" and rows[0]["answer"] == "3" and rows[0]["extra"] == "x"


def test_missing_prompt_column_names_it_and_lists_columns():
    with pytest.raises(DataError, match=r"d\.jsonl: row 2: no prompt column 'prompt'; "
                                        r"columns are \['answer', 'question'\]; set data\.prompt_key"):
        normalize_rows([{"prompt": "a", "answer": "1"}, {"question": "b", "answer": "2"}], source="d.jsonl")


def test_verl_rows():
    records = [{"data_source": "openai/gsm8k",
                "prompt": [{"role": "user", "content": "Q1"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": "72"},
                "extra_info": {"split": "train", "index": 0}}]
    (row,) = normalize_rows(records)
    assert row["prompt"] == [{"role": "user", "content": "Q1"}]
    assert row["answer"] == "72"
    assert row["data_source"] == "openai/gsm8k" and row["extra_info"] == {"split": "train", "index": 0}
    assert row["reward_model"] == {"style": "rule", "ground_truth": "72"}
    # an explicit answer column wins over reward_model.ground_truth
    (row,) = normalize_rows([{**records[0], "answer": "73"}])
    assert row["answer"] == "73"


def test_answers_all_missing_is_fine_partly_missing_is_not():
    rows = normalize_rows([{"prompt": "a"}, {"prompt": "b"}])
    assert [r["answer"] for r in rows] == [None, None]
    assert normalize_rows([{"prompt": "a", "answer": "1"}], answer_key=None)[0]["answer"] is None
    with pytest.raises(DataError, match=r"row 2: no answer .* 2 of 3 rows have one"):
        normalize_rows([{"prompt": "a", "answer": "1"}, {"prompt": "b"}, {"prompt": "c", "answer": "3"}])
    with pytest.raises(DataError, match=r"row 1: answer 'answer' must be a string or a number"):
        normalize_rows([{"prompt": "a", "answer": ["1", "2"]}])


@pytest.mark.parametrize("prompt", [42, [], [{"role": "user"}], [{"role": "user", "content": 5}], "  ", ["hi"]])
def test_bad_prompt_names_the_row(prompt):
    with pytest.raises(DataError, match=r"^d\.json: row 2: prompt"):
        normalize_rows([{"prompt": "ok", "answer": "1"}, {"prompt": prompt, "answer": "1"}], source="d.json")


def test_system_prompt_and_suffix_on_a_string_prompt():
    (row,) = normalize_rows([{"prompt": "What is 2+2?", "answer": "4"}],
                            system_prompt="You are careful.", prompt_suffix='Output the answer after "####".')
    assert row["prompt"] == [{"role": "system", "content": "You are careful."},
                             {"role": "user", "content": 'What is 2+2? Output the answer after "####".'}]
    (row,) = normalize_rows([{"prompt": "What is 2+2?", "answer": "4"}], prompt_suffix="Think.")
    assert row["prompt"] == "What is 2+2? Think."


def test_system_prompt_and_suffix_on_messages():
    messages = [{"role": "user", "content": "first"}, {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "second"}]
    records = [{"prompt": messages, "answer": "1"}]
    (row,) = normalize_rows(records, system_prompt="SYS", prompt_suffix="Think.")
    assert row["prompt"] == [{"role": "system", "content": "SYS"}, messages[0], messages[1],
                             {"role": "user", "content": "second Think."}]
    assert messages[2]["content"] == "second"  # the caller's rows are not edited
    # an existing system message is kept, and no second one is added
    with_system = [{"role": "system", "content": "OWN"}, {"role": "user", "content": "q"}]
    (row,) = normalize_rows([{"prompt": with_system, "answer": "1"}], system_prompt="SYS")
    assert row["prompt"] == with_system
    with pytest.raises(DataError, match=r"row 1: prompt_suffix needs a user message"):
        normalize_rows([{"prompt": [{"role": "system", "content": "s"}], "answer": "1"}], prompt_suffix="x")


def test_empty_dataset_is_an_error(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    with pytest.raises(DataError, match=r"empty\.jsonl: dataset is empty"):
        normalize_rows(read_records(str(path)), source=str(path))


# ---------------------------------------------------------------- filtering


def test_filter_long_prompts_drop_and_error():
    rows = normalize_rows([{"prompt": "x" * n, "answer": "1"} for n in (3, 10, 5, 12)])
    kept, dropped = filter_long_prompts(rows, len, max_length=5)
    assert [len(r["prompt"]) for r in kept] == [3, 5] and dropped == 2
    assert filter_long_prompts(rows, len, max_length=0) == (rows, 0)
    with pytest.raises(DataError, match=r"row 2: prompt is 10 tokens, over data\.max_prompt_length=5.*"
                                        r"raise data\.max_prompt_length"):
        filter_long_prompts(rows, len, max_length=5, on_long="error")
    with pytest.raises(ValueError, match="on_long"):
        filter_long_prompts(rows, len, max_length=5, on_long="truncate")


# ---------------------------------------------------------------- gsm8k


def test_gsm8k_from_a_written_file(tmp_path):
    path = write_jsonl(tmp_path / "g.jsonl", [
        {"question": "Q1", "answer": "2 * 500 = <<2*500=1000>>1,000\n#### 1,000"},
        {"question": "Q2", "answer": "a #### b\n#### -3.5 "}])
    rows = load_gsm8k(str(path))
    assert rows == [{"prompt": "Q1", "answer": "1000", "solution": "2 * 500 = <<2*500=1000>>1,000\n#### 1,000"},
                    {"prompt": "Q2", "answer": "-3.5", "solution": "a #### b\n#### -3.5 "}]
    write_jsonl(path, [{"question": "Q1", "answer": "#### 1"}, {"question": "Q2", "answer": "no marker"}])
    with pytest.raises(DataError, match=r"g\.jsonl: row 2: answer has no final '#### <number>'"):
        load_gsm8k(str(path))
    write_jsonl(path, [{"prompt": "Q1", "answer": "#### 1"}])
    with pytest.raises(DataError, match=r"row 1: no 'question' column; columns are \['answer', 'prompt'\]"):
        load_gsm8k(str(path))


def test_gsm8k_sample_is_realistic():
    # the written rows are real worked solutions: each <<expr=value>> note is right, and the final
    # '#### N' is the last note's value
    for rows in GSM8K_SAMPLE.values():
        for _, solution, answer in rows:
            notes = re.findall(r"<<([^=>]+)=([^>]+)>>", solution)
            assert notes, solution
            for expr, value in notes:
                assert eval(expr, {"__builtins__": {}}) == pytest.approx(float(value)), expr
            assert float(notes[-1][1]) == float(answer)


def test_gsm8k_files(gsm8k_dir):
    test = load_gsm8k(str(gsm8k_dir / "test.jsonl"))
    assert [r["prompt"] for r in test] == [q for q, _, _ in GSM8K_SAMPLE["test"]]
    assert [r["solution"] for r in test] == [a for _, a, _ in GSM8K_SAMPLE["test"]]
    assert [r["answer"] for r in test] == ["4", "13500", "-7", "4.5", "-1250", "54000", "210", "750000"]
    # the directory form with a split gives the same rows, and they normalize unchanged
    assert load_gsm8k(str(gsm8k_dir), split="test") == test
    assert normalize_rows(test, source="gsm8k") == test
    train = load_gsm8k(str(gsm8k_dir), split="train")
    assert [r["answer"] for r in train] == ["29", "875", "227.5", "-75", "126000"]
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    with pytest.raises(DataError, match=r"splits here are \['test', 'train'\]"):
        load_gsm8k(str(gsm8k_dir), split="validation")


def test_gsm8k_bad_final_line_names_file_and_row(tmp_path):
    path = write_jsonl(tmp_path / "g.jsonl", [
        {"question": "Q1", "answer": "2 * 3 = <<2*3=6>>6\n#### 6"},
        {"question": "Q2", "answer": "2 * 3 = <<2*3=6>>6\n#### 6\n#### six"}])   # the last '####' line counts
    with pytest.raises(DataError, match=r"g\.jsonl: row 2: answer has no final '#### <number>' line "
                                        r"\(its last '####' line reads 'six'\)"):
        load_gsm8k(str(path))
    write_jsonl(path, [{"question": "Q1", "answer": "#### 1/0"}])
    with pytest.raises(DataError, match=r"g\.jsonl: row 1: .*reads '1/0'"):
        load_gsm8k(str(path))


@pytest.mark.skipif(not (GSM8K_DIR / "test.jsonl").exists(), reason="shared GSM8K files not present")
def test_gsm8k_real_files():
    # an extra check on the real files where they exist; test_gsm8k_files covers the same code without them
    test = load_gsm8k(str(GSM8K_DIR / "test.jsonl"))
    assert len(test) == 1319
    assert test[0]["answer"] == "18" and test[0]["prompt"].startswith("Janet")
    assert test[0]["solution"].endswith("#### 18")
    assert all(re.fullmatch(r"-?[0-9]+", r["answer"]) for r in test)
    assert load_gsm8k(str(GSM8K_DIR), split="test") == test
    assert normalize_rows(test, source="gsm8k") == test
    if (GSM8K_DIR / "train.jsonl").exists():
        train = load_gsm8k(str(GSM8K_DIR), split="train")
        assert len(train) == 7473
        assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
        # '#### 1,080' in the file is '1080' in the rows
        assert {r["answer"] for r in train if "#### 1,080" in r["solution"]} == {"1080"}
