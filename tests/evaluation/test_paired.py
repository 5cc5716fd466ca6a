"""Paired accuracy differences against an independent computation (numpy and scipy on known vectors)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from ghosted_core.evaluation.paired import mcnemar_exact, mean_difference, paired_difference


def outcomes(n: int, p: float, seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).random(n) < p).astype(int)


@pytest.mark.parametrize("n, seed", [(40, 0), (400, 1), (1267, 2)])
def test_the_paired_difference_is_the_mean_and_sample_error_of_per_example_differences(n, seed):
    a = outcomes(n, 0.7, seed)
    b = np.where(np.random.default_rng(seed + 10).random(n) < 0.8, a, 1 - a)  # correlated, as two variants are
    d = paired_difference(a, b)
    diffs = a - b
    assert d.diff == pytest.approx(diffs.mean())
    assert d.stderr == pytest.approx(stats.sem(diffs))  # scipy: sd with n − 1, over √n
    z = stats.norm.ppf(0.975)
    assert (d.low, d.high) == pytest.approx((diffs.mean() - z * stats.sem(diffs), diffs.mean() + z * stats.sem(diffs)))
    a_only, b_only = int(((a == 1) & (b == 0)).sum()), int(((a == 0) & (b == 1)).sum())
    assert (d.a_only, d.b_only) == (a_only, b_only)
    assert d.p_value == pytest.approx(stats.binomtest(a_only, a_only + b_only, 0.5).pvalue)
    # the paired error is far below the unpaired √(se_a² + se_b²) when outcomes are correlated
    assert d.stderr < 0.8 * math.hypot(stats.sem(a), stats.sem(b))


@pytest.mark.parametrize("a_only, b_only", [(0, 0), (0, 7), (3, 3), (12, 30), (1, 150)])
def test_mcnemar_exact_is_scipys_binomial_test(a_only, b_only):
    expected = 1.0 if a_only + b_only == 0 else stats.binomtest(a_only, a_only + b_only, 0.5).pvalue
    assert mcnemar_exact(a_only, b_only) == pytest.approx(expected, rel=1e-12)


def test_significance_is_the_interval_excluding_zero():
    same = outcomes(300, 0.6, 3)
    assert not paired_difference(same, same).significant and paired_difference(same, same).p_value == 1.0
    better = same.copy()
    better[np.flatnonzero(same == 0)[:40]] = 1  # 40 more right, none fewer
    d = paired_difference(better, same)
    assert d.significant and d.verdict() == "significant" and d.p_value < 1e-10


def test_the_mean_over_tasks_combines_independent_tasks():
    per_task = [paired_difference(outcomes(n, 0.6, s), outcomes(n, 0.55, s + 5)) for n, s in [(100, 0), (400, 1), (52, 2)]]
    m = mean_difference(per_task)
    assert m.diff == pytest.approx(np.mean([t.diff for t in per_task]))
    assert m.stderr == pytest.approx(np.sqrt(np.sum([t.stderr**2 for t in per_task])) / 3)
    assert m.p_value == pytest.approx(2 * stats.norm.sf(abs(m.diff) / m.stderr))
    assert m.n == 552 and m.test == "normal"


def test_unpaired_inputs_are_refused():
    with pytest.raises(ValueError, match="same examples"):
        paired_difference([1, 0, 1], [1, 0])
