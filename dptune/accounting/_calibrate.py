"""Noise calibration: the one routine that finds the smallest σ meeting an ε target, and its uses.

:func:`calibrate_sigma` has the shape of dp_accounting's ``mechanism_calibration``: it takes any privacy
cost that does not increase with σ and a bracket, and states what it returns. Every σ search in dptune
(the planner's σ floor, the final training's σ, the benchmarks) goes through it.

:func:`calibrate_noise_multiplier` is its use for final training: the total is the composition of the
prior events (e.g. the search certificate's) and one DP-SGD run, charged as everywhere in dptune at the
smaller of the RDP and PLD bounds (``_accountant.epsilon``). Both decrease in σ (the subsampled Gaussian's
RDP at every order, Mironov, Talwar & Zhang 2019; its PLD is a post-processing of the one at smaller σ), so
their minimum does too.

:func:`calibrate_tight` keeps that fast: it first calibrates on the RDP bound alone (an upper bound of the
minimum, so its σ fits), then searches below that σ on the other bounds alone (``tight_epsilon``: PLD, or
RDP ⊗ PLD after a random-stopping search; where RDP no longer fits, the minimum fits exactly when they do),
so each σ costs one bound, not two.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from dp_accounting import dp_event as de

from dptune.accounting._accountant import epsilon, tight_epsilon
from dptune.accounting._events import trial_event
from dptune.accounting._rdp import rdp_epsilon
from dptune.errors import ConfigError, check_delta, check_positive

__all__ = ["calibrate_noise_multiplier", "calibrate_sigma", "calibrate_tight"]

SIGMA_MIN = 1e-3
SIGMA_MAX = 1e6  # "a huge σ": beyond this the DP-SGD part costs ~nothing, so the prior events decide
REL_TOL = 2e-3  # the returned σ is within 0.2% of the smallest fitting σ
TIGHT_STEP = 0.85  # calibrate_tight's step below the RDP σ: PLD saves 3-15 % of σ on dptune's events


def calibrate_sigma(cost: Callable[[float], float], *, target_epsilon: float, lo: float, hi: float,
                    rel_tol: float) -> float | None:
    """The smallest σ in [``lo``, ``hi``] with ``cost(σ) <= target_epsilon``, to relative tolerance ``rel_tol``.

    ``cost`` must not increase with σ (a NaN cost counts as not fitting). Guarantee: the result σ has
    ``cost(σ) <= target_epsilon`` and either σ = ``lo`` (even the lower bound fits) or
    ``cost(σ·(1 − rel_tol)) > target_epsilon``; ``None`` when even ``cost(hi)`` exceeds the target.
    Bisection in log σ, keeping cost(lo) > target >= cost(hi): ⌈log₂(log(hi/lo) / log(1 + rel_tol))⌉ + 2 calls.
    """
    if not (0 < lo < hi and math.isfinite(hi) and 0 < rel_tol < 1):
        raise ValueError(f"need 0 < lo < hi < inf and 0 < rel_tol < 1, got {lo}, {hi}, {rel_tol}")
    if not cost(hi) <= target_epsilon:
        return None
    if cost(lo) <= target_epsilon:
        return lo
    return _bisect(cost, target_epsilon=target_epsilon, lo=lo, hi=hi, rel_tol=rel_tol)


def _bisect(cost: Callable[[float], float], *, target_epsilon: float, lo: float, hi: float, rel_tol: float) -> float:
    """Bracket search in log σ from cost(lo) > target >= cost(hi), the bracket kept at every step, until
    hi/lo <= 1 + rel_tol. Each probe is the bisection point, or — when both ends' costs are known and the last
    probe at least halved the bracket — the interpolated crossing (ε is smooth in log σ), nudged by rel_tol/2
    towards the side it is expected to fit, and kept rel_tol inside the bracket: 3-5 probes instead of ~9."""
    c_lo = c_hi = math.nan
    fast = False
    while hi / lo > 1.0 + rel_tol:  # then σ·(1 − rel_tol) < σ/(1 + rel_tol) <= lo, which does not fit
        width = math.log(hi / lo)
        mid = math.sqrt(lo * hi)
        if fast and math.isfinite(c_lo) and math.isfinite(c_hi) and c_lo > target_epsilon >= c_hi:
            t = (c_lo - target_epsilon) / (c_lo - c_hi)
            guess = lo * math.exp(t * width) * (1 + rel_tol / 2)
            mid = min(max(guess, lo * (1 + rel_tol)), hi / (1 + rel_tol)) if hi / lo > (1 + rel_tol) ** 2 else (
                hi / (1 + rel_tol))
        c = cost(mid)
        if c <= target_epsilon:
            hi, c_hi = mid, c
        else:
            lo, c_lo = mid, c
        fast = math.log(hi / lo) <= width / 2
    return hi


def calibrate_tight(cost: Callable[[float], float | None], *, upper_cost: Callable[[float], float],
                    target_epsilon: float, lo: float, hi: float, rel_tol: float) -> float | None:
    """:func:`calibrate_sigma` of the charged bound min(``upper_cost``, ``cost``), with its guarantee, for a
    cheap bound ``upper_cost`` (RDP) and a tighter, slower one ``cost`` (PLD; None where it has no bound).
    Both must not increase with σ.

    The σ that fits ``upper_cost`` fits the minimum. Below σ_u·(1 − ``rel_tol``) (σ_u: that σ) ``upper_cost``
    does not fit (monotone), so there the minimum fits exactly when ``cost`` does: the search steps down by
    ``TIGHT_STEP`` on ``cost`` alone until a σ does not fit (or ``lo`` does), then bisects that bracket.
    ``None`` only when even the minimum at ``hi`` exceeds the target.
    """
    def tight(sigma: float) -> float:
        c = cost(sigma)
        return math.inf if c is None else c

    upper = calibrate_sigma(upper_cost, target_epsilon=target_epsilon, lo=lo, hi=hi, rel_tol=rel_tol)
    if upper is None:
        return calibrate_sigma(lambda s: min(upper_cost(s), tight(s)), target_epsilon=target_epsilon, lo=lo, hi=hi,
                               rel_tol=rel_tol)
    if upper == lo or not tight(upper * (1 - rel_tol)) <= target_epsilon:
        return upper  # neither bound fits at σ_u·(1 − rel_tol): the guarantee already holds
    low = upper * (1 - rel_tol)  # fits
    while True:  # step down until a σ does not fit (or lo fits): the bracket of the bisection
        if low <= lo:
            return lo
        high, low = low, max(lo, low * TIGHT_STEP)
        if not tight(low) <= target_epsilon:
            break
    return _bisect(tight, target_epsilon=target_epsilon, lo=low, hi=high, rel_tol=rel_tol)


def calibrate_noise_multiplier(prior_events: Sequence[de.DpEvent], *, sampling_rate: float, steps: int,
                               delta: float, target_epsilon: float, score_noise: float | None = None) -> float:
    """Smallest noise multiplier σ (to within ``REL_TOL``, by :func:`calibrate_tight`) such that the prior
    events composed with ``trial_event(σ, sampling_rate, steps, score_noise)`` cost (``_accountant.epsilon``) at most
    ``target_epsilon`` at ``delta``.

    Raises :class:`ConfigError` (field ``target_epsilon``) if even σ = ``SIGMA_MAX`` does not fit (the prior
    events alone cost about as much as the target).
    """
    check_positive("target_epsilon", target_epsilon, "choose a total ε, e.g. 8")
    check_delta("delta", delta)
    prior = list(prior_events)

    def events(sigma: float) -> list[de.DpEvent]:
        return [*prior, trial_event(noise_multiplier=sigma, sampling_rate=sampling_rate, steps=steps,
                                    score_noise=score_noise)]

    sigma = calibrate_tight(lambda s: tight_epsilon(events(s), delta), upper_cost=lambda s: rdp_epsilon(events(s), delta),
                            target_epsilon=target_epsilon, lo=SIGMA_MIN, hi=SIGMA_MAX, rel_tol=REL_TOL)
    if sigma is None:
        prior_eps = epsilon(prior, delta)
        raise ConfigError(
            "target_epsilon",
            f"ε = {target_epsilon:g} cannot be met: what was spent before (ε = {prior_eps:.4g} at δ = {delta:g}) "
            f"leaves no room for training, even with noise multiplier {SIGMA_MAX:g}",
            f"choose a target above {prior_eps:.4g}, or train with the released config's own noise multiplier",
        )
    return sigma
