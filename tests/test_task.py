import re

from grpolab.data.tasks.arithmetic import ArithmeticConfig, generate, warm_start_mixer
from grpolab.rewards.accuracy import gsm8k_accuracy


def test_solutions_are_correct_step_by_step():
    for row in generate("train", 300, seed=3):
        lines = row["answer"].split("\n")
        value = None
        for line in lines[:-1]:
            m = re.fullmatch(r"(\d+)([-+*])(\d+)=(\d+)", line)
            assert m, line
            a, op, b, c = int(m[1]), m[2], int(m[3]), int(m[4])
            assert c == {"+": a + b, "-": a - b, "*": a * b}[op]
            assert value is None or a == value  # each step starts from the previous result
            assert str(b) in row["prompt"] or op == "*"
            value = c
        assert lines[-1] == f"#### {value}"
        assert gsm8k_accuracy(None, [row["answer"]], [row["answer"]]) == [1.0]


def test_splits_are_disjoint_deterministic_and_respect_difficulty():
    cfg = ArithmeticConfig(min_ops=3, max_ops=3, max_operand=5, max_value=20)
    train = generate("train", 2000, seed=0, cfg=cfg)
    test = generate("test", 200, seed=0, cfg=cfg)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    assert generate("test", 200, seed=0, cfg=cfg) == test
    assert generate("test", 200, seed=1, cfg=cfg) != test
    for r in train:
        steps = r["answer"].split("\n")[:-1]
        assert len(steps) == 3
        nums = [int(x) for x in re.findall(r"\d+", r["answer"])]
        assert max(nums) <= 20


def test_warm_start_mixer_makes_bare_answers_only_from_its_step():
    rows = generate("train", 1000)
    mix = warm_start_mixer(0.5, from_step=3, seed=0)
    assert mix(rows, 0) == rows and mix(rows, 2) == rows   # before from_step: untouched
    mixed = mix(rows, 3)
    bare = [m for m in mixed if m["answer"].startswith("####")]
    assert 400 < len(bare) < 600
    for r, m in zip(rows, mixed):
        assert m["prompt"] == r["prompt"] and r["answer"].endswith(m["answer"])
    assert warm_start_mixer(0.5, 3, seed=0)(rows, 3) == mixed  # seeded
    assert warm_start_mixer(0.0)(rows, 5) == rows
