"""Training data as other tools write it: LLaMA-Factory's alpaca and sharegpt rows (and its dataset_info.json),
TRL's language-modelling `text` rows and implicit-prompt pairs, CSV files and dotted keys.

The unit tests write each input row and the row grpolab makes of it out in full. The training tests run
the real jobs (sft, dpo, rm, GRPO) a few steps on the tiny built-in model from a file as the tool writes it
(rows copied from LLaMA-Factory's data/*.json demos and TRL's documentation)."""

import json
import math
from pathlib import Path

import pytest

from grpolab.cli import main
from grpolab.config.load import load_config
from grpolab.data.loading import normalize_rows, read_records
from grpolab.data.preference import preference_rows
from grpolab.data.supervised import encode, sft_rows
from grpolab.errors import DataError

# LLaMA-Factory's data/alpaca_en_demo.json (its three shortest rows)
ALPACA = [{"instruction": "Calculate 15% of 500.", "input": "", "output": "15% of 500 is 75."},
          {"instruction": "Generate a hypothetical phone number.", "input": "", "output": "(555) 123-4567"},
          {"instruction": "Sum up the numbers.", "input": "3, 2, 5", "output": "The sum of the numbers is 10."}]
# data/glaive_toolcall_en_demo.json (its shortest row with a function call)
GLAIVE = {"conversations": [
    {"from": "human", "value": "Hi, I was born on 1990-05-15. Can you tell me how old I am today?"},
    {"from": "function_call", "value": "{\"name\": \"calculate_age\", \"arguments\": {\"birthdate\": \"1990-05-15\"}}"},
    {"from": "observation", "value": "{\"age\": 31}"},
    {"from": "gpt", "value": "Based on the birthdate you provided, you are 31 years old today."}],
    "tools": "[{\"name\": \"calculate_age\", \"description\": \"Calculate the age based on birthdate\", "
             "\"parameters\": {\"type\": \"object\", \"properties\": {\"birthdate\": {\"type\": \"string\", "
             "\"description\": \"The birthdate in YYYY-MM-DD format\"}}, \"required\": [\"birthdate\"]}}]"}
SHAREGPT = [GLAIVE, {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"},
                                       {"from": "human", "value": "Name a colour."}, {"from": "gpt", "value": "Blue."}],
                     "system": "Be brief."}]
# data/dpo_en_demo.json (its two shortest rows)
SHAREGPT_PAIRS = [
    {"conversations": [{"from": "human", "value": "Obtain the result by calculating 6778576-84834150134. Only "
                                                  "respond with math and no words."}],
     "chosen": {"from": "gpt", "value": "6778576 - 84834150134 = -84827371558"},
     "rejected": {"from": "gpt", "value": "84834150134 - 6778576 = -16666579378"}},
    {"conversations": [{"from": "human", "value": "answer 256626720691 + 1646615806005?\nLimit your response to "
                                                  "mathematical expressions and symbols."}],
     "chosen": {"from": "gpt", "value": "256626720691 + 1646615806005 = 1903242526696"},
     "rejected": {"from": "gpt", "value": "To find the sum of 256626720691 and 1646615806005, you can use the "
                                          "following mathematical expression:\n\n256626720691 + 1646615806005 =\n\n"
                                          "The result is:\n\n4212883012996"}}]
# data/README.md's alpaca preference form
ALPACA_PAIRS = [{"instruction": "Calculate 15% of 500.", "input": "", "chosen": "75", "rejected": "50"},
                {"instruction": "Sum up the numbers.", "input": "3, 2, 5", "chosen": "10", "rejected": "9"}]
# TRL's dataset formats page: language modelling, implicit-prompt preference (standard and conversational)
TRL_TEXT = [{"text": "The sky is blue."}, {"text": "The grass is green."}]
TRL_IMPLICIT = [{"chosen": "The sky is blue.", "rejected": "The sky is green."},
                {"chosen": "The grass is green.", "rejected": "The grass is purple."}]
TRL_IMPLICIT_CONV = [{"chosen": [{"role": "user", "content": "What color is the sky?"},
                                 {"role": "assistant", "content": "It is blue."}],
                      "rejected": [{"role": "user", "content": "What color is the sky?"},
                                   {"role": "assistant", "content": "It is green."}]}] * 2

TOOL_SYSTEM = ("Tools you may call, one call written as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>:"
               "\n" + json.dumps(json.loads(GLAIVE["tools"])[0]))
GLAIVE_MESSAGES = [
    {"role": "system", "content": TOOL_SYSTEM},
    {"role": "user", "content": "Hi, I was born on 1990-05-15. Can you tell me how old I am today?"},
    {"role": "assistant", "content": "<tool_call>\n{\"name\": \"calculate_age\", \"arguments\": "
                                     "{\"birthdate\": \"1990-05-15\"}}\n</tool_call>"},
    {"role": "tool", "content": "{\"age\": 31}"},
    {"role": "assistant", "content": "Based on the birthdate you provided, you are 31 years old today."}]


def _write(path: Path, rows) -> Path:
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        path.write_text(json.dumps(rows))
    return path


# ---------------------------------------------------------------- normalisation, row by row


def test_alpaca_rows_become_conversations():
    row = {"instruction": "Sum up the numbers.", "input": "3, 2, 5", "output": "10", "system": "Be exact.",
           "history": [["Hi", "Hello"]]}
    assert sft_rows([row]) == [{"messages": [
        {"role": "system", "content": "Be exact."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Sum up the numbers.\n3, 2, 5"},
        {"role": "assistant", "content": "10"}], "train_from": 0}]   # history answers are trained too
    assert sft_rows(ALPACA[:1]) == [{"messages": [{"role": "user", "content": "Calculate 15% of 500."},
                                                  {"role": "assistant", "content": "15% of 500 is 75."}],
                                     "train_from": 0}]   # an empty input adds no newline


def test_sharegpt_rows_map_function_calls_and_observations():
    assert sft_rows(SHAREGPT) == [
        {"messages": GLAIVE_MESSAGES, "train_from": 0},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Name a colour."},
                      {"role": "assistant", "content": "Blue."}], "train_from": 0}]
    # a leading system turn replaces the system column, as in LLaMA-Factory
    row = {"conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "q"},
                             {"from": "gpt", "value": "a"}], "system": "ignored"}
    assert sft_rows([row])[0]["messages"][0] == {"role": "system", "content": "S"}


def test_sharegpt_turns_out_of_order_name_the_turn():
    row = {"conversations": [{"from": "human", "value": "q"}, {"from": "human", "value": "q2"}]}
    with pytest.raises(DataError, match=r"f\.json: row 1: conversations turn 1 is 'human', expected gpt or "
                                        r"function_call"):
        sft_rows([row], source="f.json")


def test_text_rows_train_on_every_token(tok):
    assert sft_rows(TRL_TEXT) == TRL_TEXT
    ex = encode(tok, {"text": "The sky is blue."})
    # the character tokenizer: BOS, one id per character, the stop token; all but BOS learned
    assert ex.ids == [tok.bos_id] + [tok.stoi[c] for c in "The sky is blue."] + [tok.eos_id]
    assert ex.loss == [False] + [True] * 17


def test_pairs_in_each_format():
    assert preference_rows(ALPACA_PAIRS[:1]) == [
        {"prompt": [{"role": "user", "content": "Calculate 15% of 500."}], "chosen": "75", "rejected": "50"}]
    assert preference_rows(SHAREGPT_PAIRS[:1]) == [
        {"prompt": [{"role": "user", "content": SHAREGPT_PAIRS[0]["conversations"][0]["value"]}],
         "chosen": [{"role": "assistant", "content": "6778576 - 84834150134 = -84827371558"}],
         "rejected": [{"role": "assistant", "content": "84834150134 - 6778576 = -16666579378"}]}]
    # TRL's implicit prompt, texts: the shared start, the space before the split going with the completions
    assert preference_rows(TRL_IMPLICIT) == [
        {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
        {"prompt": "The grass is", "chosen": " green.", "rejected": " purple."}]
    assert preference_rows(TRL_IMPLICIT_CONV[:1]) == [
        {"prompt": [{"role": "user", "content": "What color is the sky?"}],
         "chosen": [{"role": "assistant", "content": "It is blue."}],
         "rejected": [{"role": "assistant", "content": "It is green."}]}]


@pytest.mark.slow   # importing TRL takes seconds
@pytest.mark.parametrize("chosen, rejected", [("The sky is blue.", "The sky is green."), ("abc", "abcd"),
                                              ("x y", "x z"), ("Yes, it is", "Yes it is")])
def test_implicit_text_prompt_matches_trl(chosen, rejected):
    extract_prompt = pytest.importorskip("trl.data_utils").extract_prompt   # TRL's own function
    want = extract_prompt({"chosen": chosen, "rejected": rejected})
    assert preference_rows([{"chosen": chosen, "rejected": rejected}]) == [want]


def test_prompt_rows_from_alpaca_and_sharegpt():
    rows = normalize_rows(ALPACA[2:] + [SHAREGPT[1]])
    assert [(r["prompt"], r["answer"]) for r in rows] == [
        ([{"role": "user", "content": "Sum up the numbers.\n3, 2, 5"}], "The sum of the numbers is 10."),
        ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
          {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Name a colour."}], "Blue.")]
    assert rows[0]["instruction"] == "Sum up the numbers."   # the columns stay for rewards


def test_dotted_keys_reach_nested_columns():
    verl = {"extra_info": {"question": "2+2?", "answer": "4"}, "prompt": "ignored"}
    [row] = normalize_rows([verl], prompt_key="extra_info.question", answer_key="extra_info.answer")
    assert (row["prompt"], row["answer"]) == ("2+2?", "4")
    assert sft_rows([verl], prompt_key="extra_info.question", response_key="extra_info.answer") == [
        {"prompt": "2+2?", "completion": "4"}]
    pair = {"q": {"text": "2+2?"}, "r": {"good": "4", "bad": "5"}}
    assert preference_rows([pair], prompt_key="q.text", chosen_key="r.good", rejected_key="r.bad") == [
        {"prompt": "2+2?", "chosen": "4", "rejected": "5"}]
    assert normalize_rows([{"a.b": "flat", "a": {"b": "nested"}, "answer": "1"}], prompt_key="a.b")[0]["prompt"] \
        == "flat"   # a column literally named with a dot wins


def test_csv_cells_stay_text(tmp_path):
    f = tmp_path / "d.csv"
    f.write_text('prompt,answer\n"Add 1, 2 and\nthree",006\nplain,-1.50\n')
    assert read_records(str(f)) == [{"prompt": "Add 1, 2 and\nthree", "answer": "006"},
                                    {"prompt": "plain", "answer": "-1.50"}]
    f.write_text("prompt,answer\na,1\nb,2,3\n")
    with pytest.raises(DataError, match=r"d\.csv: not a readable CSV file \(ArrowInvalid: CSV parse error: Expected 2 "
                                        r"columns, got 3: b,2,3\); the first line names the columns"):
        read_records(str(f))
    (tmp_path / "split").mkdir()
    (tmp_path / "split" / "train.csv").write_text("instruction,input,output\nSay hi,,hi\n")
    assert sft_rows(read_records(str(tmp_path / "split"), "train"))[0]["messages"][0] == \
        {"role": "user", "content": "Say hi"}   # an empty CSV cell is an empty input


def test_dataset_info_renames_columns_and_tags(tmp_path):
    (tmp_path / "dataset_info.json").write_text(json.dumps({
        "mine": {"file_name": "mine.json", "formatting": "sharegpt", "columns": {"messages": "chat", "system": "sys"},
                 "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                          "assistant_tag": "assistant"}},
        "qa": {"file_name": "qa.jsonl", "columns": {"prompt": "q", "query": "ctx", "response": "a"}},
        "pt": {"file_name": "pt.jsonl", "columns": {"prompt": "body"}}}))
    _write(tmp_path / "mine.json", [{"sys": "S", "chat": [{"role": "user", "content": "q"},
                                                          {"role": "assistant", "content": "a"}]}])
    _write(tmp_path / "qa.jsonl", [{"q": "Q", "ctx": "C", "a": "A"}])
    _write(tmp_path / "pt.jsonl", [{"body": "a document"}])
    assert sft_rows(read_records(str(tmp_path / "mine.json"))) == [{"messages": [
        {"role": "system", "content": "S"}, {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
        "train_from": 0}]
    assert sft_rows(read_records(str(tmp_path / "qa.jsonl"))) == [{"messages": [
        {"role": "user", "content": "Q\nC"}, {"role": "assistant", "content": "A"}], "train_from": 0}]
    assert sft_rows(read_records(str(tmp_path / "pt.jsonl"))) == [{"text": "a document"}]   # pre-training form


def test_a_dataset_info_mapping_that_matches_no_column_is_one_line(tmp_path, capsys):
    """The entry's columns name columns the rows lack (a typo, the wrong file): said, not silently unmapped."""
    (tmp_path / "dataset_info.json").write_text(json.dumps({
        "qa": {"file_name": "qa.jsonl", "columns": {"prompt": "question", "query": "ctx", "response": "answer"}}}))
    f = _write(tmp_path / "qa.jsonl", [{"q": "Q", "ctx": "C", "a": "A"}, {"q": "Q2", "a": "A2"}])
    assert main(["sft", f"sft.train_path={f}", f"train.output_dir={tmp_path / 'run'}", "log.level=quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "dataset_info.json entry 'qa': its columns prompt -> 'question', response -> 'answer' name columns no " \
        "row has; the rows have ['a', 'ctx', 'q']" in err, err
    assert "query" not in err   # 'ctx' is there (in one row of two): that mapping matches


def test_a_row_that_fits_no_format_lists_the_formats(tmp_path, capsys):
    f = _write(tmp_path / "rows.jsonl", [ALPACA[0], {"question": "q", "reply": "r"}])
    assert main(["sft", f"sft.train_path={f}", f"train.output_dir={tmp_path / 'run'}", "log.level=quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{f}: row 2: no 'prompt' or 'completion' column; columns are " \
        "['question', 'reply']; the SFT formats grpolab reads are: prompt + completion" in err, err
    assert all(name in err for name in ("messages", "text (TRL", "alpaca (instruction", "sharegpt")), err
    for rows, job, want in [([{"answer": "1"}], ["dpo", "dpo.pairs"], "the preference formats grpolab reads are"),
                            ([{"question": "q"}], ["train", "data.train_path"], "the prompt formats grpolab reads")]:
        f = _write(tmp_path / "bad.jsonl", rows)
        extra = ["data.task=files", f"data.test_path={f}"] if job[0] == "train" else []
        assert main([job[0], f"{job[1]}={f}", *extra, f"train.output_dir={tmp_path / 'r2'}"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"{f}: row 1: " in err and want in err, err


def test_sharegpt_tool_turns_through_a_chat_template():
    """On a ChatML template that renders `tool` messages, the function call is a learned assistant turn and
    the observation is context: the loss covers exactly the two gpt/function_call turns."""
    from grpolab.models.hf import HFTokenizer
    from grpolab.models.tiny_hf import build_tokenizer
    tok = HFTokenizer(build_tokenizer(vocab_size=300))
    row = sft_rows([GLAIVE])[0]
    ex = encode(tok, row)
    learned = tok.decode([i for i, m in zip(ex.ids, ex.loss) if m], skip_special=False)
    assert learned == GLAIVE_MESSAGES[2]["content"] + "<|im_end|>\n" + GLAIVE_MESSAGES[4]["content"] + "<|im_end|>\n"
    assert "<tool_response>\n{\"age\": 31}\n</tool_response>" in tok.decode(ex.ids, skip_special=False)


# ---------------------------------------------------------------- training a few steps from each format

TINY = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.block_size=1024", "data.test_size=2",
        "eval.num_problems=2", "eval.k=2", "log.level=quiet", "data.train_size=4"]


def _metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _assistant_chars(row: dict) -> int:
    """Tokens SFT learns from a row on the character tokenizer: each trained character plus a stop token per
    assistant turn (or per text)."""
    if "text" in row:
        return len(row["text"]) + 1
    return sum(len(m["content"]) + 1 for m in row["messages"] if m["role"] == "assistant")


SFT_FILES = {   # name -> (file name, rows as written, the rows grpolab trains on)
    "alpaca": ("alpaca_en_demo.json", ALPACA, [{"messages": [{"role": "assistant", "content": r["output"]}]}
                                               for r in ALPACA]),
    "sharegpt": ("glaive.json", SHAREGPT, [{"messages": GLAIVE_MESSAGES},
                                           {"messages": [{"role": "assistant", "content": "Hello!"},
                                                         {"role": "assistant", "content": "Blue."}]}]),
    "text": ("c4.jsonl", TRL_TEXT, TRL_TEXT),
    "csv": ("rows.csv", None, [{"messages": [{"role": "assistant", "content": "hi there"}]},
                               {"messages": [{"role": "assistant", "content": "0042"}]}]),
}


@pytest.mark.slow
@pytest.mark.parametrize("fmt", list(SFT_FILES))
def test_sft_trains_from(fmt, tmp_path):
    """Each step's batch is every row, so its `tokens` metric is the learned tokens of all of them, counted
    here from the rows by hand: the whole text, or every assistant turn (history and tool calls included)."""
    from grpolab.jobs.sft import run_sft
    name, rows, trained = SFT_FILES[fmt]
    f = tmp_path / name
    if rows is None:
        f.write_text("instruction,input,output\nSay hi,,hi there\nPad,\"to 4, digits\",0042\n")
    else:
        _write(f, rows)
    n = len(trained)
    summary = run_sft(load_config(None, [*TINY, f"sft.train_path={f}", "sft.steps=2", f"sft.batch_size={n}",
                                         f"train.output_dir={tmp_path / 'run'}"]))
    lines = _metrics(tmp_path / "run")
    assert summary["steps"] == 2 and [m["tokens"] for m in lines] == [sum(map(_assistant_chars, trained))] * 2
    assert all(math.isfinite(m["loss"]) for m in lines)


PAIR_FILES = {"alpaca": ALPACA_PAIRS, "sharegpt": SHAREGPT_PAIRS, "trl_implicit": TRL_IMPLICIT,
              "trl_implicit_conversational": TRL_IMPLICIT_CONV}


@pytest.mark.slow
@pytest.mark.parametrize("fmt", list(PAIR_FILES))
def test_dpo_and_rm_train_from(fmt, tmp_path):
    from grpolab.jobs.dpo import run_dpo
    from grpolab.jobs.rm import run_rm
    f = _write(tmp_path / "pairs.json", PAIR_FILES[fmt])
    run_dpo(load_config(None, [*TINY, f"dpo.pairs={f}", "dpo.steps=2", "dpo.batch_size=2",
                               f"train.output_dir={tmp_path / 'dpo'}"]))
    dpo = _metrics(tmp_path / "dpo")
    assert len(dpo) == 2 and all(math.isfinite(m["logps/chosen"]) and m["logps/chosen"] < 0 for m in dpo)
    run_rm(load_config(None, [*TINY, f"rm.pairs={f}", "rm.steps=2", "rm.batch_size=2", "rm.eval_size=1",
                              f"train.output_dir={tmp_path / 'rm'}"]))
    rm = _metrics(tmp_path / "rm")
    assert len(rm) == 2 and all(math.isfinite(m["loss"]) for m in rm)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["alpaca", "sharegpt", "dotted"])
def test_grpo_trains_on_prompts_from(fmt, tmp_path):
    from grpolab.jobs.train import run_train
    rows = {"alpaca": ALPACA, "sharegpt": SHAREGPT,
            "dotted": [{"extra_info": {"question": r["instruction"], "answer": r["output"]}} for r in ALPACA]}[fmt]
    f = _write(tmp_path / "prompts.jsonl", rows)
    keys = ["data.prompt_key=extra_info.question", "data.answer_key=extra_info.answer"] if fmt == "dotted" else []
    run_train(load_config(None, [*TINY, "data.task=files", f"data.train_path={f}", f"data.test_path={f}", *keys,
                                 "train.max_steps=2", "sft.steps=0", "reward.functions=[length]",
                                 "rollout.prompts_per_step=2", "rollout.num_generations=2", "rollout.max_new_tokens=4",
                                 f"train.output_dir={tmp_path / 'run'}"]))
    lines = _metrics(tmp_path / "run")
    assert [m["step"] for m in lines] == [1, 2] and all(math.isfinite(m["reward"]) for m in lines)
    want = {"alpaca": [[{"role": "user", "content": r["instruction"] + ("\n" + r["input"] if r["input"] else "")}]
                       for r in ALPACA],
            "sharegpt": [GLAIVE_MESSAGES[:4], [{"role": "system", "content": "Be brief."},
                                               {"role": "user", "content": "Hi"},
                                               {"role": "assistant", "content": "Hello!"},
                                               {"role": "user", "content": "Name a colour."}]],
            "dotted": [r["instruction"] for r in ALPACA]}[fmt]
    seen = [json.loads(x)["prompt"] for x in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert seen and all(p in want for p in seen), seen   # the rollouts were prompted with the rows' prompts


@pytest.mark.slow
def test_sft_on_nested_files_task_rows_trains_and_evaluates_accuracy(tmp_path):
    """verl's SFT recipe: data.prompt_key=extra_info.question, data.response_key=extra_info.answer; the
    same dotted keys find the test file's prompts and answers (accuracy) and its completions (held-out loss)."""
    from grpolab.jobs.sft import run_sft
    rows = [{"extra_info": {"question": f"{a} plus {b}?", "answer": str(a + b)}} for a in range(4) for b in range(2)]
    f = _write(tmp_path / "train.jsonl", rows)
    summary = run_sft(load_config(None, [*TINY, "data.task=files", f"data.train_path={f}", f"data.test_path={f}",
                                         "data.prompt_key=extra_info.question", "data.response_key=extra_info.answer",
                                         "data.answer_key=extra_info.answer", "sft.steps=2", "sft.batch_size=8",
                                         f"train.output_dir={tmp_path / 'run'}"]))
    assert set(summary["after"]) == {"greedy_accuracy", "pass@1", "loss"}
    # 8 rows a step, each learning its answer's characters and the stop token
    assert [m["tokens"] for m in _metrics(tmp_path / "run")] == [sum(len(r["extra_info"]["answer"]) + 1
                                                                     for r in rows)] * 2
