"""Synthetic code problems: write a one-line Python function from a description and examples.

    prompt:  def g(nums, k=3):
                 \"\"\"Add k to each.
                 g([1, 5]) == [4, 8]
                 \"\"\"
    answer:      return [x + k for x in nums]

The prompt is code (a function with only its docstring, HumanEval's shape): the model continues it
with the body, and the program is prompt + completion. Hidden tests (`test`, defining
check(candidate), and `entry_point`) call the function on 5 other inputs; the code_exec reward runs
them in the sandbox. Lists and integers: reverse, sort, sum of evens, max minus min, add/multiply/
filter/count by a constant `k` (a parameter with a default: the body names it, no digit to copy), ...

Train and test are disjoint by construction: a problem is (operation, constant, function name,
argument name), and its split is fixed by a hash of that, so a held-out problem is never seen
in training under any seed or size (its operation and constant are, under other names).
"""

from __future__ import annotations

import random

from .arithmetic import split_of

# (key, description, body with {a} = argument, {k} = constant or None, kind: 'list' | 'int')
OPERATIONS = [
    ("add", "Add k to each.", "[x + k for x in {a}]", "list"),
    ("mul", "Multiply each by k.", "[x * k for x in {a}]", "list"),
    ("above", "Keep those above k.", "[x for x in {a} if x > k]", "list"),
    ("below", "Keep those below k.", "[x for x in {a} if x < k]", "list"),
    ("first", "First k items.", "{a}[:k]", "list"),
    ("last", "Last k items.", "{a}[-k:]", "list"),
    ("count", "How many equal k.", "{a}.count(k)", "list"),
    ("count_above", "How many are above k.", "len([x for x in {a} if x > k])", "list"),
    ("reverse", "Reverse it.", "{a}[::-1]", "list"),
    ("sort", "Sort it.", "sorted({a})", "list"),
    ("sort_desc", "Sort it, largest first.", "sorted({a}, reverse=True)", "list"),
    ("square", "Square each.", "[x * x for x in {a}]", "list"),
    ("evens", "Keep the even ones.", "[x for x in {a} if x % 2 == 0]", "list"),
    ("odds", "Keep the odd ones.", "[x for x in {a} if x % 2 == 1]", "list"),
    ("sum", "Sum them.", "sum({a})", "list"),
    ("sum_evens", "Sum of the even ones.", "sum(x for x in {a} if x % 2 == 0)", "list"),
    ("spread", "Max minus min.", "max({a}) - min({a})", "list"),
    ("max", "The largest.", "max({a})", "list"),
    ("min", "The smallest.", "min({a})", "list"),
    ("len", "How many items.", "len({a})", "list"),
    ("plus", "Add k.", "{a} + k", "int"),
    ("times", "Multiply by k.", "{a} * k", "int"),
    ("mod", "Remainder after dividing by k.", "{a} % k", "int"),
    ("square_n", "Square it.", "{a} * {a}", "int"),
]
FUNCTIONS = ("f", "g", "h")
ARGS = {"list": ("xs", "nums"), "int": ("n", "m")}
N_EXAMPLES, N_TESTS = 1, 5


def problems(split: str, test_fraction: float = 0.2) -> list[tuple]:
    """Every (operation, k, function, argument) of `split`, in a fixed order."""
    out = []
    for op in OPERATIONS:
        ks = range(2, 10) if "k" in op[2].replace("{a}", "") else [None]
        for k in ks:
            for fn in FUNCTIONS:
                for arg in ARGS[op[3]]:
                    if split_of(f"{op[0]}/{k}/{fn}/{arg}", test_fraction) == split:
                        out.append((op, k, fn, arg))
    return out


def _input(rng: random.Random, kind: str):
    if kind == "int":
        return rng.randint(0, 20)
    return [rng.randint(0, 9) for _ in range(rng.randint(1, 5))]


def _has_k(op: tuple) -> bool:
    return "k" in op[2].replace("{a}", "")


def make_row(problem: tuple, rng: random.Random) -> dict:
    (key, desc, body, kind), k, fn, arg = problem
    expr = body.format(a=arg)
    solve = eval(f"lambda {arg}, k={k}: {expr}")   # noqa: S307 - our own template, not data
    inputs = []
    while len(inputs) < N_EXAMPLES + N_TESTS:   # distinct inputs: the tests are not the examples
        x = _input(rng, kind)
        if x not in inputs:
            inputs.append(x)
    examples = "".join(f"    {fn}({x!r}) == {solve(x)!r}\n" for x in inputs[:N_EXAMPLES])
    params = f"{arg}, k={k}" if k is not None else arg
    prompt = f'def {fn}({params}):\n    """{desc}\n{examples}    """\n'
    test = "def check(candidate):\n" + "".join(f"    assert candidate({x!r}) == {solve(x)!r}\n"
                                              for x in inputs[N_EXAMPLES:])
    return {"prompt": prompt, "answer": f"    return {expr}", "test": test, "entry_point": fn, "operation": key,
            "constant": k}


def guess_body(row: dict, rng: random.Random, key: str = "answer") -> dict:
    """The same problem with the body (column `key`) of another operation of the same shape (list or
    integer argument, with or without k): a guess where the description says which."""
    head = row["prompt"].split("\n", 1)[0]          # def f(xs, k=3):
    arg = head.split("(", 1)[1].split(",")[0].split(")")[0]
    with_k = ", k=" in head
    kind = "list" if arg in ARGS["list"] else "int"
    bodies = [f"    return {o[2].format(a=arg)}" for o in OPERATIONS if o[3] == kind and _has_k(o) == with_k]
    others = [b for b in bodies if b != row[key]]
    return {**row, key: rng.choice(others)} if others else row


def warm_start_mixer(guess_fraction: float, from_step: int = 0, seed: int = 0, key: str = "answer"):
    """SFT batch hook: from step `from_step` on, a seeded `guess_fraction` of answers (column `key`)
    are another operation's body. As the arithmetic demo's bare answers: the warm-started model knows
    which body the description asks for but often writes another, and RL has to find that reading
    the description pays."""
    rng = random.Random(f"warm_start/pyfunc/{seed}")

    def mix(batch: list[dict], step: int) -> list[dict]:
        if step < from_step:
            return batch
        return [guess_body(r, rng, key) if rng.random() < guess_fraction else r for r in batch]
    return mix


def generate(split: str, n: int, seed: int = 0, test_fraction: float = 0.2) -> list[dict]:
    """n distinct rows of `split` ('train' or 'test'), deterministic in (split, n, seed): problems are
    drawn in turn from a seeded shuffle, each with its own random examples and hidden tests."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    pool = problems(split, test_fraction)
    rng = random.Random(f"pyfunc/{split}/{seed}")
    rows, seen, tries = [], set(), 0
    while len(rows) < n:
        tries += 1
        if tries > 50 * n + 10_000:
            raise ValueError(f"could not find {n} distinct {split} problems; lower data.train_size/test_size")
        row = make_row(pool[rng.randrange(len(pool))], rng)
        if row["prompt"] not in seen:
            seen.add(row["prompt"])
            rows.append(row)
    return rows
