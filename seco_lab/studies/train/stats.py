"""Small statistics for the study: t-intervals over seeds, paired differences, and the power they give."""

from __future__ import annotations

import math

import numpy as np
from scipy import stats

__all__ = ["detectable_difference", "paired_difference", "t_interval"]


def t_interval(values, level: float = 0.95) -> tuple[float, float, float, int]:
    """(mean, low, high, n) of the Student-t interval mean +- t_{(1+level)/2, n-1} s / sqrt(n).

    Non-finite values (a diverged run) are dropped; with fewer than 2 left the bounds are NaN.
    """
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must lie in (0, 1), got {level}")
    x = np.asarray(values, dtype=np.float64)
    x = x[np.isfinite(x)]
    n = len(x)
    if n == 0:
        return math.nan, math.nan, math.nan, 0
    mean = float(x.mean())
    if n < 2:
        return mean, math.nan, math.nan, n
    half = float(stats.t.ppf((1 + level) / 2, n - 1) * x.std(ddof=1) / math.sqrt(n))
    return mean, mean - half, mean + half, n


def paired_difference(a, b, level: float = 0.95) -> dict[str, float]:
    """a - b paired by position (same seed): t-interval of the differences and the paired t-test p-value."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"paired samples must have the same shape, got {a.shape} and {b.shape}")
    d = a - b
    mean, lo, hi, n = t_interval(d, level)
    ok = d[np.isfinite(d)]
    p = float(stats.ttest_1samp(ok, 0.0).pvalue) if n >= 2 and ok.std() > 0 else math.nan
    return {"diff": mean, "diff_lo": lo, "diff_hi": hi, "n_pairs": n, "p_value": p}


def detectable_difference(sd: float, n: int, alpha: float = 0.05, power: float = 0.8) -> float:
    """Smallest true paired difference a two-sided paired t-test at ``alpha`` detects with probability
    ``power`` given the differences' standard deviation ``sd`` over ``n`` seeds (noncentral t, exact)."""
    if n < 2 or not np.isfinite(sd):
        return math.nan
    df, crit = n - 1, stats.t.ppf(1 - alpha / 2, n - 1)

    def power_at(delta):
        nc = delta / (sd / math.sqrt(n)) if sd > 0 else math.inf
        return stats.nct.sf(crit, df, nc) + stats.nct.cdf(-crit, df, nc)

    if sd == 0:
        return 0.0
    lo, hi = 0.0, sd
    while power_at(hi) < power:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if power_at(mid) < power else (lo, mid)
    return hi
