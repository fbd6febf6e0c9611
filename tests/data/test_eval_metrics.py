"""Held-out scores: the unbiased pass@k estimator against enumeration, and the record."""

import itertools
import math

import pytest
from hypothesis import given, strategies as st

from fnrl.data.eval_metrics import ProblemScore, eval_record, pass_at_k, sample_seed


def by_enumeration(n: int, c: int, k: int) -> float:
    """The share of k-subsets of n samples (c correct) holding a correct one."""
    samples = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


@given(st.integers(1, 9).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n),
                                                     st.integers(1, n))))
def test_pass_at_k_is_the_share_of_k_subsets_with_a_correct_sample(nck):
    n, c, k = nck
    assert pass_at_k(n, c, k) == pytest.approx(by_enumeration(n, c, k), abs=1e-12)


def test_pass_at_k_by_hand_and_at_scale():
    assert pass_at_k(4, 0, 1) == 0.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)            # pass@1 = c / n
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)       # 1 - C(3,2)/C(4,2)
    assert pass_at_k(4, 2, 4) == 1.0
    # Chen et al.'s formula with huge binomials: the product form stays finite.
    assert pass_at_k(1000, 10, 100) == pytest.approx(1 - math.comb(990, 100) / math.comb(1000, 100))


@pytest.mark.parametrize("n, c, k", [(4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)])
def test_pass_at_k_rejects_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match="pass_at_k"):
        pass_at_k(n, c, k)


def test_eval_record_has_greedy_pass_and_mean_at_k():
    scores = [ProblemScore(level=1, greedy=1.0, samples=(1.0, 0.0, 0.0, 0.0)),
              ProblemScore(level=1, greedy=0.0, samples=(0.0, 0.0, 0.0, 0.0)),
              ProblemScore(level=2, greedy=0.0, samples=(1.0, 1.0, 0.0, 1.0)),
              ProblemScore(level=2, greedy=1.0, samples=(0.2, 0.0, 0.0, 0.0))]  # 0.2: not solved
    record = eval_record(scores, k=4)
    assert record == {
        "accuracy": 0.5, "accuracy_level1": 0.5, "accuracy_level2": 0.5,
        "pass@4": 0.5,                                  # problems 0 and 2
        "mean@4": pytest.approx((1 + 3 + 0.2) / 16),    # every sample's reward
        "pass@1": pytest.approx((0.25 + 0 + 0.75 + 0) / 4),
        "num_problems": 4, "samples_per_problem": 4}


def test_eval_record_greedy_only_and_bad_input():
    record = eval_record([ProblemScore(level=3, greedy=1.0)], k=0)
    assert record == {"accuracy": 1.0, "accuracy_level3": 1.0, "num_problems": 1,
                      "samples_per_problem": 0}
    with pytest.raises(ValueError, match="no held-out problems"):
        eval_record([], k=0)
    with pytest.raises(ValueError, match="k=2"):
        eval_record([ProblemScore(level=1, greedy=0.0, samples=(1.0,))], k=2)


def test_sample_seeds_are_distinct_per_problem_and_sample():
    seeds = {sample_seed(7, i, j, 4) for i in range(10) for j in range(4)}
    assert len(seeds) == 40 and min(seeds) == 7
