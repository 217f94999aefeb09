"""The bracket searches' shared parts: a crossing estimate (a σ for an ε target, an ε for a δ target), and the ε
that bisection for a δ target finds, in fewer evaluations.

Both search a monotone privacy cost for where it meets a target, keeping a bracket, and both costs are nearly
straight after a log: ε in log σ (a Gaussian's ε is about 1/σ), log δ in ε. :func:`crossing` guesses from the
last probes; the searches decide what to do with the guess (nudge it to one side, keep it inside the bracket,
bisect when guesses stop halving the bracket), so the guess changes how many probes a search takes, never what
it guarantees.
"""

from __future__ import annotations

import math
from collections.abc import Callable

__all__ = ["bisected_epsilon", "crossing", "log_ratio"]

_DOUBLINGS = 10  # ε up to 2^9 = 512 is searched (the bracket [512, 1024] reaches above 1000: math.inf)


def log_ratio(value: float, target: float) -> float:
    """log(value/target), the coordinate :func:`crossing` meets 0 in: −∞ for a value of 0 or NaN (no line through
    it)."""
    return math.log(value / target) if value > 0 else -math.inf


def crossing(lo: tuple[float, float], hi: tuple[float, float], previous: tuple[float, float] | None) -> float | None:
    """Where f = 0, from the bracket's ends ``lo`` = (x, f(x) > 0) and ``hi`` = (x, f(x) <= 0) and, as in Brent's
    method, the probe before the last (``previous``, when it is not an end): a quadratic in f through the three
    (inverse quadratic interpolation) where it lands strictly inside the bracket, else the straight line through
    the ends; None when a non-finite f leaves neither."""
    (x_lo, f_lo), (x_hi, f_hi) = lo, hi
    if not (math.isfinite(f_lo) and math.isfinite(f_hi) and f_lo > 0 >= f_hi):
        return None
    if previous is not None and math.isfinite(previous[1]) and previous[1] not in (f_lo, f_hi):
        (x0, f0), (x1, f1), (x2, f2) = lo, hi, previous
        x = (x0 * f1 * f2 / ((f0 - f1) * (f0 - f2)) + x1 * f0 * f2 / ((f1 - f0) * (f1 - f2))
             + x2 * f0 * f1 / ((f2 - f0) * (f2 - f1)))
        if x_lo < x < x_hi:
            return x
    return x_lo + (x_hi - x_lo) * f_lo / (f_lo - f_hi)


def bisected_epsilon(delta_at: Callable[[float], float], delta: float, *, tolerance: float) -> float:
    """What dptune's ε-for-δ bisection returns: 0 if δ(0) <= ``delta``; else the bracket [0, 1], doubled until
    δ(hi) <= ``delta`` (``math.inf`` past ε = 1000), then bisected until at most ``tolerance`` wide, its upper end.
    ``delta_at`` must not increase in ε. The doubling's last bracket [2^(k-1), 2^k] is found by bisecting k, the
    bracket's grid by :func:`_grid_crossing`."""
    if (d_lo := delta_at(0.0)) <= delta:
        return 0.0
    k_lo, k_hi, d_hi = -1, _DOUBLINGS, math.nan  # δ(2^k_lo) > delta (k_lo = -1: ε = 0); k_hi: no ε <= 1000 known
    k = min(2, _DOUBLINGS - 1)
    while k_hi - k_lo > 1:
        d = delta_at(2.0**k)
        if d > delta:
            k_lo, d_lo = k, d
        else:
            k_hi, d_hi = k, d
        k = (k_lo + k_hi) // 2
    if k_hi == _DOUBLINGS:
        return math.inf
    return _grid_crossing(delta_at, delta, 0.0 if k_lo < 0 else 2.0**k_lo, 2.0**k_hi, d_lo, d_hi, tolerance=tolerance)


def _grid_crossing(delta_at: Callable[[float], float], delta: float, lo: float, hi: float, d_lo: float, d_hi: float,
                  *, tolerance: float) -> float:
    """The ε that bisecting [``lo``, ``hi``] (δ(lo) = ``d_lo`` > ``delta`` >= δ(hi) = ``d_hi``) until it is at most
    ``tolerance`` wide returns: the smallest point of its grid, lo + j·w (w: the width halved n times; exact
    binary fractions, the floats the bisection computes), where δ <= ``delta``. Found from guesses of where log δ
    crosses (``_roots.crossing``), each a grid step to the side it is expected to fit, then the step below it,
    which closes the bracket if the guess was good; bisection when guesses stop halving the bracket. ~6
    evaluations of δ instead of ~17; the same ε as long as δ(ε) decreases (tests/test_profile.py compares them):
    a certificate's ε is re-derived and compared to 1e-6, so the answer must not move by a grid step."""
    n, width = 0, hi - lo
    while width > tolerance:
        width, n = width / 2, n + 1

    def f(d: float) -> float:
        return log_ratio(d, delta)

    j_lo, j_hi = 0, 2**n
    replaced: tuple[float, float] | None = None  # the end the last probe replaced, (j, log(δ/delta)): crossing()
    slow, closing = 0, False
    while j_hi - j_lo > 1:
        span = j_hi - j_lo
        j, guess = (j_lo + j_hi) // 2, False
        if closing:
            j = j_hi - 1
        elif slow < 2 and (x := crossing((j_lo, f(d_lo)), (j_hi, f(d_hi)), replaced)) is not None:
            j, guess = min(max(math.ceil(x), j_lo + 1), j_hi - 1), True
        d = delta_at(lo + j * width)
        if d > delta:
            replaced, j_lo, d_lo = (j_lo, f(d_lo)), j, d
        else:
            replaced, j_hi, d_hi = (j_hi, f(d_hi)), j, d
        slow = slow + 1 if 2 * (j_hi - j_lo) > span else 0
        closing = guess and d <= delta and not closing
    return lo + j_hi * width
