"""ASHA under an RDP filter: the filter's bound, the cost of each rung segment, and what the filter admits.

Why a filter. ASHA (Li et al., MLSys 2020) promotes a trial past a rung when its noised score there is among the
best, so which trial trains next depends on every other trial's releases: the trials are not independent runs of
one mechanism and the random-stopping theorem does not cover them. Fully adaptive composition does. A *segment*
is one trial's DP-SGD steps from one rung to the next (at its σ, q) with the noised score it releases there; the
search is a sequence of segments, each chosen (which trial, with which hyperparameters) from the earlier segments'
noised outputs. An RDP filter (Feldman & Zrnic, "Individual privacy accounting via a Rényi filter", NeurIPS 2021,
Thm. 3.1; Whitehouse, Ramdas, Rogers & Wu, "Fully adaptive composition in differential privacy", ICML 2023)
admits each segment only while the RDP curves of the admitted segments, summed, stay at or below a bound B(α)
fixed in advance at every order α of ``ORDERS``; then the whole search is (α, B(α))-RDP at each of those orders,
however the segments were chosen, and converts to (ε, δ) from RDP (``_convert``) — not through PLDs, whose
composition theorems assume the mechanisms fixed in advance. The orders are the accountant's fixed grid.

The bound is ``mean`` full-length worst-case trials' worth: B(α) = ⌈mean⌉ · RDP_trial(α), where a full trial runs
every step of the space's costliest point and releases a score at every rung (``Filter``, ``search_event``). A
trial stopped at its first rung consumed only that segment, so more configurations fit in the same ε than trials
trained to the end. :class:`RdpFilter` is the filter's state (the driver's, sealed); it refuses a segment whose
admission would cross the bound at any order, and a refused segment is never run.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from dp_accounting import dp_event as de

from dptune.accounting._convert import ORDERS
from dptune.accounting._events import FILTER_SLACK, RdpFilterDpEvent, score_event, trial_event
from dptune.accounting._rdp import rdp_of

__all__ = ["RdpFilter", "admits", "filter_bound", "filter_schedule", "filter_text", "segment_costs", "segment_events"]



def segment_events(*, noise_multiplier: float, sampling_rate: float, rung_steps: Iterable[int],
                   score_noise: float | None) -> list[de.DpEvent]:
    """Each rung segment of one trial as an event: its DP-SGD steps since the previous rung (Poisson-subsampled
    Gaussian at σ, q) and the noised score it releases at its rung. Their RDP curves add to the full trial's."""
    out: list[de.DpEvent] = []
    done = 0
    for cumulative in rung_steps:
        steps = int(cumulative) - done
        done = int(cumulative)
        if steps > 0:
            out.append(trial_event(noise_multiplier=noise_multiplier, sampling_rate=sampling_rate, steps=steps,
                                   score_noise=score_noise))
        else:  # the rung adds no step (the last epoch ran no new one): its score alone
            out.append(score_event(score_noise=score_noise))
    return out


def segment_costs(**kwargs: Any) -> list[np.ndarray]:
    """The RDP curves at ``ORDERS`` of :func:`segment_events` (same arguments)."""
    return [np.asarray(rdp_of(e), dtype=np.float64) for e in segment_events(**kwargs)]


@dataclass
class RdpFilter:
    """An RDP filter's state: its bound ``budget`` at ``ORDERS`` and the segments admitted so far (key → curve). A
    segment's key names it in the search (a trial's index and its rung): a trial retried after an infrastructure
    failure asks again for the segment it was admitted, and is not charged twice."""

    budget: np.ndarray
    admitted: dict[str, np.ndarray] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.budget = np.asarray(self.budget, dtype=np.float64)
        if self.budget.shape != ORDERS.shape or not np.all(self.budget > 0):  # NaN fails too; ∞: no bound there
            raise ValueError("an RDP filter's bound is a positive curve at ORDERS")

    @property
    def spent(self) -> np.ndarray:
        """The admitted segments' RDP, summed at each order."""
        return _total(list(self.admitted.values()))

    def fits(self, cost: np.ndarray) -> bool:
        """Whether admitting ``cost`` keeps the sum within the bound at every order (within ``FILTER_SLACK``, which
        the charge includes: ``RdpFilterDpEvent``)."""
        total = _total([*self.admitted.values(), np.asarray(cost, dtype=np.float64)])
        return bool(np.all(total <= self.budget * (1 + FILTER_SLACK)))

    def admit(self, key: str, cost: np.ndarray) -> bool:
        """Admit segment ``key`` (True: it may run) unless it would cross the bound (False: it must not run). A key
        admitted before is admitted again at no charge only with the same curve."""
        cost = np.asarray(cost, dtype=np.float64)
        if cost.shape != ORDERS.shape or not np.all(cost >= 0):  # NaN fails too
            raise ValueError(f"segment {key}: its RDP curve is not a curve >= 0 at ORDERS")
        if key in self.admitted:
            if not np.array_equal(self.admitted[key], cost):
                raise ValueError(f"segment {key} was admitted with another cost: a retry must be the same segment")
            return True
        if not self.fits(cost):
            return False
        self.admitted[key] = cost
        return True

    def to_json(self) -> dict[str, Any]:
        return {"budget": [float(b) for b in self.budget],
                "admitted": {k: [float(c) for c in v] for k, v in sorted(self.admitted.items())}}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RdpFilter:
        return cls(np.asarray(data["budget"], dtype=np.float64),
                   {str(k): np.asarray(v, dtype=np.float64) for k, v in dict(data.get("admitted", {})).items()})


def _total(curves: list[np.ndarray]) -> np.ndarray:
    """Curves summed at each order with math.fsum: correctly rounded, whatever order they were admitted in."""
    return np.array([math.fsum(float(c[i]) for c in curves) for i in range(len(ORDERS))])


def admits(budget: np.ndarray, costs: list[np.ndarray], stop_at: int) -> int:
    """How many trials of segment costs ``costs`` the bound admits when every trial stops after segment
    ``stop_at`` (0: the first rung; len(costs) - 1: full length), segments admitted in order: the planner's
    'what the filter admits'."""
    filt = RdpFilter(budget)
    n = 0
    while True:
        for k, c in enumerate(costs[: stop_at + 1]):
            if not filt.admit(f"{n}/{k}", c):
                return n
        n += 1
        if n > 100_000:
            return n


def filter_schedule(space: Any, plan: Any) -> dict[str, Any]:
    """What an ASHA space's filter admits, before anything is charged (``dptune plan``): the rungs (epochs, and the
    costliest point's steps at each), the bound in full-length trials' worth, and how many configurations fit when
    every one stops at each rung (at the reachable point where the fewest fit)."""
    from dptune.config.params import rung_steps

    rungs = space.rungs
    budget = filter_bound(plan.search_event)  # the bound the search's filter actor holds
    assert budget is not None, "an ASHA space is charged an RdpFilterDpEvent"
    fits: dict[int, int] = {}
    steps: tuple[int, ...] = ()
    for p in plan.points:  # every trial at this point: the fewest configurations over the points
        b = round(p.sampling_rate * plan.n_train)
        at = rung_steps(epochs=space.fixed.epochs, batch_size=max(1, b), basis=plan.n_train, rungs=rungs)
        costs = segment_costs(noise_multiplier=p.noise_multiplier, sampling_rate=p.sampling_rate, rung_steps=at,
                              score_noise=p.score_noise)
        steps = max(steps, at)
        for k, r in enumerate(rungs):
            fits[int(r)] = min(fits.get(int(r), 10**9), admits(np.asarray(budget), costs, k))
    out = {"rungs": list(rungs), "steps": list(steps), "full_trials": int(np.ceil(plan.stopping.mean)),
           "grace_period": space.grace_period, "reduction_factor": space.reduction_factor,
           "configs_if_stopped_at": fits}
    return {**out, "text": filter_text(out)}


def filter_text(s: Mapping[str, Any]) -> str:
    fits = ", ".join(f"{n} stopping at epoch {r}" for r, n in s["configs_if_stopped_at"].items())
    return (f"ASHA (grace period {s['grace_period']}, reduction factor {s['reduction_factor']}): rungs at epochs "
            f"{', '.join(map(str, s['rungs']))} (the costliest point at {', '.join(map(str, s['steps']))} steps), "
            f"a noised score at each\nRDP filter of {s['full_trials']} full-length trials' worth (Feldman & Zrnic "
            f"2021; fixed orders, RDP conversion): it admits {fits} (at the costliest point)")


def filter_bound(event: de.DpEvent) -> list[float] | None:
    """An ASHA search's RDP filter bound at ``ORDERS``: its charged event's curve without the admission slack (the
    charge includes it); None for any other search."""
    if not isinstance(event, RdpFilterDpEvent):
        return None
    return [float(b) for b in rdp_of(event.budget)]
