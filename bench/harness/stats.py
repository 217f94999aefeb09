"""Paired statistics of the tuning-value benches: a mode against the baseline (a) on the same rows."""

from __future__ import annotations

import math

import numpy as np


def paired_stats(diff: np.ndarray, reps: int = 10_000) -> tuple[float, float, float, float]:
    """mean, 95 % bootstrap CI (percentile), two-sided paired t-test p."""
    from scipy import stats

    n = len(diff)
    mean = float(diff.mean())
    if n < 2:
        return mean, math.nan, math.nan, math.nan
    rng = np.random.default_rng(12345)
    boot = diff[rng.integers(0, n, size=(reps, n))].mean(axis=1)
    lo, hi = np.percentile(boot, [2.5, 97.5])
    p = float(stats.ttest_rel(diff, np.zeros(n)).pvalue) if np.std(diff) > 0 else (0.0 if mean else 1.0)
    return mean, float(lo), float(hi), p


def gap_share(tuned: np.ndarray, a: np.ndarray, o: np.ndarray, reps: int = 10_000) -> tuple[float, float, float]:
    """(mean(tuned) − mean(a)) / (mean(o) − mean(a)) with a paired bootstrap 95 % CI over rows."""
    def share(idx: np.ndarray) -> float:
        den = float((o[idx] - a[idx]).mean())
        return float((tuned[idx] - a[idx]).mean()) / den if den > 0 else math.nan

    n = len(a)
    rng = np.random.default_rng(2024)
    boot = np.array([share(rng.integers(0, n, size=n)) for _ in range(reps)])
    boot = boot[np.isfinite(boot)]
    lo, hi = (np.percentile(boot, [2.5, 97.5]) if len(boot) else (math.nan, math.nan))
    return share(np.arange(n)), float(lo), float(hi)


def significance(lo: float, hi: float, p: float) -> str:
    """"yes": the CI of the paired mean difference excludes 0 above and p < 0.05; "worse": below; else "no"."""
    return "yes" if (lo > 0 and p < 0.05) else ("worse" if (hi < 0 and p < 0.05) else "no")
