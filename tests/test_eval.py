from itertools import combinations

import pytest

from grpolab.eval import pass_at_k


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
