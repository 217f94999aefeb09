"""How far below Papernot & Steinke's RDP can a privacy-profile bound take a random-stopping search?

A bound that uses only the privacy profile of one trial (as dptune's ``profile`` accountant does, and Koskela,
Redberg & Wang 2024) must hold for *every* base mechanism with that profile and every ranking of its outputs,
so it is at least the exact ε of random stopping run on one such mechanism. This computes that exact ε for
concrete instances: the trial's own dominating pair (dp_accounting's *optimistic* PLD, a pair whose profile lies
below the trial's), each loss value one outcome, K from the search's rule (Poisson: K = 0 releases ⊥ on both
sides; TNB), P[best = y] = φ(1 − G(y)) − φ(1 − G(y) − p(y)) (G: the mass ranked above y), in two rankings:

* ``monotone``: outcomes ranked by their privacy loss, either way (this bench's first version);
* ``adversarial``: the ranking at which dptune's ``profile`` theorem is attained (``dptune/accounting/_profile``):
  every outcome whose loss pays at ε is placed where the mass ranked below it is the highest-loss mass t* that
  maximises φ'(R(t))·e^loss − e^ε·φ'(t) (R: the pair's ROC), the rest in decreasing loss from the bottom.

Any profile-based bound is at least the larger floor; if that is above 85 % of dptune's RDP value, no such bound
can give 15 % less. The probabilities are computed in a cancellation-free form (the first version subtracted
φ at nearly equal arguments and lost the digits: it printed 50 for mnist.yaml).

    python bench/random_stopping_floor.py [--out bench/results/random_stopping_profile.md]
"""

from __future__ import annotations

import argparse
import functools
import math
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from dp_accounting import dp_event as de
from dp_accounting.pld import privacy_loss_distribution as pldlib

from dptune import accounting as A
from dptune.config import SearchSpace, load_space, nominal_train_size

ROOT = Path(__file__).resolve().parent.parent
DELTA = 1e-5
VDI = 1e-3
Pair = tuple[np.ndarray, np.ndarray, np.ndarray]  # (losses, P, Q) of the outcomes, loss = log P/Q


def _optimistic(event: de.DpEvent) -> pldlib.PrivacyLossDistribution:
    """dp_accounting's optimistic PLD of a dptune trial (Poisson-sampled Gaussian steps, Gaussians, no-ops)."""
    if isinstance(event, de.NoOpDpEvent):
        return pldlib.identity(value_discretization_interval=VDI, pessimistic_estimate=False)
    if isinstance(event, de.GaussianDpEvent):
        return pldlib.from_gaussian_mechanism(event.noise_multiplier, pessimistic_estimate=False,
                                              value_discretization_interval=VDI, use_connect_dots=False)
    if isinstance(event, de.PoissonSampledDpEvent):
        assert isinstance(event.event, de.GaussianDpEvent)
        return pldlib.from_gaussian_mechanism(event.event.noise_multiplier, sampling_prob=event.sampling_probability,
                                              pessimistic_estimate=False, value_discretization_interval=VDI,
                                              use_connect_dots=False)
    if isinstance(event, de.SelfComposedDpEvent):
        return _optimistic(event.event).self_compose(event.count)
    assert isinstance(event, de.ComposedDpEvent), type(event).__name__
    out = pldlib.identity(value_discretization_interval=VDI, pessimistic_estimate=False)
    for e in event.events:
        out = out.compose(_optimistic(e))
    return out


def pairs(trial: de.DpEvent) -> list[Pair]:
    """(losses, P, Q) of the optimistic pair, both directions; Q's missing mass is an outcome P never gives
    (loss −∞), P's infinite-loss mass one Q never gives."""
    pld = _optimistic(trial)
    out = []
    for pmf in (pld._pmf_remove, pld._pmf_add):  # noqa: SLF001 - both neighbouring directions
        dense = pmf.to_dense_pmf()
        probs = np.asarray(dense._probs, dtype=np.float64)  # noqa: SLF001
        loss = (dense._lower_loss + np.arange(len(probs))) * dense._discretization  # noqa: SLF001
        q = probs * np.exp(-loss)
        scale = max(1.0, q.sum())  # the optimistic rounding can overshoot Q's mass slightly: renormalise
        p_inf = float(dense._infinity_mass)  # noqa: SLF001
        loss = np.concatenate([[-np.inf], loss, [np.inf]])
        p = np.concatenate([[0.0], probs / scale, [p_inf]])
        q = np.concatenate([[max(0.0, 1 - q.sum() / scale)], q / scale, [0.0]])
        out.append((loss, p / p.sum(), q))
    return out


class Rule:
    """K's law: Poisson(mean) (``eta`` None) or TNB(eta, γ) with E[K] = mean (γ as dptune draws it)."""

    def __init__(self, mean: float, eta: float | None) -> None:
        self.mean, self.eta = float(mean), eta
        self.gamma = 1.0 if eta is None else A.tnb_gamma(mean=mean, eta=eta)

    def dphi(self, z: np.ndarray) -> np.ndarray:
        z = np.asarray(z, dtype=np.float64)
        if self.eta is None:
            return self.mean * np.exp(self.mean * (z - 1))
        g, r = self.gamma, 1 - self.gamma
        if g >= 1:
            return np.ones_like(z)
        if self.eta == 0:
            return r / (math.log(1 / g) * (1 - r * z))
        return self.eta * r * (1 - r * z) ** (-self.eta - 1) / math.expm1(-self.eta * math.log(g))

    def best(self, p: np.ndarray) -> np.ndarray:
        """P[best = outcome i], outcomes ranked by index (higher wins), then P[⊥] (K = 0)."""
        above = np.concatenate([np.cumsum(p[::-1])[::-1][1:], [0.0]])
        if self.eta is None:  # φ(z) = e^{μ(z − 1)}
            return np.concatenate([np.exp(-self.mean * above) * -np.expm1(-self.mean * p), [math.exp(-self.mean)]])
        g, r = self.gamma, 1 - self.gamma
        if g >= 1:
            return np.concatenate([p, [0.0]])
        top = g + r * above  # 1 − r·z at z = 1 − G
        step = np.log1p(r * p / top)
        if self.eta == 0:  # φ(z) = log(1 − r z) / log γ
            return np.concatenate([step / math.log(1 / g), [0.0]])
        norm = math.expm1(-self.eta * math.log(g))  # φ(z) = ((1 − r z)^{−η} − 1) / (γ^{−η} − 1)
        return np.concatenate([top ** -self.eta * -np.expm1(-self.eta * step) / norm, [0.0]])


def exact_delta(pair: Pair, order: np.ndarray, rule: Rule, epsilon: float) -> float:
    """H_{e^ε}(Q_P || Q_Q) of random stopping on ``pair`` with outcomes ranked by ``order`` (low to high)."""
    _, p, q = pair
    qp, qq = rule.best(p[order]), rule.best(q[order])
    return float(np.sum(np.maximum(0.0, qp - math.exp(epsilon) * qq)))


def _bisect(delta_at: Callable[[float], float], delta: float) -> float:
    """The ε where ``delta_at`` (non-increasing) crosses ``delta``."""
    lo, hi = 0.0, 1.0
    while delta_at(hi) > delta:
        lo, hi = hi, 2 * hi
        if hi > 100:
            return math.inf
    while hi - lo > 1e-6:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if delta_at(mid) > delta else (lo, mid)
    return lo


def monotone_floor(pair: Pair, rule: Rule, delta: float = DELTA) -> float:
    """Exact ε of random stopping on ``pair`` ranked by privacy loss, the worse of both ways and both hockey-stick
    directions."""
    loss, p, q = pair
    worst = 0.0
    for order in (np.argsort(loss, kind="stable"), np.argsort(-loss, kind="stable")):
        for a, b in ((p, q), (q, p)):
            worst = max(worst, _bisect(functools.partial(_at, (loss, a, b), order, rule), delta))
    return worst


def _at(pair: Pair, order: np.ndarray, rule: Rule, epsilon: float) -> float:
    return exact_delta(pair, order, rule, epsilon)


def adversarial_order(pair: Pair, rule: Rule, epsilon: float, grid: int = 4000) -> np.ndarray:
    """The ranking of the module docstring for the hockey-stick divergence at ``epsilon`` (indices, low to high)."""
    loss, p, q = pair
    finite = np.isfinite(loss)
    desc = np.argsort(-loss, kind="stable")
    t_roc = np.concatenate([[0.0], np.cumsum(q[desc])])
    r_roc = np.minimum(1.0, np.concatenate([[0.0], np.cumsum(p[desc])]))
    t = np.unique(np.concatenate([np.linspace(0, 1, grid + 1), np.geomspace(1e-12, 1, 200)]))
    gain, cost = rule.dphi(np.interp(t, t_roc, r_roc)), math.exp(epsilon) * rule.dphi(t)
    pays = finite & (loss > -math.log(float(np.max(gain / cost)) + 1e-300))
    key = np.empty(len(loss))
    if pays.any():
        value = np.exp(loss[pays])[:, None] * gain[None, :] - cost[None, :]
        key[pays] = t[np.argmax(value, axis=1)]
        pays[pays] = value.max(axis=1) > 0
    rest = desc[~pays[desc]]  # the others from the bottom in decreasing loss: the mass below is the highest-loss
    key[rest] = np.cumsum(q[rest]) - q[rest] / 2
    key[loss == np.inf] = -1.0
    key[loss == -np.inf] = 2.0
    return np.argsort(key, kind="stable")


def adversarial_floor(pair: Pair, rule: Rule, delta: float = DELTA) -> float:
    """The largest ε₀ whose adversarial ranking still has δ(ε₀) > ``delta``: that mechanism's ε is above ε₀."""
    return _bisect(lambda e: exact_delta(pair, adversarial_order(pair, rule, e), rule, e), delta)


def rule_of(stopping: A.StoppingRule) -> Rule:
    if stopping.name == "poisson":
        return Rule(stopping.mean, None)
    assert isinstance(stopping, A.TruncatedNegativeBinomial), stopping.name
    return Rule(stopping.mean, stopping.eta)


def components(trial: de.DpEvent) -> tuple[de.DpEvent, ...]:
    return trial.events if isinstance(trial, A.WorstCaseDpEvent) else (trial,)


def row(label: str, plan: A.Plan) -> str:
    """RDP, profile, both floors and the verdict for one planned search (the worst component's floors)."""
    search, trial, rule = plan.search_event, plan.trial_event, rule_of(plan.stopping)
    rdp = A.rdp_epsilon([search], plan.delta)
    bound = A.certify([search], plan.delta)
    profile = A.accountant("profile").epsilon([search], delta=plan.delta)
    assert profile is not None, "a random-stopping search of trials with a PLD"
    floors = [(monotone_floor(pr, rule, plan.delta), adversarial_floor(pr, rule, plan.delta))
              for c in components(trial) for pr in pairs(c)]
    mono, adv = max(f[0] for f in floors), max(f[1] for f in floors)
    verdict = "yes" if bound.epsilon <= 0.85 * rdp else f"no (floor {adv / rdp:.1%} of RDP)" if adv > 0.85 * rdp else "no"
    return (f"| {label} | {plan.stopping.label()} | {rdp:.4f} | {profile:.4f} ({1 - profile / rdp:.1%} below) | "
            f"{mono:.4f} | {adv:.4f} | {bound.accountant} {bound.epsilon:.4f} | {verdict} |")


def rdp_trial_sigma(space: SearchSpace, n: int) -> float:
    """σ_c of a space that plans its final run, calibrated on the RDP bound alone (what the planner chose before
    the ``profile`` accountant): the search costs ``search_share`` × ``target_epsilon`` in RDP."""
    p = space.privacy
    assert p.search_share is not None and p.target_epsilon is not None

    def cost(sigma: float) -> float:
        return A.rdp_epsilon([A.plan_search(space, n, sigma_low=sigma, compare=False).search_event], p.delta)

    sigma = A.calibrate_sigma(cost, target_epsilon=p.search_share * p.target_epsilon, lo=0.5, hi=1000.0, rel_tol=1e-4)
    assert sigma is not None
    return sigma


HEADER = ("| space | rule | RDP (Papernot-Steinke) | profile | floor, monotone ranking | floor, adversarial ranking "
          "| charged | >= 15 % below RDP? |\n|---|---|---|---|---|---|---|---|")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write the table (markdown) here")
    args = parser.parse_args()
    start = time.time()
    lines = [HEADER]
    for name in ("digits", "mnist"):
        space = load_space(ROOT / "search_spaces" / f"{name}.yaml")
        n = nominal_train_size(space.dataset) or 1000
        plan = A.plan_search(space, n, compare=False)
        sigma_c = max(p.noise_multiplier for p in plan.points) if space.transfers else None
        tag = f"{name}.yaml"
        if space.transfers:  # the trials' σ is calibrated to the search's share: show the RDP-calibrated σ too
            rdp_sigma = rdp_trial_sigma(space, n)
            lines.append(row(f"{tag}, trials at the RDP-calibrated σ_c {rdp_sigma:.4g}",
                             A.plan_search(space, n, sigma_low=rdp_sigma, compare=False)))
            tag += f", trials at σ_c {sigma_c:.4g} (the planner's, now)"
        lines.append(row(tag, plan))
        for rule in A.alternative_rules(plan.stopping):
            if rule.random_stopping:
                lines.append(row(f"{name}.yaml", A.plan_search(space, n, rule, sigma_low=sigma_c, compare=False)))
    text = "\n".join(lines)
    print(text)
    print(f"({time.time() - start:.0f} s)")
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
