"""eval.stats: the unbiased pass@k estimator against brute force, and the paired intervals
(Tango, Newcombe, bootstrap) against McNemar's test and by simulated coverage."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from eval import execution as E
from eval import stats as S


def test_pass_at_k_matches_brute_force():
    for n in range(1, 8):
        for c in range(n + 1):
            samples = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(samples, k))
                brute = sum(any(s) for s in subsets) / len(subsets)
                assert S.pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12), (n, c, k)
    for n in range(1, 20):  # known values: all correct -> 1, none -> 0, k = 1 -> c / n
        for k in range(1, n + 1):
            assert S.pass_at_k(n, n, k) == 1.0 and S.pass_at_k(n, 0, k) == 0.0
        assert all(S.pass_at_k(n, c, 1) == pytest.approx(c / n, abs=1e-12) for c in range(n + 1))
    assert S.pass_at_k(200, 13, 1) == pytest.approx(13 / 200)
    assert S.pass_at_k(10**6, 1, 10) == pytest.approx(1e-5, rel=1e-6)
    with pytest.raises(ValueError, match="n: expected at least 1 sample, got 0"):
        S.pass_at_k(0, 0, 1)
    with pytest.raises(ValueError, match="c: expected 0 <= c <= n"):
        S.pass_at_k(5, 6, 1)
    with pytest.raises(ValueError, match="k: expected 1 <= k <= n"):
        S.pass_at_k(5, 1, 6)


def test_paired_diff_ci_methods():
    same = [True, False] * 20
    ci = S.paired_diff_ci(same, same)
    assert (ci.method, ci.diff, ci.a_better, ci.b_better) == ("tango", 0.0, 0, 0)
    z2 = 1.959963984540054**2
    assert ci.high == pytest.approx(z2 / (40 + z2)) and ci.low == pytest.approx(-ci.high)  # no discordant problems
    assert S.paired_diff_ci(same, same, method="newcombe").high == pytest.approx(0.0, abs=1e-12)  # its documented collapse
    all_or_none = S.paired_diff_ci([True] * 30, [False] * 30)
    assert all_or_none.diff == 1.0 and 0.7 < all_or_none.low < all_or_none.high == 1.0
    a = [True] * 30 + [False] * 10
    b = [True] * 22 + [False] * 8 + [True] * 2 + [False] * 8
    for method in ("tango", "newcombe", "bootstrap"):
        ci = S.paired_diff_ci(a, b, method=method)
        assert (ci.n, ci.a_better, ci.b_better, ci.method) == (40, 8, 2, method)
        assert ci.diff == pytest.approx(0.15) and ci.low < ci.diff < ci.high and ci.high - ci.low < 0.4
    assert S.paired_diff_ci(a, b, method="bootstrap", seed=1) == S.paired_diff_ci(a, b, method="bootstrap", seed=1)
    rates = S.paired_diff_ci([0.5, 1.0, 0.25], [0.0, 1.0, 0.5], method="bootstrap")
    assert rates.diff == pytest.approx(0.25 / 3) and rates.a_better == 1 and rates.b_better == 1
    verdicts = [E.Verdict("p", "x", ok, "pass" if ok else "fail", 0.0) for ok in a]
    assert S.paired_diff_ci(verdicts, b) == S.paired_diff_ci(a, b)
    with pytest.raises(ValueError, match="'tango' needs 0/1 outcomes"):
        S.paired_diff_ci([0.5], [1.0])
    with pytest.raises(ValueError, match="b: expected as many outcomes as a"):
        S.paired_diff_ci([True], [True, False])
    with pytest.raises(ValueError, match="method: expected 'tango', 'newcombe' or 'bootstrap'"):
        S.paired_diff_ci([True], [True], method="wald")


def test_bootstrap_mean_ci():
    vals = [0.0, 0.25, 0.5, 1.0, 1.0, 0.75] * 5
    low, high = S.bootstrap_mean_ci(vals)
    assert low < sum(vals) / len(vals) < high and high - low < 0.4
    assert S.bootstrap_mean_ci(vals) == (low, high)  # seeded: reproducible
    assert S.bootstrap_mean_ci([0.5] * 7) == pytest.approx((0.5, 0.5))  # no spread, no width
    wide, narrow = S.bootstrap_mean_ci(vals, confidence=0.99), S.bootstrap_mean_ci(vals, confidence=0.5)
    assert wide[0] < low < narrow[0] < narrow[1] < high < wide[1]
    with pytest.raises(ValueError, match="values: expected at least one value, got none"):
        S.bootstrap_mean_ci([])
    with pytest.raises(ValueError, match="confidence: expected a number in \\(0, 1\\), got 1"):
        S.bootstrap_mean_ci([1.0], confidence=1)
    with pytest.raises(ValueError, match="n_resamples: expected at least 100, got 10"):
        S.bootstrap_mean_ci([1.0], n_resamples=10)


def test_tango_interval_agrees_with_mcnemar():
    """A score interval contains 0 exactly when the score test (McNemar's) does not reject."""
    n, z = 60, 1.959963984540054
    for a_only in range(0, 25):
        for b_only in range(0, 25 - a_only):
            a = [True] * a_only + [False] * b_only + [True] * 10 + [False] * (n - 10 - a_only - b_only)
            b = [False] * a_only + [True] * b_only + [True] * 10 + [False] * (n - 10 - a_only - b_only)
            ci = S.paired_diff_ci(a, b)
            stat = abs(a_only - b_only) / math.sqrt(a_only + b_only) if a_only + b_only else 0.0
            if abs(stat - z) > 1e-6:
                assert (ci.low <= 0 <= ci.high) == (stat < z), (a_only, b_only, ci)
            assert ci.low <= ci.diff <= ci.high


@pytest.mark.parametrize("method", ["tango", "newcombe"])
def test_paired_interval_covers_the_true_difference(method):
    rng = random.Random(0)
    n, reps, covered = 40, 1000, 0
    p_both, p_a_only, p_b_only = 0.45, 0.15, 0.05  # true difference 0.10, correlated outcomes
    for _ in range(reps):
        a, b = [], []
        for _ in range(n):
            u = rng.random()
            a.append(u < p_both + p_a_only)
            b.append(u < p_both or p_both + p_a_only <= u < p_both + p_a_only + p_b_only)
        ci = S.paired_diff_ci(a, b, method=method)
        covered += ci.low <= 0.10 <= ci.high
    assert 0.92 <= covered / reps <= 0.985, covered / reps
    narrow, wide = S.paired_diff_ci(a, b, confidence=0.5, method=method), S.paired_diff_ci(a, b, confidence=0.99, method=method)
    assert wide.low < narrow.low < narrow.high < wide.high
