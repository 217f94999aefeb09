"""Known answers for the privacy core, from independent oracles:
dp_accounting's RepeatAndSelectDpEvent (RdpAccountant), Opacus' RDP accountant, and closed forms of
Papernot & Steinke (2022) for the Gaussian mechanism."""

from __future__ import annotations

import math

import numpy as np
import pytest
from dp_accounting import dp_event as de
from dp_accounting.rdp import rdp_privacy_accountant as rdp_acc
from scipy import optimize

from dptune import accounting as A
from dptune.config import ConfigError, parse_space

DELTA = 1e-5


def oracle_epsilon(event: de.DpEvent, delta: float = DELTA) -> float:
    acc = rdp_acc.RdpAccountant()
    acc.compose(event)
    return acc.get_epsilon(delta)


def test_one_trial_matches_opacus_known_answer() -> None:
    from opacus.accountants import RDPAccountant

    acc = RDPAccountant()
    acc.history = [(1.5, 0.04, 2250)]
    opacus_eps = acc.get_epsilon(DELTA)
    ours = A.rdp_epsilon([A.trial_event(noise_multiplier=1.5, sampling_rate=0.04, steps=2250, score_noise=None)], DELTA)
    assert opacus_eps == pytest.approx(7.3291, rel=1e-3)
    assert ours == pytest.approx(opacus_eps, rel=0.01)
    assert ours == pytest.approx(7.3291, rel=0.01)


def test_rdp_curve_matches_public_accountant() -> None:
    # guards the use of dp_accounting's internal curve (pinned version) against its public API
    e = A.trial_event(noise_multiplier=1.1, sampling_rate=0.1, steps=300, score_noise=5.0)
    assert A.rdp_epsilon([e], DELTA) == pytest.approx(oracle_epsilon(e), rel=1e-9)


# (q, σ) where dp_accounting's series behave differently: tiny and huge σ, q near 0 and 1, the special cases
# (q = 0, q = 1, σ = 0), slow series (small σ, large q) and random points of dptune's planning range
_PSG_CASES = [(0.0, 1.0), (1.0, 1.3), (0.5, 0.0), (0.01, 1.0), (0.128, 12.1), (0.2, 0.3), (0.9, 0.5),
              (0.999, 2.0), (1e-6, 0.1), (0.05, 100.0), (0.3, 1e-3), (0.01, 1e5), (0.1, 0.8)] + [
    (float(10 ** u), float(10 ** v)) for u, v in np.random.default_rng(7).uniform([-5, -1.5], [-0.01, 2], (40, 2))]


@pytest.mark.parametrize("q, sigma", _PSG_CASES)
def test_fast_subsampled_gaussian_rdp_is_dp_accountings_bit_for_bit(q: float, sigma: float) -> None:
    """``_psg`` evaluates dp_accounting's series with array calls (every σ probe of the planner and of
    final-training calibration is one curve): the same floats, not merely close ones."""
    from dptune.accounting._convert import ORDERS
    from dptune.accounting._psg import poisson_gaussian_rdp
    from dptune.accounting._rdp import rdp_of

    expected = rdp_acc._compute_rdp_poisson_subsampled_gaussian(q, sigma, list(ORDERS))  # noqa: SLF001
    assert poisson_gaussian_rdp(q, sigma, ORDERS).tobytes() == expected.tobytes()
    if 0 < q < 1 and sigma > 0:
        event = de.PoissonSampledDpEvent(q, de.GaussianDpEvent(sigma))
        acc = rdp_acc.RdpAccountant(orders=list(ORDERS))
        acc.compose(event)
        assert rdp_of(event).tobytes() == acc._rdp.tobytes()  # noqa: SLF001


def test_score_release_composes() -> None:
    sgd = A.trial_event(noise_multiplier=1.5, sampling_rate=0.04, steps=2250, score_noise=None)
    with_score = A.trial_event(noise_multiplier=1.5, sampling_rate=0.04, steps=2250, score_noise=3.0)
    assert A.epsilon([with_score], DELTA) > A.epsilon([sgd], DELTA)
    both = de.ComposedDpEvent([de.SelfComposedDpEvent(de.PoissonSampledDpEvent(0.04, de.GaussianDpEvent(1.5)), 2250),
                               de.GaussianDpEvent(3.0)])
    assert A.rdp_epsilon([with_score], DELTA) == pytest.approx(oracle_epsilon(both), rel=1e-9)


@pytest.mark.parametrize("shape", [math.inf, 0.0, 1.0, 0.5, 3.0], ids=["poisson", "log", "geom", "tnb0.5", "tnb3"])
@pytest.mark.parametrize("mean", [1.0, 2.0, 5.0, 30.0])
@pytest.mark.parametrize("point", [(1.5, 0.04, 2250, None), (0.9, 0.1, 200, 6.0), (3.0, 0.01, 50, 2.0)])
def test_random_stopping_matches_dp_accounting(shape: float, mean: float, point: tuple) -> None:
    sigma, q, steps, score_noise = point
    trial = A.trial_event(noise_multiplier=sigma, sampling_rate=q, steps=steps, score_noise=score_noise)
    search = de.RepeatAndSelectDpEvent(trial, mean, shape)
    # the RDP bound (charged where no other valid bound is smaller: ``_profile``, tests/test_profile.py)
    assert A.rdp_epsilon([search], DELTA) == pytest.approx(oracle_epsilon(search), rel=0.01)


def _conversion(rdp_fn, lo: float = 1.02, hi: float = 1024.0, delta: float = DELTA) -> float:
    # dp_accounting's RDP -> (ε, δ) conversion, minimised over a continuous order
    def f(lam: float) -> float:
        return rdp_fn(lam) + math.log1p(-1 / lam) - math.log(delta * lam) / (lam - 1)

    res = optimize.minimize_scalar(f, bounds=(lo, hi), method="bounded", options={"xatol": 1e-6})
    return float(res.fun)


@pytest.mark.parametrize("eta", [0.0, 0.5, 1.0, 2.0])
@pytest.mark.parametrize("mean", [2.0, 10.0])
@pytest.mark.parametrize("s", [2.0, 6.0])
def test_tnb_closed_form_gaussian(eta: float, mean: float, s: float) -> None:
    """Theorem 2 for the Gaussian mechanism, ε(λ) = λ / (2 s²), optimised in closed form over λ̂."""
    gamma = A.tnb_gamma(mean=mean, eta=eta)
    assert A.tnb_mean(gamma=gamma, eta=eta) == pytest.approx(mean, rel=1e-6)
    log_inv_gamma = math.log(1 / gamma)
    lam_hat = max(1.0, s * math.sqrt(2 * log_inv_gamma))  # argmin of (λ̂ − 1)/(2s²) + log(1/γ)/λ̂
    c = (1 + eta) * ((lam_hat - 1) / (2 * s * s) + log_inv_gamma / lam_hat)
    closed = _conversion(lambda lam: lam / (2 * s * s) + c + math.log(mean) / (lam - 1))
    ours = A.rdp_epsilon([de.RepeatAndSelectDpEvent(de.GaussianDpEvent(s), mean, eta)], DELTA)
    assert ours >= closed * (1 - 1e-9)  # a grid of orders can only be looser than the continuum
    assert ours == pytest.approx(closed, rel=0.01)


@pytest.mark.parametrize("mean", [2.0, 10.0])
@pytest.mark.parametrize("s", [3.0, 6.0])
def test_poisson_closed_form_gaussian(mean: float, s: float) -> None:
    """Theorem 6 for the Gaussian mechanism with δ̂ from the RDP curve in closed form."""

    def delta_hat(eps_hat: float) -> float:
        # min over orders a of the same RDP→δ bound dp_accounting uses, for ε(a) = a / (2 s²)
        def g(a: float) -> float:
            return (a - 1) * (a / (2 * s * s) - eps_hat + math.log1p(-1 / a)) - math.log(a)

        res = optimize.minimize_scalar(g, bounds=(1.02, 1024.0), method="bounded", options={"xatol": 1e-8})
        return min(1.0, math.exp(res.fun))

    def rdp(lam: float) -> float:
        return lam / (2 * s * s) + mean * delta_hat(math.log1p(1 / (lam - 1))) + math.log(mean) / (lam - 1)

    closed = _conversion(rdp)
    ours = A.rdp_epsilon([de.RepeatAndSelectDpEvent(de.GaussianDpEvent(s), mean, math.inf)], DELTA)
    assert ours == pytest.approx(closed, rel=0.01)


def test_composed_rule_is_plain_composition() -> None:
    trial = A.trial_event(noise_multiplier=1.0, sampling_rate=0.05, steps=300, score_noise=4.0)
    rule = A.stopping_rule("composed", mean=5)
    assert A.rdp_epsilon([rule.search_event(trial)], DELTA) == pytest.approx(
        oracle_epsilon(de.SelfComposedDpEvent(trial, 5)), rel=1e-9)


def _space(space: dict, fixed: dict | None = None, default: dict | None = None) -> object:
    return parse_space({
        "dataset": {"name": "digits", "public_validation": True},
        "fixed": {"epochs": 10, **(fixed or {})},
        "space": space,
        "default": default or {},
        "privacy": {"delta": DELTA, "stopping": "poisson", "mean": 3},
    })


def test_worst_case_takes_smallest_sigma() -> None:
    space = _space({"noise_multiplier": {"type": "float", "low": 0.8, "high": 2.0}}, {"batch_size": 128},
                   {"noise_multiplier": 1.0})
    plan = A.plan_search(space, 1257)
    assert {p.noise_multiplier for p in plan.points} == {0.8}
    steps = math.ceil(10 * 1257 / 128)
    assert plan.trial_epsilon == pytest.approx(A.epsilon([A.trial_event(noise_multiplier=0.8, sampling_rate=128 / 1257, steps=steps, score_noise=None)], DELTA))
    search = de.RepeatAndSelectDpEvent(A.trial_event(noise_multiplier=0.8, sampling_rate=128 / 1257, steps=steps, score_noise=None), 3.0, math.inf)
    assert plan.search_event == search
    assert A.rdp_epsilon([search], DELTA) == pytest.approx(oracle_epsilon(search), rel=0.01)
    assert plan.search_epsilon == A.epsilon([search], DELTA) <= A.rdp_epsilon([search], DELTA)


def test_two_batch_sizes_cost_at_least_either() -> None:
    both = A.plan_search(_space({"batch_size": [32, 512]}, {"noise_multiplier": 1.0}, {"batch_size": 32}), 1257)
    for b in (32, 512):
        alone = A.plan_search(_space({}, {"noise_multiplier": 1.0, "batch_size": b}), 1257)
        assert both.trial_epsilon >= alone.trial_epsilon - 1e-12
        assert both.search_epsilon >= alone.search_epsilon - 1e-12
    assert len(both.points) == 2


def test_worst_case_curve_is_pointwise_max() -> None:
    e1, e2 = A.trial_event(noise_multiplier=1.0, sampling_rate=0.02, steps=1000, score_noise=None), A.trial_event(noise_multiplier=1.0, sampling_rate=0.3, steps=40, score_noise=None)
    mix = A.WorstCaseDpEvent((e1, e2))
    assert np.array_equal(A.rdp_of(mix), np.maximum(A.rdp_of(e1), A.rdp_of(e2)))


def test_sigma_floor_fits_target() -> None:
    space = _space({"noise_multiplier": {"type": "float", "low": 0.8, "high": 4.0}}, {"batch_size": 128},
                   {"noise_multiplier": 1.0})
    floor = A.sigma_floor(space, 1257, target_epsilon=4.0)
    assert floor is not None
    assert A.plan_search(space, 1257, sigma_low=floor).search_epsilon <= 4.0
    assert A.plan_search(space, 1257, sigma_low=floor * 0.99).search_epsilon > 4.0


@pytest.mark.parametrize("rule", [A.stopping_rule("poisson", mean=3.0), A.stopping_rule("tnb", mean=3.0, eta=0.0),
                                  A.stopping_rule("tnb", mean=3.0, eta=1.0), A.stopping_rule("tnb", mean=4.0, eta=2.5)],
                         ids=lambda r: r.label())
def test_draw_k_has_the_configured_distribution(rule: A.StoppingRule) -> None:
    rng = np.random.default_rng(1)
    ks = np.array([rule.draw_k(rng) for _ in range(20000)])
    assert ks.mean() == pytest.approx(rule.mean, rel=0.04)
    if isinstance(rule, A.Poisson):
        assert (ks == 0).mean() == pytest.approx(math.exp(-rule.mean), abs=0.01)
    else:
        assert ks.min() >= 1  # TNB is supported on K >= 1
    if isinstance(rule, A.TruncatedNegativeBinomial) and rule.eta == 1.0:  # geometric: P[K = 1] = γ
        assert (ks == 1).mean() == pytest.approx(1 / rule.mean, abs=0.015)


def test_stopping_rule_description_never_has_k() -> None:
    d = A.stopping_rule("tnb", mean=3.0, eta=0.0).describe()
    assert set(d) == {"rule", "mean", "eta", "gamma"}


@pytest.mark.parametrize("kwargs, field", [
    (dict(noise_multiplier=0.0, sampling_rate=0.1, steps=10, score_noise=None), "noise_multiplier"),
    (dict(noise_multiplier=-1.0, sampling_rate=0.1, steps=10, score_noise=None), "noise_multiplier"),
    (dict(noise_multiplier=1.0, sampling_rate=0.0, steps=10, score_noise=None), "sampling_rate"),
    (dict(noise_multiplier=1.0, sampling_rate=1.5, steps=10, score_noise=None), "sampling_rate"),
    (dict(noise_multiplier=1.0, sampling_rate=0.1, steps=0, score_noise=None), "steps"),
    (dict(noise_multiplier=1.0, sampling_rate=0.1, steps=10, score_noise=0.0), "score_noise"),
])
def test_bad_trial_parameters(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError) as e:
        A.trial_event(**kwargs)
    assert e.value.field == field


@pytest.mark.parametrize("name, kwargs, field", [
    ("nope", dict(mean=3.0), "privacy.stopping"), ("poisson", dict(mean=0.5), "privacy.mean"),
    ("tnb", dict(mean=3.0, eta=-1.0), "privacy.eta"), ("composed", dict(mean=2.5), "privacy.mean"),
    ("tnb", dict(mean=True), "privacy.mean"), ("poisson", dict(mean=math.inf), "privacy.mean"),
])
def test_bad_stopping_rules(name: str, kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError) as e:
        A.stopping_rule(name, **kwargs)
    assert e.value.field == field


def test_events_round_trip_json() -> None:
    trial = A.WorstCaseDpEvent((A.trial_event(noise_multiplier=1.0, sampling_rate=0.1, steps=10, score_noise=2.0), A.trial_event(noise_multiplier=1.0, sampling_rate=0.2, steps=5, score_noise=2.0)))
    for ev in (de.RepeatAndSelectDpEvent(trial, 3.0, math.inf), de.SelfComposedDpEvent(trial, 4)):
        back = A.event_from_json(A.event_to_json(ev))
        assert A.epsilon([back], DELTA) == A.epsilon([ev], DELTA)
    with pytest.raises(ValueError):
        A.event_from_json({"type": "os.system", "x": 1})


# --- stopping rules are types, chosen in one catalogue ------------------------------------------------

RULES = [*A.comparison_rules(3.0), A.stopping_rule("tnb", mean=4.0, eta=2.5), A.stopping_rule("composed", mean=1)]


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.label())
def test_rule_owns_its_charge(rule: A.StoppingRule) -> None:
    """search_rdp (the vectorised transform) is the RDP of search_event, for one curve and a batch."""
    trials = [A.trial_event(noise_multiplier=s, sampling_rate=0.05, steps=200, score_noise=6.0) for s in (0.9, 2.0)]
    for trial in (*trials, A.WorstCaseDpEvent(tuple(trials))):
        assert rule.search_rdp(A.rdp_of(trial)) == pytest.approx(A.rdp_of(rule.search_event(trial)), rel=1e-12)
    batch = np.stack([A.rdp_of(t) for t in trials])
    assert rule.search_rdp(batch) == pytest.approx(np.stack([A.rdp_of(rule.search_event(t)) for t in trials]),
                                                   rel=1e-12)
    assert rule.from_search_event(rule.search_event(trials[0])) == (trials[0], rule)
    assert type(rule).from_settings({n: getattr(rule, n) for n in rule.setting_names()}) == rule
    assert rule.describe()["rule"] == rule.name and A.STOPPING_RULES[rule.name] is type(rule)


def test_catalogue() -> None:
    """Every registered rule's variants, in registration order (the built-ins first: their labels are known answers;
    a rule registered later follows them, tests/test_registry_contracts.py)."""
    assert list(A.STOPPING_RULES)[:3] == ["poisson", "tnb", "composed"]
    assert A.comparison_rules(2.6) == [r for cls in A.STOPPING_RULES.values() if cls.accounting != "filter"
                                       for r in cls.variants(2.6)]  # the filter prices ASHA's segments only
    assert [r.label() for r in A.comparison_rules(2.6)][:4] == [
        "poisson(mean=2.6)", "logarithmic(eta=0, mean=2.6)", "geometric(eta=1, mean=2.6)", "composed(3 trials)"]
    rule = A.stopping_rule("tnb", mean=3.0, eta=0.0)
    assert A.alternative_rules(rule) == [r for r in A.comparison_rules(3.0) if r != rule]
    with pytest.raises(TypeError):
        A.StoppingRule(mean=3.0)  # type: ignore[abstract]  # the base is abstract: rules come from the catalogue


# --- one σ calibration routine with a stated guarantee --------------------------------------------------


def _search_cost(sigma: float) -> float:
    trial = A.trial_event(noise_multiplier=sigma, sampling_rate=0.05, steps=200, score_noise=6.0)
    return A.epsilon([A.stopping_rule("poisson", mean=3.0).search_event(trial)], DELTA)


def _subsampled_cost(sigma: float) -> float:
    space = _space({"batch_size": [64, 128]}, {"noise_multiplier": 1.0}, {"batch_size": 64})
    import dataclasses

    return A.plan_search(dataclasses.replace(space, tune_fraction=0.5), 1257, sigma_low=sigma,
                         compare=False).search_epsilon


@pytest.mark.parametrize("cost, target, rel_tol", [(_search_cost, 2.0, 2e-3), (_search_cost, 6.0, 1e-3),
                                                   (_subsampled_cost, 3.0, 1e-2)])
def test_calibrate_sigma_guarantee(cost, target: float, rel_tol: float) -> None:  # type: ignore[no-untyped-def]
    sigma = A.calibrate_sigma(cost, target_epsilon=target, lo=0.5, hi=200.0, rel_tol=rel_tol)
    assert sigma is not None and 0.5 < sigma <= 200.0
    assert cost(sigma) <= target < cost(sigma * (1 - rel_tol))


def test_calibrate_sigma_bounds() -> None:
    assert A.calibrate_sigma(_search_cost, target_epsilon=1e4, lo=0.5, hi=200.0, rel_tol=1e-3) == 0.5  # lo fits
    # the score releases alone cost more than 0.01: no σ fits
    assert A.calibrate_sigma(_search_cost, target_epsilon=0.01, lo=0.5, hi=200.0, rel_tol=1e-3) is None
    with pytest.raises(ValueError):
        A.calibrate_sigma(_search_cost, target_epsilon=1.0, lo=2.0, hi=1.0, rel_tol=1e-3)


def test_calibrate_noise_multiplier_names_fields() -> None:
    with pytest.raises(ConfigError) as e:
        A.calibrate_noise_multiplier([], sampling_rate=0.05, steps=100, delta=DELTA, target_epsilon=0.0)
    assert e.value.field == "target_epsilon"
    sigma = A.calibrate_noise_multiplier([], sampling_rate=0.05, steps=100, delta=DELTA, target_epsilon=2.0)
    final = A.trial_event(noise_multiplier=sigma, sampling_rate=0.05, steps=100, score_noise=None)
    assert A.epsilon([final], DELTA) <= 2.0 < A.epsilon(
        [A.trial_event(noise_multiplier=sigma * (1 - 2e-3), sampling_rate=0.05, steps=100, score_noise=None)], DELTA)


# --- privacy parameters are keyword-only ------------------------------------------------------------


def test_privacy_parameters_are_keyword_only() -> None:
    calls = [
        lambda: A.trial_event(1.5, 0.04, 100, None),  # type: ignore[misc]
        lambda: A.TrialPoint(1.5, 0.04, 100, None),  # type: ignore[misc]
        lambda: A.calibrate_noise_multiplier([], 0.04, 100, DELTA, 2.0),  # type: ignore[misc]
        lambda: A.poisson_subsampled_rdp(A.ORDERS, A.ORDERS, 0.5),  # type: ignore[misc]
        lambda: A.random_stopping_rdp(A.ORDERS, A.ORDERS, 3.0, math.inf),  # type: ignore[misc]
        lambda: A.stopping_rule("poisson", 3.0),  # type: ignore[misc]
        lambda: A.Poisson(3.0),  # type: ignore[misc]
        lambda: A.tnb_gamma(3.0, 1.0),  # type: ignore[misc]
        lambda: A.sigma_floor(_space({}), 1257, 4.0),  # type: ignore[misc]
        lambda: A.epsilon(A.trial_event(noise_multiplier=1.0, sampling_rate=0.1, steps=1, score_noise=None), DELTA),
    ]
    for call in calls:
        with pytest.raises(TypeError):
            call()
