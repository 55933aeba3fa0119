"""Data edges a hostile user finds (issue 34): files that are not UTF-8 or nest too deeply, message
roles (one rule for training and the server), DPO pairs that do not fit the context, and the reward
model's held-out split. One line naming the file, line or row."""

import json

import pytest
from conftest import run_cli

from grpolab.config.load import load_config
from grpolab.data.loading import normalize_rows, read_records
from grpolab.data.messages import CHAT_ROLES
from grpolab.data.preference import fit_pairs, preference_rows
from grpolab.data.supervised import sft_rows
from grpolab.errors import DataError
from grpolab.models import CharTokenizer


def _one_line(r, kind, *want):
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("warning:")]
    assert len(lines) == 1 and lines[0].startswith(f"grpolab: {kind} error: "), r.stderr
    for text in want:
        assert text in lines[0], (text, lines[0])
    return lines[0]


ROW = json.dumps({"prompt": "Tom has 3 apples. How many?", "answer": "3"})


def test_non_utf8_jsonl_and_json_name_the_line(tmp_path):
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_bytes((ROW + "\n" + ROW + "\n").encode() + b'{"prompt": "caf\xe9", "answer": "1"}\n')
    with pytest.raises(DataError) as e:
        read_records(str(jsonl))
    col = len(b'{"prompt": "caf') + 1
    assert str(e.value) == (f"{jsonl}: line 3: not UTF-8 text (byte 0xe9 at byte {col} of the line); "
                            f"save the file as UTF-8")
    js = tmp_path / "rows.json"
    js.write_bytes(b"[\n" + ROW.encode() + b",\n" + b'{"prompt": "caf\xe9", "answer": "1"}\n]\n')
    with pytest.raises(DataError, match=r"rows\.json: line 3: not UTF-8 text \(byte 0xe9"):
        read_records(str(js))
    bom = tmp_path / "bom.jsonl"   # a UTF-8 byte-order mark is fine
    bom.write_bytes(b"\xef\xbb\xbf" + ROW.encode() + b"\n")
    assert read_records(str(bom)) == [json.loads(ROW)]


def test_cli_names_the_non_utf8_line(tmp_path):
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_bytes((ROW + "\n").encode() + b'{"prompt": "\xff", "answer": "1"}\n')
    r = run_cli("train", "data.task=files", f"data.train_path={jsonl}", f"data.test_path={jsonl}",
                f"train.output_dir={tmp_path / 'run'}", timeout=120)
    _one_line(r, "data", f"{jsonl}: line 2: not UTF-8 text (byte 0xff")


def test_deeply_nested_json_names_the_file_and_line(tmp_path):
    deep = "[" * 100000 + "]" * 100000
    jsonl = tmp_path / "deep.jsonl"
    jsonl.write_text(ROW + "\n" + ROW + "\n" + '{"prompt": "a", "answer": "1", "x": ' + deep + "}\n")
    with pytest.raises(DataError) as e:
        read_records(str(jsonl))
    assert str(e.value).startswith(f"{jsonl}: line 3: JSON nested too deeply to read"), str(e.value)
    js = tmp_path / "deep.json"   # brackets inside strings do not count towards the line
    js.write_text("[\n" + ROW + ",\n" + '{"prompt": "[[[[{{", "answer": "1",\n "x": ' + deep + "}\n]\n")
    with pytest.raises(DataError) as e:
        read_records(str(js))
    assert str(e.value).startswith(f"{js}: line 4: JSON nested too deeply to read"), str(e.value)
    r = run_cli("train", "data.task=files", f"data.train_path={jsonl}", f"data.test_path={jsonl}",
                f"train.output_dir={tmp_path / 'run'}", timeout=120)
    _one_line(r, "data", f"{jsonl}: line 3: JSON nested too deeply")


# ---------------------------------------------------------------- roles: one rule with the server

def _server_accepts(role) -> bool:
    """The real server's request check (serve/requests.py), on the built-in tokenizer: whether the role is
    refused (a tool message is also refused without the tool call it answers, which is not about its role)."""
    from grpolab.serve.requests import APIError, ChatRequest, Server
    server = Server(None, CharTokenizer(), "m", 160)
    try:
        server.chat_prompt(ChatRequest(model="m", messages=[{"role": role, "content": "hi"},
                                                            {"role": "user", "content": "2+2?"}]))
    except APIError as e:
        return not e.param.endswith(".role")
    return True


def _training_accepts(role) -> bool:
    msgs = [{"role": role, "content": "hi"}, {"role": "user", "content": "2+2?"}]
    try:
        normalize_rows([{"prompt": msgs, "answer": "4"}], source="rows.jsonl")
    except DataError as e:
        if isinstance(role, str):   # (a role that is no string fails the message shape check before this one)
            assert str(e) == ("rows.jsonl: row 1: prompt message 0: role must be one of system, developer, user, "
                              f"assistant, tool, got {role!r}"), str(e)
        return False
    return True


@pytest.mark.parametrize("role", [*CHAT_ROLES, "robot", "function", "ipython", "System", "", 7])
def test_training_and_the_server_accept_the_same_roles(role):
    pytest.importorskip("fastapi")
    assert _training_accepts(role) == _server_accepts(role) == (role in CHAT_ROLES)


def test_roles_are_checked_in_sft_and_preference_rows_and_developer_is_system():
    with pytest.raises(DataError, match=r"^s\.jsonl: row 2: column 'messages' message 1: role must be one of .* "
                                        r"got 'bot'$"):
        sft_rows([{"prompt": "a", "completion": "b"},
                  {"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]}], source="s.jsonl")
    with pytest.raises(DataError, match=r"^p\.jsonl: row 1: 'rejected' message 0: role must be one of .* got 'model'$"):
        preference_rows([{"prompt": "p", "chosen": [{"role": "assistant", "content": "a"}],
                          "rejected": [{"role": "model", "content": "b"}]}], source="p.jsonl")
    rows = normalize_rows([{"prompt": [{"role": "developer", "content": "Be brief."},
                                       {"role": "user", "content": "2+2?"}], "answer": "4"}],
                          system_prompt="Another system prompt")
    # rendered as the server renders it: a system message, and the row's own system message wins
    assert rows[0]["prompt"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]


def test_cli_refuses_an_unknown_role_in_one_line(tmp_path):
    f = tmp_path / "chat.jsonl"
    f.write_text(json.dumps({"prompt": [{"role": "narrator", "content": "2+2?"}], "answer": "4"}) + "\n")
    r = run_cli("train", "data.task=files", f"data.train_path={f}", f"data.test_path={f}",
                f"train.output_dir={tmp_path / 'run'}", timeout=120)
    _one_line(r, "data", f"{f}: row 1: prompt message 0: role must be one of", "got 'narrator'")


# ---------------------------------------------------------------- DPO pairs longer than the context

def _pairs(n_long: int, n_short: int) -> list[dict]:
    long = [{"prompt": "x" * 300 + str(i), "chosen": " 1", "rejected": " 2"} for i in range(n_long)]
    short = [{"prompt": f"What is {i}+1?", "chosen": f" {i + 1}", "rejected": " 0"} for i in range(n_short)]
    return preference_rows(long + short, source="pairs.jsonl")


def test_fit_pairs_drops_pairs_whose_prompt_fills_the_context_and_names_them_when_none_fit():
    tok = CharTokenizer()
    pairs = _pairs(2, 3)
    kept, dropped = fit_pairs(pairs, tok, 160, source="pairs.jsonl")
    assert kept == pairs[2:] and dropped == [1, 2]
    # by hand: <|bos|><|user|> + 301 or 302 characters + <|assistant|> leave nothing of a 160-token context
    with pytest.raises(DataError) as e:
        fit_pairs(_pairs(7, 0), tok, 160, source="pairs.jsonl")
    assert str(e.value) == ("pairs.jsonl: no pair fits the model's context of 160 tokens: the prompts (tokens, "
                            "template included) of row 1 (304), row 2 (304), row 3 (304), row 4 (304), row 5 (304) "
                            "and 2 more leave no room for a chosen or rejected token; shorten the prompts or use a "
                            "model with a longer context")
    # a prompt that leaves room for one completion token keeps the pair
    assert fit_pairs(_pairs(1, 1), tok, 305)[1] == [] and fit_pairs(_pairs(1, 1), tok, 304)[1] == [1]


def test_dpo_with_every_prompt_longer_than_the_context_is_one_data_line(tmp_path):
    f = tmp_path / "long.jsonl"
    f.write_text("".join(json.dumps(p) + "\n" for p in _pairs(6, 0)))
    r = run_cli("dpo", f"dpo.pairs={f}", "dpo.steps=2", "dpo.batch_size=2", "model.n_layer=1", "model.n_embd=32",
                "model.n_head=2", "data.test_size=4", "eval.num_problems=2", f"train.output_dir={tmp_path / 'run'}",
                timeout=120)
    _one_line(r, "data", f"{f}: no pair fits the model's context of 160 tokens", "row 1 (304)")
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_rm_holds_out_a_tenth_of_a_small_pair_file_by_default(tmp_path):
    from grpolab.jobs.rm import rm_pairs
    f = tmp_path / "pairs.jsonl"
    f.write_text("".join(json.dumps({"prompt": f"q{i}", "chosen": "a", "rejected": "b"}) + "\n" for i in range(30)))
    train, held = rm_pairs(load_config(None, [f"rm.pairs={f}"]))
    assert (len(train), len(held)) == (27, 3)
    train, held = rm_pairs(load_config(None, [f"rm.pairs={f}", "rm.eval_size=5"]))
    assert (len(train), len(held)) == (25, 5)
