"""How much could a privacy-profile bound (Koskela, Redberg & Wang, ICML 2024) save on a random-stopping search?

A bound that uses only the privacy profile of one trial (as theirs does) must hold for *every* base mechanism
with that profile, so it is at least the exact ε of random stopping run on one such mechanism. This computes
that exact ε for a concrete instance: the trial's own dominating pair (dp_accounting's *optimistic* PLD, a
pair whose profile lies below the trial's), each loss value one outcome, the score ranking outcomes by their
privacy loss (either direction), K ~ Poisson(μ): P[best = y] = φ(F(y) + p(y)) − φ(F(y)), φ(z) = e^{μ(z−1)}
(F: the mass of outcomes ranked below y; K = 0 releases ⊥ on both sides). The result is a floor under any
profile-based bound and hence under KRW's; if the floor is above 85 % of dptune's RDP value (Papernot &
Steinke), no such bound can give 15 % less.

    python bench/random_stopping_floor.py     # digits.yaml and mnist.yaml, n as the planner uses
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from dp_accounting import dp_event as de
from dp_accounting.pld import privacy_loss_distribution as pldlib

from dptune import accounting as A
from dptune.config import load_space

ROOT = Path(__file__).resolve().parent.parent
DELTA = 1e-5
VDI = 1e-3


def _optimistic_pld(event: de.DpEvent) -> pldlib.PrivacyLossDistribution:
    """dp_accounting's optimistic PLD of one dptune trial (a lower bound of its profile)."""
    assert isinstance(event, de.ComposedDpEvent)
    sgd, score = event.events
    assert isinstance(sgd, de.SelfComposedDpEvent) and isinstance(sgd.event, de.PoissonSampledDpEvent)
    inner = sgd.event.event
    assert isinstance(inner, de.GaussianDpEvent)
    out = pldlib.from_gaussian_mechanism(inner.noise_multiplier, sampling_prob=sgd.event.sampling_probability,
                                         pessimistic_estimate=False, value_discretization_interval=VDI,
                                         use_connect_dots=False)
    out = out.self_compose(sgd.count)
    if isinstance(score, de.GaussianDpEvent):
        out = out.compose(pldlib.from_gaussian_mechanism(score.noise_multiplier, pessimistic_estimate=False,
                                                         value_discretization_interval=VDI, use_connect_dots=False))
    return out


def _pair(pmf: object) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(losses, P, Q) of a pair of distributions with this privacy-loss pmf (loss under P); Q's missing mass
    goes to an outcome P never gives (loss −∞), P's infinite-loss mass to one Q never gives."""
    dense = pmf.to_dense_pmf()  # type: ignore[attr-defined]
    probs = np.asarray(dense._probs, dtype=np.float64)  # noqa: SLF001
    loss = (dense._lower_loss + np.arange(len(probs))) * dense._discretization  # noqa: SLF001
    q = probs * np.exp(-loss)
    scale = max(1.0, q.sum())  # the optimistic rounding can overshoot Q's mass slightly: renormalise
    q = q / scale
    p = probs / scale
    p_inf = dense._infinity_mass  # noqa: SLF001
    loss = np.concatenate([[-np.inf], loss, [np.inf]])
    p = np.concatenate([[0.0], p, [p_inf]])
    q = np.concatenate([[max(0.0, 1 - q.sum())], q, [0.0]])
    return loss, p / p.sum(), q


def _best_of_poisson(p: np.ndarray, mean: float) -> np.ndarray:
    """P[best = outcome i] for outcomes ranked by index (higher index wins), K ~ Poisson(mean); ⊥ last."""
    below = np.concatenate([[0.0], np.cumsum(p)[:-1]])
    phi = np.exp(mean * (np.minimum(below + p, 1.0) - 1)) - np.exp(mean * (below - 1))
    return np.concatenate([phi, [math.exp(-mean)]])


def _epsilon(px: np.ndarray, qx: np.ndarray, delta: float) -> float:
    def hockey(eps: float) -> float:
        return float(np.sum(np.maximum(0.0, px - math.exp(eps) * qx)))

    lo, hi = 0.0, 50.0
    if hockey(0.0) <= delta:
        return 0.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if hockey(mid) > delta else (lo, mid)
    return hi


def floor_epsilon(trial: de.DpEvent, mean: float, delta: float = DELTA) -> float:
    pld = _optimistic_pld(trial)
    worst = 0.0
    for pmf in (pld._pmf_remove, pld._pmf_add):  # noqa: SLF001 - both neighbouring directions
        loss, p, q = _pair(pmf)
        for order in (np.argsort(loss, kind="stable"), np.argsort(-loss, kind="stable")):
            px, qx = _best_of_poisson(p[order], mean), _best_of_poisson(q[order], mean)
            worst = max(worst, _epsilon(px, qx, delta), _epsilon(qx, px, delta))
    return worst


def main() -> None:
    for name, n in (("digits", 1257), ("mnist", 8000)):
        space = load_space(ROOT / "search_spaces" / f"{name}.yaml")
        plan = A.plan_search(space, n, compare=False)
        trials = plan.trial_event.events if isinstance(plan.trial_event, A.WorstCaseDpEvent) else (plan.trial_event,)
        worst = max(trials, key=lambda t: A.rdp_epsilon([t], DELTA))
        mean = float(plan.stopping.mean)
        floor = floor_epsilon(worst, mean)
        print(f"{name}: Poisson(mean={mean:g}); worst trial RDP {A.rdp_epsilon([worst], DELTA):.3f}, PLD "
              f"{A.pld_epsilon([worst], DELTA):.3f}; search RDP (Papernot-Steinke) {plan.search_epsilon:.3f}; "
              f"exact random stopping on the trial's own pair {floor:.3f} = {floor / plan.search_epsilon:.1%} of RDP "
              f"(15 % less needs <= {0.85 * plan.search_epsilon:.3f})")


if __name__ == "__main__":
    main()
