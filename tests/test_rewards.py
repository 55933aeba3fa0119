import json

import pytest

from grpolab.rewards import get_reward
from grpolab.rewards.answers import extract_hash_answer, gsm8k_accuracy
from grpolab.rewards.combine import RewardError, score
from conftest import GSM8K_DIR


@pytest.mark.parametrize("completion,answer,want", [
    ("2+3=5\n#### 5", "#### 5", 1.0),
    ("#### 1,234", "1234", 1.0),
    ("#### $1,234.00.", "#### 1234", 1.0),
    ("####   -7  ", "-7", 1.0),
    ("#### 7 apples", "7", 1.0),
    ("#### 3.50", "3.5", 1.0),
    ("#### 5\n#### 6", "6", 1.0),       # the last '####' counts
    ("#### 5\n#### 6", "5", 0.0),
    ("the answer is 5", "5", 0.0),      # no '####' line
    ("####", "5", 0.0),                  # '####' with no number
    ("#### -5", "5", 0.0),
    ("#### 12", "Natalia sold 48/2 = 24 clips.\n#### 72", 0.0),
    ("#### 72", "Natalia sold 48/2 = 24 clips.\n#### 72", 1.0),
    ("", "0", 0.0),
])
def test_gsm8k_accuracy_tricky_answers(completion, answer, want):
    assert gsm8k_accuracy(["p"], [completion], [answer]) == [want]


def test_gsm8k_accuracy_on_real_gsm8k_references():
    path = GSM8K_DIR / "test.jsonl"
    if not path.exists():
        pytest.skip("GSM8K files not present beside the repository")
    rows = [json.loads(line) for line in path.open()][:200]
    refs = [r["answer"] for r in rows]
    finals = [r["answer"].split("####")[-1].strip() for r in rows]
    assert gsm8k_accuracy(None, [f"#### {f}" for f in finals], refs) == [1.0] * len(rows)
    wrong = [f"#### {extract_hash_answer(r) + 1}" for r in refs]
    assert gsm8k_accuracy(None, wrong, refs) == [0.0] * len(rows)


def test_format_reward_and_registry():
    fmt = get_reward("format")
    assert fmt(None, ["1+1=2\n#### 2", "#### x", "2", "#### -3."]) == [1.0, 0.0, 0.0, 1.0]
    with pytest.raises(KeyError, match="unknown reward 'nope'.*gsm8k_accuracy"):
        get_reward("nope")


def test_weighted_sum_and_none_means_not_applicable(monkeypatch):
    from grpolab import rewards
    monkeypatch.setitem(rewards.REWARDS, "half", lambda prompts, completions, **_: [None, 0.5])
    total, per = score(["gsm8k_accuracy", "half"], [2.0, 1.0], ["a", "b"], ["#### 1", "#### 3"],
                       {"answer": ["1", "2"]})
    assert total.tolist() == [2.0, 0.5]
    assert per["gsm8k_accuracy"].tolist() == [1.0, 0.0]
    assert per["half"][0].isnan() and per["half"][1] == 0.5


@pytest.mark.parametrize("fn,msg", [
    (lambda prompts, completions, **_: 1 / 0, r"'bad' raised ZeroDivisionError"),
    (lambda prompts, completions, **_: [1.0], r"'bad' returned 1 values for 2 completions"),
    (lambda prompts, completions, **_: [1.0, float("nan")], r"'bad' returned nan for sample 1"),
    (lambda prompts, completions, **_: ["x", 1.0], r"'bad' returned 'x' for sample 0"),
])
def test_reward_errors_name_the_function_and_sample(monkeypatch, fn, msg):
    from grpolab import rewards
    monkeypatch.setitem(rewards.REWARDS, "bad", fn)
    with pytest.raises(RewardError, match=msg):
        score(["bad"], None, ["a", "b"], ["x", "y"], {})
