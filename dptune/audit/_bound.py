"""From correct membership guesses to an ε lower bound: Steinke, Nasr & Jagielski (NeurIPS 2023).

The one-run game (their Algorithm 1): each of ``m`` canaries is included in the training data independently
with probability 1/2; after one run the auditor guesses "in" for some canaries, "out" for others and abstains
on the rest (``r`` guesses); ``v`` of the guesses are correct. If the training algorithm is (ε, δ)-DP with
respect to each canary, then (their main theorem; for δ = 0 the number of correct guesses is stochastically
dominated by Binomial(r, e^ε / (1 + e^ε))):

    P[V >= v] <= P[Binomial(r, p_ε) >= v] + 2 m δ · max_{1<=i<=v} P[v - i <= Binomial(r, p_ε) < v] / i,
    p_ε = e^ε / (1 + e^ε),

the p-value computed by their Appendix D (``p_value_DP_audit``). The ε lower bound at confidence 1 − β is the
largest ε whose p-value is still below β: every (ε', δ) claim with ε' below it is rejected at level β.

Pure functions, no torch: numpy and scipy only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import optimize, special, stats

__all__ = ["Audit", "Guesses", "audit_epsilon", "bonferroni_guesses", "epsilon_lower_bound", "guess_grid", "guesses",
           "p_value"]


def _check_counts(canaries: int, guesses: int, correct: int) -> None:
    for name, value in (("canaries", canaries), ("guesses", guesses), ("correct", correct)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer):
            raise TypeError(f"{name} must be an int, got {value!r}")
    if not 0 <= correct <= guesses <= canaries:
        raise ValueError(f"need 0 <= correct <= guesses <= canaries, got {correct}, {guesses}, {canaries}")


def _check_delta(delta: float) -> None:
    if not 0 <= delta < 1:
        raise ValueError(f"delta must be in [0, 1), got {delta!r}")


def p_value(*, canaries: int, guesses: int, correct: int, epsilon: float, delta: float) -> float:
    """Probability of at least ``correct`` correct guesses out of ``guesses`` (m = ``canaries``) under an
    (``epsilon``, ``delta``)-DP algorithm: the bound above (Steinke et al. 2023, App. D), capped at 1."""
    _check_counts(canaries, guesses, correct)
    _check_delta(delta)
    if not (math.isfinite(epsilon) and epsilon >= 0):
        raise ValueError(f"epsilon must be finite and >= 0, got {epsilon!r}")
    p = float(special.expit(epsilon))  # e^ε / (1 + e^ε): the accuracy of ε-DP randomized response
    tail = float(stats.binom.sf(correct - 1, guesses, p))  # P[Binomial(r, p) >= v]
    if delta == 0 or correct == 0:
        return min(tail, 1.0)
    # P[v - i <= Binomial < v] for i = 1..v, as cumulative sums of the pmf (the paper's own procedure)
    below = np.cumsum(stats.binom.pmf(np.arange(correct - 1, -1, -1), guesses, p))
    alpha = float(np.max(below / np.arange(1, correct + 1)))
    return min(tail + alpha * delta * 2 * canaries, 1.0)


def epsilon_lower_bound(*, canaries: int, guesses: int, correct: int, delta: float,
                        confidence: float = 0.95, tolerance: float = 1e-7) -> float:
    """The largest ε (to ``tolerance``, rounded down) such that ``correct`` of ``guesses`` correct guesses
    on ``canaries`` canaries reject (ε, ``delta``)-DP at level β = 1 − ``confidence``; 0 if even ε = 0 is
    not rejected. The p-value grows with ε, so this is a bisection on ε (the paper's ``get_eps_audit``)."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    beta = 1.0 - confidence

    def gap(eps: float) -> float:  # > 0 while (eps, delta) is rejected
        return beta - p_value(canaries=canaries, guesses=guesses, correct=correct, epsilon=eps, delta=delta)

    if gap(0.0) <= 0:
        return 0.0
    lo, hi = 0.0, 1.0
    while gap(hi) > 0:  # terminates: as ε grows, P[Binomial(r, p_ε) >= v] -> 1 > β for every v <= r
        lo, hi = hi, 2 * hi
    root = float(optimize.brentq(gap, lo, hi, xtol=tolerance))
    while root > 0 and gap(root) <= 0:  # report a rejected ε (the low side of the root), never above it
        root = max(0.0, root - tolerance)
    return root


@dataclass(frozen=True)
class Guesses:
    """The auditor's guesses: "in" on the ``k_plus`` highest scores, "out" on the ``k_minus`` lowest."""

    canaries: int
    k_plus: int
    k_minus: int
    correct: int

    @property
    def guesses(self) -> int:
        return self.k_plus + self.k_minus


def guesses(scores: Sequence[float] | np.ndarray, included: Sequence[bool] | np.ndarray, *, k_plus: int,
            k_minus: int) -> Guesses:
    """Guess "in" on the ``k_plus`` highest and "out" on the ``k_minus`` lowest ``scores`` (abstain on the
    rest) and count the correct guesses against the true inclusion bits. Ties are broken by a stable sort
    of the canary order, which is independent of the inclusion bits."""
    s = np.asarray(scores, dtype=np.float64)
    inc = np.asarray(included, dtype=bool)
    if s.shape != inc.shape or s.ndim != 1:
        raise ValueError(f"scores and included must be 1-d of one length, got {s.shape} and {inc.shape}")
    if not np.isfinite(s).all():
        raise ValueError("every score must be finite")
    m = len(s)
    if k_plus < 0 or k_minus < 0 or k_plus + k_minus > m:
        raise ValueError(f"need k_plus, k_minus >= 0 and k_plus + k_minus <= {m}, got {k_plus}, {k_minus}")
    order = np.argsort(s, kind="stable")  # ascending
    low, high = order[:k_minus], order[m - k_plus:]
    correct = int(inc[high].sum()) + int((~inc[low]).sum())
    return Guesses(canaries=m, k_plus=k_plus, k_minus=k_minus, correct=correct)


def guess_grid(m: int) -> list[tuple[int, int]]:
    """The (k+, k−) pairs an audit of ``m`` canaries tries, fixed before any score is seen: r = 1 %, 3 %,
    10 %, 30 %, 100 % of m guesses split evenly between "in" and "out", and r = 1 %, 3 %, 10 %, 30 % of m
    guesses "in" only (a canary that was included but rarely sampled looks excluded: confidence lives in
    the highest scores)."""
    pairs = {(max(1, round(f * m / 2)), max(1, round(f * m / 2))) for f in (0.01, 0.03, 0.1, 0.3)}
    pairs.add((m - m // 2, m // 2))
    pairs |= {(max(1, round(f * m)), 0) for f in (0.01, 0.03, 0.1, 0.3)}
    return sorted(p for p in pairs if p[0] + p[1] <= m)


def bonferroni_guesses(scores: Sequence[float] | np.ndarray, included: Sequence[bool] | np.ndarray, *,
                       ks: Sequence[tuple[int, int]], confidence: float) -> tuple[list[Guesses], float]:
    """The guesses of every (k+, k−) in ``ks`` (fixed before the scores were seen) and the significance level of
    each test when the best one is reported at ``confidence``: (1 − confidence) / len(ks) (Bonferroni)."""
    if not ks:
        raise ValueError("ks must name at least one (k_plus, k_minus) pair")
    tried = [guesses(scores, included, k_plus=k_plus, k_minus=k_minus) for k_plus, k_minus in ks]
    return tried, (1.0 - confidence) / len(ks)


@dataclass(frozen=True)
class Audit:
    """An ε lower bound and the guesses it came from (``tried``: the number of (k+, k−) pairs the
    confidence was split over)."""

    epsilon: float
    guesses: Guesses
    tried: int
    confidence: float


def audit_epsilon(scores: Sequence[float] | np.ndarray, included: Sequence[bool] | np.ndarray, *,
                  ks: Sequence[tuple[int, int]], delta: float, confidence: float = 0.95) -> Audit:
    """The ε lower bound at ``confidence`` from ``scores`` (higher = more likely included).

    Each (k+, k−) in ``ks`` (fixed before looking at the scores) is one test; the largest bound over them is
    reported with the confidence split evenly (Bonferroni: each test at level β / len(ks)), so the reported
    bound keeps its 1 − β guarantee although the best k was chosen after the fact."""
    tried, alpha = bonferroni_guesses(scores, included, ks=ks, confidence=confidence)
    level = 1.0 - alpha
    best: Audit | None = None
    for g in tried:
        eps = epsilon_lower_bound(canaries=g.canaries, guesses=g.guesses, correct=g.correct, delta=delta,
                                  confidence=level)
        if best is None or eps > best.epsilon:
            best = Audit(epsilon=eps, guesses=g, tried=len(ks), confidence=confidence)
    assert best is not None
    return best
