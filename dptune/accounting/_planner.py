"""Planner: the worst-case trial over a search space and the charge of the whole search."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import optuna.distributions as od
from dp_accounting import dp_event as de

from dptune.accounting._accountant import epsilon, tight_epsilon
from dptune.accounting._amplify import check_fraction
from dptune.accounting._calibrate import calibrate_tight
from dptune.accounting._catalogue import alternative_rules, rule_of
from dptune.accounting._events import NoisyMaxDpEvent, WorstCaseDpEvent, trial_event, with_selection
from dptune.accounting._rdp import rdp_epsilon
from dptune.accounting._rules import StoppingRule
from dptune.accounting._subsample import subsampled_search_event
from dptune.config import ConfigError, SearchSpace, check_trial_score_noise, clipping, support_values
from dptune.config.params import sampling_rate, trial_steps
from dptune.errors import check_positive

__all__ = ["Plan", "TrialPoint", "clipping_sensitivity", "plan_search", "reachable_points", "selection_event", "sigma_floor",
           "transfer_trial_sigma", "transfer_weights", "worst_case_event"]

SIGMA_FLOOR_RANGE = (0.5, 1000.0)  # below σ = 0.5 DP-SGD is useless and RDP series converge slowly


@dataclass(frozen=True, order=True, kw_only=True)
class TrialPoint:
    """Privacy parameters of one reachable trial; ``noise_multiplier`` per unit of sensitivity (the σ a trial adds
    over ``dptune.config.clipping.sensitivity`` of its clipping mode: batch clipping's σ/2)."""

    noise_multiplier: float
    sampling_rate: float
    steps: int
    score_noise: float | None
    scores: int = 1  # score releases: one, or one per ASHA rung

    def event(self) -> de.DpEvent:
        return trial_event(noise_multiplier=self.noise_multiplier, sampling_rate=self.sampling_rate,
                           steps=self.steps, score_noise=self.score_noise, scores=self.scores)


def _sigma_values(space: SearchSpace, sigma_low: float | None) -> list[float]:
    """The worst-case σ per unit of sensitivity: the smallest σ the space reaches over its largest clipping
    sensitivity (batch clipping: 2C, ``dptune.config.clipping.sensitivity``)."""
    dist = space.space.get("noise_multiplier")
    if sigma_low is not None:
        return [sigma_low]
    sensitivity = clipping_sensitivity(space)
    if dist is None:
        return [space.fixed.noise_multiplier / sensitivity]
    if isinstance(dist, od.FloatDistribution | od.IntDistribution):
        # RDP of the (subsampled) Gaussian decreases in σ: the range's lower bound is the worst case.
        return [float(dist.low) / sensitivity]
    assert isinstance(dist, od.CategoricalDistribution)
    return [float(min(float(c) for c in dist.choices)) / sensitivity]  # type: ignore[arg-type]


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


def reachable_points(space: SearchSpace, n_train: float, *, sigma_low: float | None = None,
                     tune_fraction: float = 1.0) -> list[TrialPoint]:
    """Every (σ, q, T, score noise) a trial of ``space`` can have; σ at its worst (smallest) value.

    With ``tune_fraction`` f < 1 the trials run on a Poisson subsample: q and T on the data-independent
    basis f·n (``dptune.config.params``; Koskela & Kulkarni 2023), errors reported as ``search.tune_fraction``.
    A search that plans its final run (``space.transfers``) runs each (B, E) at its own cheap σ:
    ``sigma_low`` × :func:`transfer_weight` (σ_low is the σ of the costliest point).
    """
    basis = check_fraction(tune_fraction) * n_train
    points = set()
    weights = transfer_weights(space, basis) if space.transfers and sigma_low is not None else None
    try:
        for sigma in _sigma_values(space, sigma_low):
            for b in _values(space, "batch_size"):
                for ep in _values(space, "epochs"):
                    q = sampling_rate(batch_size=int(b), basis=basis)
                    steps = trial_steps(epochs=float(ep), batch_size=int(b), basis=basis)
                    s = sigma if weights is None else max(SIGMA_FLOOR_RANGE[0], sigma * weights[int(b), float(ep)])
                    points.add(TrialPoint(noise_multiplier=float(s), sampling_rate=q, steps=steps,
                                          score_noise=space.fixed.score_noise, scores=len(space.rungs)))
    except ConfigError as e:
        if tune_fraction == 1:
            raise
        raise ConfigError("search.tune_fraction", e.problem, f"use a larger fraction; {e.fix}") from e
    return sorted(points)


def transfer_weights(space: SearchSpace, basis: float) -> dict[tuple[int, float], float]:
    """Per reachable (B, E), its trial σ relative to the costliest point's: q·√T over the largest q·√T. A
    Poisson-subsampled Gaussian's RDP is about T·q²·α/σ² at the trials' large σ, so these σ make every
    point cost about the same: a small-batch trial is not run at the noise a large batch needs. (Only a
    choice of σ per point: the charge is the exact worst case over the points as they are.)"""
    w = {}
    for b in _values(space, "batch_size"):
        for ep in _values(space, "epochs"):
            q = sampling_rate(batch_size=int(b), basis=basis)
            w[int(b), float(ep)] = q * math.sqrt(trial_steps(epochs=float(ep), batch_size=int(b), basis=basis))
    top = max(w.values())
    return {k: v / top for k, v in w.items()}


def worst_case_event(points: list[TrialPoint]) -> de.DpEvent:
    """One trial of a random search over ``points``, charged at the pointwise maximum of their curves."""
    # Among points with the same (σ, q, score noise) only the most steps matter.
    best: dict[tuple[float, float, float | None, int], TrialPoint] = {}
    for p in points:
        key = (p.noise_multiplier, p.sampling_rate, p.score_noise, p.scores)
        if key not in best or p.steps > best[key].steps:
            best[key] = p
    events = [p.event() for p in sorted(best.values())]
    return events[0] if len(events) == 1 else WorstCaseDpEvent(tuple(events))


@dataclass(frozen=True, kw_only=True)
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


def _charge(space: SearchSpace, n_train: int, stopping: StoppingRule | None, sigma_low: float | None
            ) -> tuple[StoppingRule, list[TrialPoint], de.DpEvent, Callable[[StoppingRule], de.DpEvent]]:
    """(rule, reachable points, worst-case trial event, the search's charge under a rule): :func:`plan_search`."""
    check_trial_score_noise(space)  # what the trials run is what privacy says, or nothing is planned
    p = space.privacy
    rule = stopping or rule_of(p)
    if sigma_low is None and space.transfers:
        sigma_low = transfer_trial_sigma(space, n_train, stopping=rule)  # σ_c sized under the rule charged
    f = space.tune_fraction
    points = reachable_points(space, n_train, sigma_low=sigma_low, tune_fraction=f)
    t_event = worst_case_event(points)
    selection = selection_event(space)

    def charge(r: StoppingRule) -> de.DpEvent:
        return with_selection(subsampled_search_event(r.search_event(t_event), fraction=f), selection)

    return rule, points, t_event, charge


def plan_search(space: SearchSpace, n_train: int, stopping: StoppingRule | None = None, *,
                sigma_low: float | None = None, compare: bool = True) -> Plan:
    """The charge of a search over ``space`` on ``n_train`` training examples.

    With ``space.tune_fraction`` f < 1 the search runs on a Poisson subsample (Koskela & Kulkarni 2023):
    trials run at q = B/(f·n), T = ⌈epochs·f·n/B⌉ (fixed before the subsample is drawn), and the whole
    search is amplified by Zhu & Wang (2019, Thm. 6); see ``_subsample`` (whose ``search_parts`` inverts
    the charge).

    With ``privacy.selection: noisy_max`` (the scaled searcher) trials release no score; the search's charge
    is their composition with the one report-noisy-max that picks the candidate (``NoisyMaxDpEvent``).
    Every ε is the smaller of the RDP and PLD bounds (``_accountant.epsilon``).
    """
    rule, points, t_event, charge = _charge(space, n_train, stopping, sigma_low)
    p = space.privacy
    s_event = charge(rule)
    alternatives = {}
    if compare:
        alternatives = {r.label(): epsilon([charge(r)], p.delta) for r in alternative_rules(rule)}
    return Plan(stopping=rule, delta=p.delta, points=points, trial_event=t_event, search_event=s_event,
                trial_epsilon=epsilon([t_event], p.delta), search_epsilon=epsilon([s_event], p.delta),
                n_train=n_train, alternatives=alternatives)


def selection_event(space: SearchSpace) -> NoisyMaxDpEvent | None:
    """The search-level selection release: a noisy max at the Gumbel scale ``privacy.score_noise`` (the
    trials then release nothing), or None when each trial's own noised score is charged with the trial."""
    p = space.privacy
    if p.selection != "noisy_max":
        return None
    assert p.score_noise is not None  # config.check_privacy: a private validation split needs noise
    return NoisyMaxDpEvent(float(p.score_noise))


def sigma_floor(space: SearchSpace, n_train: int, *, target_epsilon: float,
                stopping: StoppingRule | None = None, tolerance: float = 1e-3) -> float | None:
    """Smallest lower bound on σ (in ``SIGMA_FLOOR_RANGE``, to ``tolerance``; :func:`calibrate_tight`, the
    RDP bound as its fast upper bracket) for which the whole search costs at most ``target_epsilon``.

    ``None`` if even σ = 1000 does not fit (the score release or random-stopping overhead alone exceeds it).
    The floor is the σ a trial adds: per unit of sensitivity times the space's largest clipping sensitivity
    (batch clipping: twice the per-example floor).
    """
    check_positive("target_epsilon", target_epsilon, "choose e.g. 2.0")

    def search(sigma: float) -> list[de.DpEvent]:
        rule, _, _, charge = _charge(space, n_train, stopping, sigma)
        return [charge(rule)]

    lo, hi = SIGMA_FLOOR_RANGE
    delta = space.privacy.delta
    floor = calibrate_tight(lambda s: tight_epsilon(search(s), delta), upper_cost=lambda s: rdp_epsilon(search(s), delta),
                            target_epsilon=target_epsilon, lo=lo, hi=hi, rel_tol=tolerance)
    return None if floor is None else floor * clipping_sensitivity(space)


def clipping_sensitivity(space: SearchSpace) -> float:
    """The largest clipping sensitivity (in units of C) any trial of ``space`` can have."""
    return max(clipping.sensitivity(str(c)) for c in _values(space, "clipping"))


def transfer_trial_sigma(space: SearchSpace, n_train: int, *, stopping: StoppingRule | None = None) -> float:
    """The cheap σ_c of the costliest trial point when the search plans its final run (``privacy.search_share``;
    every other (B, E) runs at σ_c × :func:`transfer_weights`): the smallest whose whole search (the space's own
    stopping rule, worst case over every reachable point, score releases or the noisy max) costs at most
    ``privacy.search_share`` × ``privacy.target_epsilon`` (:func:`sigma_floor`). ``stopping``: a rule other than
    the space's (``dptune plan --mean/--stopping/--setting``), which the share must then pay for."""
    p = space.privacy
    assert p.search_share is not None and p.target_epsilon is not None  # config.check_transfer
    sigma = sigma_floor(space, n_train, target_epsilon=p.search_share * p.target_epsilon, stopping=stopping)
    if sigma is None:
        raise ConfigError("privacy.search_share", f"{p.search_share:g} of epsilon {p.target_epsilon:g} does not pay "
                          f"for the search's score releases (or the noisy max) even at noise multiplier "
                          f"{SIGMA_FLOOR_RANGE[1]:g}",
                          "raise privacy.search_share or privacy.score_noise, or run fewer trials")
    return sigma
