"""Tuning on a Poisson subsample: Zhu & Wang (2019) Thm. 6 amplification of the whole search, known answers."""

from __future__ import annotations

import math

import numpy as np
import pytest
from dp_accounting import dp_event as de

from dptune import accounting as A
from dptune.accounting._subsample import validation_part
from dptune.config import ConfigError, parse_space

DELTA = 1e-5
INTS = (np.round(A.ORDERS) == A.ORDERS) & (A.ORDERS >= 2) & (A.ORDERS <= 63)


def _space(batches: list[int], epochs: float = 10, stopping: str = "poisson", mean: float = 3, eta: float = 1.0,
           tune_fraction: float = 1.0) -> object:
    return parse_space({
        "dataset": {"name": "digits"},
        "fixed": {"epochs": epochs, "noise_multiplier": 1.0},
        "space": {"batch_size": batches},
        "default": {"batch_size": batches[0]},
        "privacy": {"delta": DELTA, "stopping": stopping, "mean": mean, "eta": eta, "score_noise": 6.0},
        "search": {"accounting": "composed" if stopping == "composed" else "random_stopping",
                   "tune_fraction": tune_fraction},
    })


def test_fraction_one_is_identity() -> None:
    search = A.stopping_rule("poisson", mean=3.0).search_event(A.trial_event(noise_multiplier=1.5, sampling_rate=0.1, steps=100, score_noise=6.0))
    curve = A.rdp_of(search)
    assert np.array_equal(A.poisson_subsampled_rdp(A.ORDERS, curve, fraction=1.0), curve)
    assert A.subsampled_search_event(search, fraction=1.0) is search


@pytest.mark.parametrize("sigma, f", [(1.0, 0.1), (2.0, 0.5), (0.8, 0.01), (5.0, 0.25)])
def test_gaussian_against_dp_accounting(sigma: float, f: float) -> None:
    """Thm. 5 (factor 1) is Mironov et al.'s exact formula, which dp_accounting implements at integer
    orders; Thm. 6 (factor 3, valid for any mechanism) is above it by at most log(3)/(α−1)."""
    g = A.rdp_of(de.GaussianDpEvent(sigma))
    exact = A.rdp_of(de.PoissonSampledDpEvent(f, de.GaussianDpEvent(sigma)))
    lower = A.poisson_subsampled_rdp(A.ORDERS, g, fraction=f, factor=1.0)
    upper = A.poisson_subsampled_rdp(A.ORDERS, g, fraction=f)
    assert lower[INTS] == pytest.approx(exact[INTS], rel=1e-9)
    assert np.all(upper[INTS] >= exact[INTS] * (1 - 1e-12))
    assert np.all(upper[INTS] <= exact[INTS] + math.log(3) / (A.ORDERS[INTS] - 1) + 1e-12)


def test_hand_computed_alpha_2() -> None:
    # α = 2: ε'(2) = log[(1−f)(1+f) + f² e^{ε(2)}] (no ℓ ≥ 3 terms); Gaussian σ = 1: ε(2) = 1
    f = 0.2
    g = A.rdp_of(de.GaussianDpEvent(1.0))
    hand = math.log((1 - f) * (1 + f) + f * f * math.e)
    i2 = int(np.flatnonzero(A.ORDERS == 2.0)[0])
    assert A.poisson_subsampled_rdp(A.ORDERS, g, fraction=f)[i2] == pytest.approx(hand, rel=1e-12)
    assert hand == pytest.approx(math.log1p(0.04 * (math.e - 1)), rel=1e-12)


def test_monotone_in_fraction() -> None:
    search = A.stopping_rule("tnb", mean=3.0, eta=1.0).search_event(A.trial_event(noise_multiplier=3.0, sampling_rate=0.2, steps=80, score_noise=None))
    eps = [A.rdp_epsilon([A.subsampled_search_event(search, fraction=f)], DELTA) for f in (0.05, 0.1, 0.25, 0.5, 1.0)]
    assert eps == sorted(eps) and eps[0] < eps[-1]
    # the whole data's search may be charged less (its trial's privacy profile, ``_profile``), never more
    assert A.epsilon([search], DELTA) <= eps[-1]


def test_score_releases_are_not_amplified() -> None:
    trial = A.trial_event(noise_multiplier=2.0, sampling_rate=0.1, steps=100, score_noise=5.0)
    search = A.stopping_rule("poisson", mean=3.0).search_event(trial)
    sub = A.subsampled_search_event(search, fraction=0.01)
    score_only = de.RepeatAndSelectDpEvent(de.GaussianDpEvent(5.0), 3.0, math.inf)
    assert validation_part(search) == score_only
    assert A.epsilon([sub], DELTA) >= A.epsilon([score_only], DELTA) - 1e-12


def test_event_json_round_trip() -> None:
    search = A.stopping_rule("poisson", mean=3.0).search_event(A.trial_event(noise_multiplier=2.0, sampling_rate=0.1, steps=100, score_noise=5.0))
    sub = A.subsampled_search_event(search, fraction=0.25)
    back = A.event_from_json(A.event_to_json(sub))
    assert back == sub
    assert A.epsilon([back], DELTA) == A.epsilon([sub], DELTA)


def test_min_subsample_size_and_rates() -> None:
    m = A.min_subsample_size(1257, fraction=0.5, failure_prob=1e-6)
    from scipy import stats

    assert stats.binom.cdf(m - 1, 1257, 0.5) <= 1e-6 < stats.binom.cdf(m, 1257, 0.5)
    assert A.min_subsample_size(1257, fraction=1.0, failure_prob=1e-6) == 1257
    space = _space([128], epochs=15)
    (point,) = A.reachable_points(space, 1257, tune_fraction=0.5)  # q and T on the basis f·n (dptune.config.params)
    assert point.sampling_rate == pytest.approx(128 / 628.5)
    assert point.steps == math.ceil(15 * 628.5 / 128)
    with pytest.raises(ConfigError) as e:  # a batch above the expected subsample f·n
        A.reachable_points(_space([512]), 1257, tune_fraction=0.25)
    assert e.value.field == "search.tune_fraction"
    for bad in (0.0, -0.1, 1.5, float("nan")):
        with pytest.raises(ConfigError):
            A.poisson_subsampled_rdp(A.ORDERS, A.ORDERS, fraction=bad)


def test_transfer_keeps_sampling_rate() -> None:
    out = A.transfer_config({"batch_size": 128, "learning_rate": 0.5, "epochs": 15, "noise_multiplier": 3.0},
                            fraction=0.25)
    assert out == {"batch_size": 512, "learning_rate": 0.5, "epochs": 15, "noise_multiplier": 3.0}
    assert A.transfer_config({"batch_size": 300}, fraction=0.25, n_train=1000)["batch_size"] == 1000


@pytest.mark.parametrize("fraction", [0.5, 1.0])
@pytest.mark.parametrize("rule", A.comparison_rules(3.0), ids=lambda r: r.label())
def test_search_parts_inverts_the_charge(rule: A.StoppingRule, fraction: float) -> None:
    """The charge plan_search stores (subsampled or not, every rule) gives back its trial, rule and f."""
    eta = rule.eta if isinstance(rule, A.TruncatedNegativeBinomial) else 1.0
    space = _space([32, 64], stopping=rule.name, mean=rule.mean, eta=eta, tune_fraction=fraction)
    plan = A.plan_search(space, 1257, compare=False)
    assert plan.stopping == rule
    stored = A.event_from_json(A.event_to_json(plan.search_event))  # as a certificate or ledger holds it
    assert A.search_parts(stored) == (plan.trial_event, rule, fraction)
    with pytest.raises(ValueError):
        A.search_parts(plan.trial_event)
    with pytest.raises(ValueError):  # a subsampled search whose validation part was dropped
        A.search_parts(stored.events[0] if isinstance(stored, A.WorstCaseDpEvent) else
                       A.WorstCaseDpEvent((stored, de.GaussianDpEvent(1.0))))
