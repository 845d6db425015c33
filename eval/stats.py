"""Statistics of pass@k: the unbiased estimator and the intervals that compare two methods.

* :func:`pass_at_k` -- the unbiased pass@k estimator of Chen et al. (2021);
* :func:`paired_diff_ci` -- a confidence interval for the pass@1 difference of two methods on the
  same problems (Tango's paired score interval by default; Newcombe's or a paired bootstrap);
* :func:`bootstrap_mean_ci` -- the percentile bootstrap interval of a mean over problems.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

__all__ = ["PairedDiff", "bootstrap_mean_ci", "paired_diff_ci", "pass_at_k"]


def _count(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}: expected an int, got {value!r}")
    return value


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` are correct (Chen et al. 2021):
    ``1 - C(n - c, k) / C(n, k)``, computed as a product so large ``n`` does not overflow.
    Requires ``0 <= c <= n`` and ``1 <= k <= n``; ``pass_at_k(n, c, 1) == c / n``."""
    n, c, k = _count(n, "n"), _count(c, "c"), _count(k, "k")
    if n < 1:
        raise ValueError(f"n: expected at least 1 sample, got {n}")
    if not 0 <= c <= n:
        raise ValueError(f"c: expected 0 <= c <= n = {n}, got {c}")
    if not 1 <= k <= n:
        raise ValueError(f"k: expected 1 <= k <= n = {n}, got {k}")
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def bootstrap_mean_ci(values: Sequence[float], *, confidence: float = 0.95, n_resamples: int = 10_000,
                      seed: int = 0) -> tuple[float, float]:  # fmt: skip
    """The percentile bootstrap interval ``(low, high)`` of the mean of per-problem ``values`` (e.g.
    pass@k estimates, or paired differences): the ``(1 - confidence) / 2`` and ``(1 + confidence) /
    2`` quantiles of the mean over ``n_resamples`` resamplings of the problems with replacement,
    seeded by ``seed`` (the same values give the same interval). Zero width when all values are equal."""
    if not values:
        raise ValueError("values: expected at least one value, got none")
    if isinstance(confidence, bool) or not isinstance(confidence, (int, float)) or not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence: expected a number in (0, 1), got {confidence!r}")
    n_resamples = _count(n_resamples, "n_resamples")
    if n_resamples < 100:
        raise ValueError(f"n_resamples: expected at least 100, got {n_resamples}")
    import numpy as np

    rng = np.random.default_rng(seed)
    vals = np.asarray(values, dtype=np.float64)
    idx = rng.integers(0, len(vals), size=(n_resamples, len(vals)))
    means = vals[idx].mean(axis=1)
    alpha = 1.0 - confidence
    low, high = (float(x) for x in np.quantile(means, [alpha / 2, 1 - alpha / 2]))
    return low, high


@dataclass(frozen=True)
class PairedDiff:
    """A confidence interval for ``mean(a) - mean(b)`` over the same problems.

    Attributes:
        diff: the observed difference of pass rates (a minus b).
        low, high: the interval's bounds.
        confidence: its nominal coverage, e.g. 0.95.
        method: ``"tango"``, ``"newcombe"`` or ``"bootstrap"``.
        n: problems.
        a_better, b_better: problems where a scored higher (for 0/1 outcomes: a passed, b
            failed) / lower; the rest are ties. Only these discordant problems move the difference.
    """

    diff: float
    low: float
    high: float
    confidence: float
    method: str
    n: int
    a_better: int
    b_better: int


def _outcomes(values: Sequence[Any], name: str) -> list[float]:
    out = []
    for i, v in enumerate(values):
        v = getattr(v, "passed", v)  # an eval.execution.Verdict
        if isinstance(v, bool):
            v = float(v)
        if not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
            raise ValueError(f"{name}[{i}]: expected a bool, a Verdict or a pass rate in [0, 1], got {v!r}")
        out.append(float(v))
    return out


def _wilson(successes: float, n: int, z: float) -> tuple[float, float]:
    p = successes / n
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def _tango(b: int, c: int, n: int, z: float) -> tuple[float, float]:
    """Tango's (1998) score interval for p_b - p_c from b and c discordant pairs among n."""

    def score(delta: float) -> float:  # decreasing in delta
        qa, qb, qc = 2 * n, -b - c + (2 * n - b + c) * delta, -c * delta * (1 - delta)
        q = (math.sqrt(max(0.0, qb * qb - 4 * qa * qc)) - qb) / (2 * qa)  # constrained MLE of p_c
        var = n * (2 * q + delta * (1 - delta))
        num = b - c - n * delta
        if var <= 0:
            return 0.0 if num == 0 else math.copysign(math.inf, num)
        return num / math.sqrt(var)

    def solve(target: float) -> float:
        lo, hi = -1.0, 1.0
        for _ in range(100):
            mid = (lo + hi) / 2
            if score(mid) > target:
                lo = mid
            else:
                hi = mid
        return (lo + hi) / 2

    return solve(z), solve(-z)


def _newcombe(both: int, a_only: int, b_only: int, n: int, z: float) -> tuple[float, float]:
    """Newcombe's (1998) method 10: the paired square-and-add of two Wilson intervals."""
    neither = n - both - a_only - b_only
    p1, p2 = (both + a_only) / n, (both + b_only) / n
    l1, u1 = _wilson(both + a_only, n, z)
    l2, u2 = _wilson(both + b_only, n, z)
    margins = (both + a_only) * (b_only + neither) * (both + b_only) * (a_only + neither)
    phi = (both * neither - a_only * b_only) / math.sqrt(margins) if margins > 0 else 0.0
    d1, e1, d2, e2 = p1 - l1, u1 - p1, p2 - l2, u2 - p2
    diff = p1 - p2
    return (diff - math.sqrt(max(0.0, d1 * d1 - 2 * phi * d1 * e2 + e2 * e2)),
            diff + math.sqrt(max(0.0, e1 * e1 - 2 * phi * e1 * d2 + d2 * d2)))  # fmt: skip


def paired_diff_ci(
    a: Sequence[Any],
    b: Sequence[Any],
    *,
    confidence: float = 0.95,
    method: str = "tango",
    n_resamples: int = 10_000,
    seed: int = 0,
) -> PairedDiff:
    """Confidence interval for the difference of pass@1 of methods a and b on the same problems.

    ``a[i]`` and ``b[i]`` are the two methods' outcomes on problem i: bools (or
    :class:`Verdict` s), or, for ``method="bootstrap"``, per-problem pass rates in [0, 1] (e.g.
    ``c/n`` from n samples). The pairing matters: only problems one method solves and the other
    does not (``a_better``, ``b_better``) carry information about the difference.

    Methods:

    * ``"tango"`` (default; 0/1 outcomes): Tango's (1998) asymptotic score interval, the
      inversion of the score test for paired proportions, found by bisection. It contains 0
      exactly when McNemar's test (without continuity correction) does not reject at
      ``1 - confidence``, and stays sensible with few or no discordant problems (no
      discordant problems among n gives ``±z²/(n + z²)``). One of the intervals Fagerland,
      Lydersen & Laake (Stat. Med. 2014) found to perform well for paired proportions.
    * ``"newcombe"`` (0/1 outcomes): Newcombe's (1998) method 10, the square-and-add of the two
      Wilson score intervals corrected by the phi correlation of the pairs. Closed form, but it
      collapses towards zero width when no problem is discordant (e.g. two lossless decoders
      with identical outputs), so it overstates certainty there.
    * ``"bootstrap"``: the percentile interval of ``mean(a) - mean(b)`` over ``n_resamples``
      resamplings of the problems with replacement (pairs kept together), seeded by ``seed``;
      works for pass rates too; also zero width without discordant problems.
    """
    a_vals, b_vals = _outcomes(a, "a"), _outcomes(b, "b")
    if len(a_vals) != len(b_vals):
        raise ValueError(f"b: expected as many outcomes as a ({len(a_vals)}, the same problems), got {len(b_vals)}")
    n = len(a_vals)
    if n == 0:
        raise ValueError("a: expected outcomes for at least one problem, got none")
    if isinstance(confidence, bool) or not isinstance(confidence, (int, float)) or not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence: expected a number in (0, 1), got {confidence!r}")
    diff = (sum(a_vals) - sum(b_vals)) / n
    a_better = sum(x > y for x, y in zip(a_vals, b_vals))
    b_better = sum(x < y for x, y in zip(a_vals, b_vals))
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    if method in ("tango", "newcombe"):
        if any(v not in (0.0, 1.0) for v in a_vals + b_vals):
            raise ValueError(f"method: {method!r} needs 0/1 outcomes; use method='bootstrap' for pass rates")
        if method == "tango":
            low, high = _tango(a_better, b_better, n, z)
        else:
            both = sum(x == 1.0 and y == 1.0 for x, y in zip(a_vals, b_vals))
            low, high = _newcombe(both, a_better, b_better, n, z)
    elif method == "bootstrap":
        deltas = [x - y for x, y in zip(a_vals, b_vals)]
        low, high = bootstrap_mean_ci(deltas, confidence=confidence, n_resamples=n_resamples, seed=seed)
    else:
        raise ValueError(f"method: expected 'tango', 'newcombe' or 'bootstrap', got {method!r}")
    return PairedDiff(diff, max(-1.0, low), min(1.0, high), float(confidence), method, n, a_better, b_better)
