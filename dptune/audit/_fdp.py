"""From correct guesses to a privacy lower bound through tradeoff functions: Mahloujifar, Melis & Chaudhuri,
"Auditing f-Differential Privacy in One Run" (ICML 2025, PMLR 267; arXiv 2410.22235); numbers below are the
ICML version's.

The one-run game is Steinke et al.'s (``_bound``): m canaries, each included with probability 1/2, one run, the
auditor guesses on ``guesses`` canaries (c' = r) and ``correct`` of them (c) are right. Where ``_bound`` turns an
(ε, δ)-DP claim into the tail of a binomial, this paper bounds the probability of c correct guesses under any
f-DP claim, f a tradeoff function, through its "blow-up" ``B(x) = 1 − f(x)`` (the most an event of probability x
under one neighbour can weigh under the other) and the recursion of their Algorithm 3 (valid by their
Theorem 3.2; k = 2 for membership, k options per canary in their reconstruction game), as their appendix code
``audit_rh_with_cap`` runs it, with the max that the printed algorithm omits (it only sharpens the bound):

    h_c = β,  r_c = α,  with α = γ (r/m) (c/r), β = γ (r/m) (r − c)/r,
    h_i = max(h_{i+1}, (k − 1) · B⁻¹(r_{i+1})),  r_i = r_{i+1} + i/(r − i) · (h_i − h_{i+1}),  i = c−1 … 0,

and the claim "f-DP" is rejected at level γ when r_0 + h_0 > r/m. The bound uses the whole tradeoff curve of the
claim instead of its (ε, δ) corner, so for mechanisms whose curve is Gaussian-like (DP-SGD) it is sharper.

Two families of claims are tested here:
- ``epsilon_delta``: f_{ε,δ}(α) = max(0, 1 − δ − e^ε α, e^{−ε}(1 − δ − α)) — a rigorous ε lower bound (any
  (ε', δ)-DP mechanism with ε' below it is rejected), directly comparable with ``_bound``. The paper writes
  (ε, δ)-DP as the first piece only (its Proposition 2.3); the second only raises B⁻¹ near 1, so the bound is
  never below the paper's, and on the observations of the tests it is the same;
- ``gaussian``: μ-GDP, f(α) = Φ(Φ⁻¹(1 − α) − μ) — a lower bound on μ (no μ'-GDP mechanism with μ' below it),
  reported also as the ε of μ-GDP at δ. That ε is a lower bound only for mechanisms whose tradeoff curve is
  Gaussian; DP-SGD's is close to it, which is why the paper reports it.

``tests/test_audit_fdp_paper.py`` checks this module against the paper's own numbers and code.

Pure functions, no torch: numpy and scipy only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import optimize, special

from dptune.audit._bound import bonferroni_guesses

__all__ = ["FdpAudit", "audit_fdp", "fdp_epsilon_lower_bound", "gdp_epsilon", "gdp_mu_lower_bound", "rejects"]

InverseBlowUp = Callable[[float], float]


def _inverse_blow_up_gaussian(mu: float) -> InverseBlowUp:
    # B(x) = 1 − f(x) = Φ(Φ⁻¹(x) + μ) for μ-GDP, so B⁻¹(y) = Φ(Φ⁻¹(y) − μ)
    return lambda y: float(special.ndtr(special.ndtri(y) - mu)) if y > 0 else 0.0


def _inverse_blow_up_epsilon_delta(epsilon: float, delta: float) -> InverseBlowUp:
    # B(x) = min(1, δ + e^ε x, 1 − e^{−ε}(1 − δ − x)); inverse of a min of increasing maps = max of inverses
    return lambda y: max(0.0, (y - delta) * math.exp(-epsilon), 1.0 - delta - math.exp(epsilon) * (1.0 - y))


def _check(canaries: int, guesses: int, correct: int, level: float) -> None:
    if not 0 <= correct <= guesses <= canaries or guesses == 0:
        raise ValueError(f"need 0 <= correct <= guesses <= canaries and guesses > 0, got {correct}, {guesses}, "
                         f"{canaries}")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level!r}")


def rejects(inverse_blow_up: InverseBlowUp, *, canaries: int, guesses: int, correct: int, level: float,
            alphabet: int = 2) -> bool:
    """Whether ``correct`` of ``guesses`` correct guesses on ``canaries`` canaries reject the f-DP claim whose
    inverse blow-up is given, at significance ``level`` (Mahloujifar et al. 2024, the recursion above)."""
    _check(canaries, guesses, correct, level)
    m, r, c = canaries, guesses, correct
    threshold = level * r / m
    h, s = threshold * (r - c) / r, threshold * c / r  # h_c = β, r_c = α
    # h_i and r_i never decrease as i falls, so the claim is rejected as soon as r_i + h_i > r/m (exact, and
    # it stops the recursion before it overflows: for strong claims it grows geometrically)
    for i in range(c - 1, -1, -1):
        if s + h > r / m:
            return True
        h_next = max(h, (alphabet - 1) * inverse_blow_up(s))
        s = s + (i / (r - i)) * (h_next - h)
        h = h_next
    return s + h > r / m


def _largest_rejected(test: Callable[[float], bool], start: float) -> float:
    """The largest parameter the (monotone) ``test`` still rejects; 0 when even ``start`` is not rejected."""
    if not test(start):
        return 0.0
    lo, hi = start, max(1.0, 2 * start)
    while test(hi):
        lo, hi = hi, 2 * hi
        if hi > 1e4:
            return lo
    while hi - lo > 1e-4 * max(hi, 1e-3):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if test(mid) else (lo, mid)
    return lo


def fdp_epsilon_lower_bound(*, canaries: int, guesses: int, correct: int, delta: float, level: float) -> float:
    """The largest ε such that every (ε', ``delta``)-DP claim with ε' <= ε is rejected at ``level``."""
    return _largest_rejected(lambda e: rejects(_inverse_blow_up_epsilon_delta(e, delta), canaries=canaries,
                                               guesses=guesses, correct=correct, level=level), 0.0)


def gdp_mu_lower_bound(*, canaries: int, guesses: int, correct: int, level: float) -> float:
    """The largest μ such that every μ'-GDP claim with μ' <= μ is rejected at ``level``."""
    return _largest_rejected(lambda mu: rejects(_inverse_blow_up_gaussian(mu), canaries=canaries, guesses=guesses,
                                                correct=correct, level=level), 1e-6)


def gdp_epsilon(mu: float, delta: float) -> float:
    """ε of μ-GDP at ``delta`` (Dong, Roth & Su 2022, Cor. 2.13): δ(ε) = Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2)."""
    if mu <= 0:
        return 0.0

    def gap(e: float) -> float:
        return float(special.ndtr(-e / mu + mu / 2) - math.exp(e) * special.ndtr(-e / mu - mu / 2)) - delta

    if gap(0.0) <= 0:
        return 0.0
    hi = 1.0
    while gap(hi) > 0:
        hi *= 2
    return float(optimize.brentq(gap, 0.0, hi, xtol=1e-10))


@dataclass(frozen=True)
class FdpAudit:
    """The f-DP audit of one set of scores: ``epsilon``, the rigorous (ε, δ) lower bound; ``mu``, the μ-GDP
    lower bound and ``gdp_epsilon`` its ε at δ (a lower bound for mechanisms with a Gaussian tradeoff curve);
    each the best over the (k+, k−) pairs tried, Bonferroni-corrected like ``audit_epsilon``."""

    epsilon: float
    mu: float
    gdp_epsilon: float
    tried: int


def audit_fdp(scores: Sequence[float] | np.ndarray, included: Sequence[bool] | np.ndarray, *,
              ks: Sequence[tuple[int, int]], delta: float, confidence: float = 0.95) -> FdpAudit:
    """The f-DP audit of ``scores`` (higher = more likely included) over the guess pairs ``ks``, fixed before
    the scores were seen; each pair is one test at level (1 − confidence) / len(ks)."""
    tried, level = bonferroni_guesses(scores, included, ks=ks, confidence=confidence)
    eps = mu = 0.0
    for g in tried:
        eps = max(eps, fdp_epsilon_lower_bound(canaries=g.canaries, guesses=g.guesses, correct=g.correct,
                                               delta=delta, level=level))
        mu = max(mu, gdp_mu_lower_bound(canaries=g.canaries, guesses=g.guesses, correct=g.correct, level=level))
    return FdpAudit(epsilon=eps, mu=mu, gdp_epsilon=gdp_epsilon(mu, delta), tried=len(ks))
