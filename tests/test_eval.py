from itertools import combinations

import pytest

from grpolab.train.evaluate import pass_at_k


@pytest.mark.parametrize("n,c", [(8, 0), (8, 1), (8, 3), (8, 8), (5, 2)])
def test_pass_at_k_equals_fraction_of_k_subsets_with_a_correct_sample(n, c):
    samples = [1] * c + [0] * (n - c)
    for k in range(1, n + 1):
        subsets = list(combinations(range(n), k))
        want = sum(any(samples[i] for i in s) for s in subsets) / len(subsets)
        assert pass_at_k(n, c, k) == pytest.approx(want)


def test_pass_at_k_needs_enough_samples():
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


# Three problems, k = 4 samples each, scored by hand below.
ANSWERS = ["5", "7", "10"]
GREEDY = ["#### 5", "#### 7", "#### 9"]
SAMPLES = ["#### 5", "so #### 5", "#### 3", "no answer",       # 2 right; votes 5:2, 3:1 -> 5, right
           "#### 2", "#### 2", "#### 7", "#### 2.0",         # 1 right; votes 2:3, 7:1 -> 2, wrong
           "#### 10.0", "#### 9", "#### 10", "#### 9"]      # 2 right; 10:2, 9:2 tie -> 10 (seen first), right


def test_scores_of_fixed_samples_equal_the_hand_computed_values():
    from grpolab.train.evaluate import score_samples
    out, greedy_ok = score_samples(GREEDY, SAMPLES, ANSWERS, 4)
    assert greedy_ok == [True, True, False]
    c = [2, 1, 2]
    assert out["greedy_accuracy"] == pytest.approx(2 / 3)
    assert out["pass@1"] == pytest.approx(sum(x / 4 for x in c) / 3)            # 5/12
    # pass@2 = 1 - C(4-c, 2) / C(4, 2): 1 - 1/6, 1 - 3/6, 1 - 1/6
    assert out["pass@2"] == pytest.approx((5 / 6 + 1 / 2 + 5 / 6) / 3)
    assert out["pass@4"] == 1.0
    assert out["maj@4"] == pytest.approx(2 / 3)
    assert set(out) == {"greedy_accuracy", "pass@1", "pass@2", "pass@4", "maj@4"}


def test_maj_at_k_under_math_accuracy_votes_like_the_exact_check():
    """'#### 1/2', '#### 3/6' and \\boxed{\\frac{1}{2}} are one answer for math_accuracy's vote, as
    for its check: 3 votes against 2 for '3' (split, '3' would win the tie as the first seen)."""
    pytest.importorskip("math_verify")
    from grpolab.train.evaluate import score_samples
    samples = ["#### 3", "so \\boxed{\\frac{1}{2}}", "#### 1/2", "#### 3", "#### 3/6"]
    out, _ = score_samples(["#### 0.5"], samples, ["0.5"], 5, reward="math_accuracy")
    assert out["maj@5"] == 1.0 and out["pass@1"] == pytest.approx(3 / 5)


@pytest.mark.slow
def test_eval_every_rows_equal_grpolab_eval_of_that_checkpoint(tmp_path):
    """metrics.jsonl's eval/* at step 2 are what `grpolab eval` reports for checkpoints/step_2."""
    import json

    from conftest import run_cli
    from test_grpo import EASY
    run = tmp_path / "run"
    # a warm start long enough that some answers are right, so equal numbers are not all zeros
    args = [*EASY, "sft.steps=150", "eval.num_problems=16", "rollout.prompts_per_step=4", "eval.k=4",
            "train.max_steps=3",
            "train.eval_every=2", "train.save_every=2", "train.keep_checkpoints=0"]
    r = run_cli("train", *args, f"train.output_dir={run}")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    # eval_every's at step 2, and the final eval with the last step's row (as eval.json has it)
    assert [sorted(k for k in m if k.startswith("eval/")) != [] for m in rows] == [False, True, True]
    assert {k[5:]: v for k, v in rows[2].items() if k.startswith("eval/")} == \
        json.loads((run / "eval.json").read_text())
    logged = {k[5:]: v for k, v in rows[1].items() if k.startswith("eval/")}
    assert set(logged) == {"greedy_accuracy", "pass@1", "pass@2", "pass@4", "maj@4", "rewards/gsm8k_accuracy/mean"}
    r = run_cli("eval", str(run / "checkpoints" / "step_2"), "--out", str(tmp_path / "ev"), *args)
    assert r.returncode == 0, r.stderr
    assert 0 < logged["greedy_accuracy"] < 1 and 0 < logged["pass@1"] < logged["pass@4"]
    assert json.loads((tmp_path / "ev" / "eval.json").read_text()) == logged
    # and the samples it wrote score to those numbers by hand
    recs = [json.loads(line) for line in open(tmp_path / "ev" / "eval_samples.jsonl")]
    assert logged["greedy_accuracy"] == sum(r["greedy_correct"] for r in recs) / len(recs)


def test_eval_samples_do_not_depend_on_how_the_problems_are_split(tiny_gpt, tok):
    """Sample j of problem i is keyed by (seed, i, j): evaluating every 2nd problem on each of two
    'ranks' (row_ids given) gives every problem the samples of the whole run, whatever the batch size."""
    from grpolab.distributed import unstride
    from grpolab.train.evaluate import evaluate
    rows = [{"prompt": f"Tom has {i} pens and finds {i + 1} more.", "answer": str(2 * i + 1)} for i in range(7)]
    whole = evaluate(tiny_gpt, tok, rows, k=4, max_new_tokens=10, batch_size=8, seed=3)["samples"]
    parts = [evaluate(tiny_gpt, tok, rows[r::2], k=4, max_new_tokens=10, batch_size=4, seed=3,
                      row_ids=list(range(r, 7, 2)))["samples"] for r in range(2)]
    assert unstride(parts) == whole
    assert len({s for rec in whole for s in rec["samples"]}) > 7    # real samples, not one string repeated
