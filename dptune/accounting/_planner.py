"""Planner: the worst-case trial over a search space and the charge of the whole search."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import optuna.distributions as od
from dp_accounting import dp_event as de

from dptune._params import sampling_rate, trial_steps
from dptune.accounting._events import WorstCaseDpEvent, trial_event
from dptune.accounting._rdp import epsilon_from_rdp, rdp_of
from dptune.accounting._rules import StoppingRule
from dptune.accounting._subsample import subsampled_search_event
from dptune.config import ConfigError, SearchSpace, support_values

__all__ = ["Plan", "TrialPoint", "alternative_rules", "epsilon", "plan_search", "reachable_points", "sigma_floor", "worst_case_event"]


@dataclass(frozen=True, order=True)
class TrialPoint:
    """Privacy parameters of one reachable trial."""

    noise_multiplier: float
    sampling_rate: float
    steps: int
    score_noise: float | None

    def event(self) -> de.DpEvent:
        return trial_event(self.noise_multiplier, self.sampling_rate, self.steps, self.score_noise)


def epsilon(event: de.DpEvent, delta: float) -> float:
    return epsilon_from_rdp(rdp_of(event), delta)[0]


def _sigma_values(space: SearchSpace, sigma_low: float | None) -> list[float]:
    dist = space.space.get("noise_multiplier")
    if sigma_low is not None:
        return [sigma_low]
    if dist is None:
        return [space.fixed.noise_multiplier]
    if isinstance(dist, od.FloatDistribution | od.IntDistribution):
        # RDP of the (subsampled) Gaussian decreases in σ: the range's lower bound is the worst case.
        return [float(dist.low)]
    assert isinstance(dist, od.CategoricalDistribution)
    return [float(min(float(c) for c in dist.choices))]  # type: ignore[arg-type]


def _values(space: SearchSpace, key: str) -> list[float]:
    dist = space.space.get(key)
    if dist is None:
        return [getattr(space.fixed, key)]
    if isinstance(dist, od.FloatDistribution) and dist.step is None:
        if key == "epochs":
            return [dist.high]  # more epochs = more steps = more privacy loss
        raise ConfigError(f"space.{key}", "a continuous range cannot be enumerated",
                          "use an int range or categorical choices")
    return list(support_values(dist))


def reachable_points(space: SearchSpace, n_train: float, sigma_low: float | None = None) -> list[TrialPoint]:
    """Every (σ, q, T, score noise) a trial of ``space`` can have; σ at its worst (smallest) value."""
    points = set()
    for sigma in _sigma_values(space, sigma_low):
        for b in _values(space, "batch_size"):
            for ep in _values(space, "epochs"):
                q = sampling_rate(batch_size=int(b), basis=n_train)
                points.add(TrialPoint(float(sigma), q, trial_steps(epochs=float(ep), batch_size=int(b), basis=n_train),
                                      space.fixed.score_noise))
    return sorted(points)


def worst_case_event(points: list[TrialPoint]) -> de.DpEvent:
    # Among points with the same (σ, q, score noise) only the most steps matter.
    best: dict[tuple[float, float, float | None], TrialPoint] = {}
    for p in points:
        key = (p.noise_multiplier, p.sampling_rate, p.score_noise)
        if key not in best or p.steps > best[key].steps:
            best[key] = p
    events = [p.event() for p in sorted(best.values())]
    return events[0] if len(events) == 1 else WorstCaseDpEvent(tuple(events))


@dataclass(frozen=True)
class Plan:
    stopping: StoppingRule
    delta: float
    points: list[TrialPoint]
    trial_event: de.DpEvent
    search_event: de.DpEvent
    trial_epsilon: float
    search_epsilon: float
    n_train: int
    alternatives: dict[str, float] = field(default_factory=dict)  # label -> search ε, same mean


def alternative_rules(rule: StoppingRule) -> list[StoppingRule]:
    """The other stopping rules at the same mean (composition at the rounded mean), for side-by-side prices."""
    mean = rule.mean
    rules = [StoppingRule("poisson", mean), StoppingRule("tnb", mean, 0.0), StoppingRule("tnb", mean, 1.0),
             StoppingRule("composed", max(1, round(mean)))]
    return [r for r in rules if r.label() != rule.label()]


def plan_search(space: SearchSpace, n_train: int, stopping: StoppingRule | None = None,
                sigma_low: float | None = None, compare: bool = True) -> Plan:
    """The charge of a search over ``space`` on ``n_train`` training examples.

    With ``space.tune_fraction`` f < 1 the search runs on a Poisson subsample (Koskela & Kulkarni 2023):
    trials run at q = B/(f·n), T = ⌈epochs·f·n/B⌉ (fixed before the subsample is drawn), and the whole
    search is amplified by Zhu & Wang (2019, Thm. 6); see ``_subsample``.
    """
    rule = stopping or StoppingRule(space.privacy.stopping, space.privacy.mean, space.privacy.eta)
    delta = space.privacy.delta
    f = space.tune_fraction
    try:
        points = reachable_points(space, f * n_train if f < 1 else n_train, sigma_low)
    except ConfigError as e:
        if f == 1:
            raise
        raise ConfigError("search.tune_fraction", e.problem, f"use a larger fraction; {e.fix}") from e
    t_event = worst_case_event(points)
    t_rdp = rdp_of(t_event)

    def charge(r: StoppingRule) -> de.DpEvent:
        event = r.search_event(t_event)
        return subsampled_search_event(event, f) if f < 1 else event

    s_event = charge(rule)
    alternatives = {}
    if compare:
        alternatives = {r.label(): epsilon(charge(r), delta) for r in alternative_rules(rule)}
    return Plan(stopping=rule, delta=delta, points=points, trial_event=t_event, search_event=s_event,
                trial_epsilon=epsilon_from_rdp(t_rdp, delta)[0], search_epsilon=epsilon(s_event, delta),
                n_train=n_train, alternatives=alternatives)


def sigma_floor(space: SearchSpace, n_train: int, target_epsilon: float,
                stopping: StoppingRule | None = None, tolerance: float = 1e-3) -> float | None:
    """Smallest lower bound on σ for which the whole search costs at most ``target_epsilon``.

    ``None`` if even σ = 1000 does not fit (the score release or random-stopping overhead alone exceeds it).
    """
    if not (math.isfinite(target_epsilon) and target_epsilon > 0):
        raise ConfigError("--target-epsilon", f"{target_epsilon!r} must be > 0", "choose e.g. 2.0")

    def cost(sigma: float) -> float:
        return plan_search(space, n_train, stopping, sigma_low=sigma, compare=False).search_epsilon

    return smallest_fitting_sigma(cost, target_epsilon, tolerance)


def smallest_fitting_sigma(cost: Callable[[float], float], target_epsilon: float,
                           tolerance: float = 1e-3) -> float | None:
    """Smallest σ in [0.5, 1000] with cost(σ) <= target (cost decreasing in σ), by bisection in log σ;
    None if even σ = 1000 does not fit. Below σ = 0.5 DP-SGD is useless and RDP series converge slowly."""
    lo, hi = 0.5, 1000.0
    if cost(hi) > target_epsilon:
        return None
    if cost(lo) <= target_epsilon:
        return lo
    while hi / lo > 1 + tolerance:
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if cost(mid) <= target_epsilon else (mid, hi)
    return float(np.nextafter(hi, np.inf))
