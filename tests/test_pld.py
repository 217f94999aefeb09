"""The tighter accountant: PLD behind one interface with RDP, the minimum charged, calibration on it.

Oracles: dp_accounting's own ``PLDAccountant`` (default discretization 1e-4) and ``RdpAccountant``, Opacus'
PRV accountant (Gopi, Lee & Wutschitz 2021), and the exact hockey-stick divergence of the exponential mechanism
on neighbouring count vectors (computed here from its definition) for the noisy max's PLD."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest
from dp_accounting import dp_event as de
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant

from dptune import accounting as A
from dptune.certificate import Certificate, load_certificate

DELTA = 1e-5


def _sgd(q: float, sigma: float, steps: int) -> de.DpEvent:
    return de.SelfComposedDpEvent(de.PoissonSampledDpEvent(q, de.GaussianDpEvent(sigma)), steps)


def _pld_oracle(events: list[de.DpEvent], delta: float = DELTA) -> float:
    acc = PLDAccountant()  # dp_accounting's default discretization, 1e-4: finer than dptune's
    for e in events:
        acc.compose(e)
    return float(acc.get_epsilon(delta))


def _rdp_oracle(events: list[de.DpEvent], delta: float = DELTA) -> float:
    acc = RdpAccountant()
    for e in events:
        acc.compose(e)
    return float(acc.get_epsilon(delta))


def test_dp_sgd_known_setting_matches_pld_and_prv_and_beats_rdp() -> None:
    """q = 0.01, σ = 1.1, 1000 steps, δ = 1e-5: dp_accounting's PLD 1.515, Opacus' PRV 1.525, RDP 1.712."""
    from opacus.accountants import PRVAccountant

    event = A.trial_event(noise_multiplier=1.1, sampling_rate=0.01, steps=1000, score_noise=None)
    prv = PRVAccountant()
    prv.history = [(1.1, 0.01, 1000)]
    prv_eps = float(prv.get_epsilon(delta=DELTA))
    pld_eps, rdp_eps = _pld_oracle([_sgd(0.01, 1.1, 1000)]), _rdp_oracle([_sgd(0.01, 1.1, 1000)])
    ours = A.certify([event], DELTA)
    assert ours.accountant == "pld"
    assert pld_eps <= ours.epsilon <= pld_eps * 1.01  # pessimistic at a coarser grid: an upper bound, within 1 %
    assert ours.epsilon == pytest.approx(prv_eps, rel=0.01)
    assert ours.epsilon < rdp_eps and rdp_eps == pytest.approx(A.rdp_epsilon([event], DELTA), rel=1e-9)
    assert (pld_eps, prv_eps, rdp_eps) == pytest.approx((1.5154, 1.5255, 1.7118), rel=2e-3)


@pytest.mark.parametrize("score_noise", [None, 20.0])
def test_composed_search_and_final_training_within_one_percent_of_pld(score_noise: float | None) -> None:
    """A composed search (5 trials with or without their score releases) and the final run, as the ledger and
    the composed certificate hold them: dptune's ε is within 1 % above dp_accounting's PLD, below RDP."""
    trial = A.trial_event(noise_multiplier=3.0, sampling_rate=256 / 8000, steps=313, score_noise=score_noise)
    search = A.stopping_rule("composed", mean=5).search_event(trial)
    final = A.trial_event(noise_multiplier=1.4, sampling_rate=256 / 9000, steps=352, score_noise=None)
    events = [search, final]
    pld_eps = _pld_oracle(events)
    ours = A.certify(events, DELTA)
    assert ours.accountant == "pld" and pld_eps <= ours.epsilon <= 1.01 * pld_eps
    assert ours.epsilon < _rdp_oracle(events)
    assert A.epsilon(events, DELTA) == ours.epsilon == A.round_up_epsilon(
        min(A.rdp_epsilon(events, DELTA), A.pld_epsilon(events, DELTA)))


def test_random_stopping_and_subsampled_search_stay_rdp() -> None:
    """Papernot-Steinke and the Zhu-Wang subsampled search are RDP theorems: no PLD. The subsampled search is
    charged its RDP bound; random stopping alone the smaller of RDP and its trial's privacy-profile bound
    (``_profile``, issue 25; ``tests/test_profile.py``)."""
    trial = A.trial_event(noise_multiplier=1.0, sampling_rate=0.05, steps=200, score_noise=5.0)
    stopping = A.stopping_rule("poisson", mean=3).search_event(trial)
    for event in (stopping,
                  A.subsampled_search_event(A.stopping_rule("tnb", mean=3, eta=1).search_event(trial), fraction=0.5)):
        assert A.pld_of(event) is None and A.pld_epsilon([event], DELTA) is None
        bound = A.certify([event], DELTA)
        if event is stopping:
            profile = A.profile_epsilon([event], DELTA)
            assert profile is not None and bound.accountant == "profile" and bound.epsilon == A.round_up_epsilon(profile)
            assert profile < A.rdp_epsilon([event], DELTA)
        else:
            assert bound.accountant == "rdp" and bound.epsilon == A.round_up_epsilon(A.rdp_epsilon([event], DELTA))
    # a worst case over different mechanisms has no PLD here; over one mechanism it is that mechanism
    other = A.trial_event(noise_multiplier=1.0, sampling_rate=0.1, steps=100, score_noise=5.0)
    assert A.pld_of(A.WorstCaseDpEvent((trial, other))) is None
    assert A.pld_epsilon([A.WorstCaseDpEvent((trial, trial))], DELTA) == A.pld_epsilon([trial], DELTA)
    assert A.accountant("pld").can_account(trial) and not A.accountant("pld").can_account(
        A.WorstCaseDpEvent((trial, other)))
    with pytest.raises(ValueError):
        A.accountant("prv")
    with pytest.raises(TypeError):
        A.certify(trial, DELTA)  # type: ignore[arg-type]


# --- the noisy max: pure (1/β)-DP as a randomized-response PLD, against the exact curve ----------------------


def _exp_mech(u: np.ndarray, beta: float) -> np.ndarray:
    w = np.exp((u - u.max()) / beta)
    return w / w.sum()


def _hockey_stick(p: np.ndarray, q: np.ndarray, eps: float) -> float:
    return float(np.sum(np.maximum(0.0, p - math.exp(eps) * q)))


def _count_pairs(k: int, rng: np.random.Generator) -> list[tuple[np.ndarray, np.ndarray]]:
    """Neighbouring validation correct-counts: u and u + d, d ∈ {0, 1}^k (one example added), over tied,
    spread and random counts; every d for k <= 5."""
    bases = [np.zeros(k), np.arange(k, dtype=float) * 3, rng.integers(0, 40, size=k).astype(float)]
    ds = [np.array(d, dtype=float) for d in itertools.product((0, 1), repeat=k)] if k <= 5 else [
        rng.integers(0, 2, size=k).astype(float) for _ in range(32)]
    return [(u, u + d) for u in bases for d in ds]


@pytest.mark.parametrize("beta", [0.5, 2.6, 9.0])
def test_noisy_max_pld_upper_bounds_the_exact_privacy_curve(beta: float) -> None:
    """The PLD dptune uses for ``NoisyMaxDpEvent(β)`` is ``from_privacy_parameters(1/β, 0)`` (the pure-DP
    dominating pair); its δ(ε) is at least the exact hockey-stick divergence of P ∝ exp(u/β) between
    neighbouring count vectors, both directions, at every ε in [0, 1/β] — and at ε = 1/β both are 0."""
    pld = A.pld_of(A.NoisyMaxDpEvent(beta))
    assert pld is not None
    eps_grid = np.linspace(0.0, 1 / beta, 11)
    bound = np.array([pld.get_delta_for_epsilon(float(e)) for e in eps_grid])
    rng = np.random.default_rng(3)
    worst = np.zeros_like(eps_grid)
    for k in (2, 3, 5, 12):
        for u, v in _count_pairs(k, rng):
            p, q = _exp_mech(u, beta), _exp_mech(v, beta)
            for i, e in enumerate(eps_grid):
                worst[i] = max(worst[i], _hockey_stick(p, q, e), _hockey_stick(q, p, e))
    assert np.all(worst <= bound + 1e-12), (worst, bound)
    # pure (1/β)-DP: nothing beyond ε = 1/β (the PLD's losses are rounded up to its 1e-3 grid)
    assert worst[-1] <= 1e-12 and pld.get_delta_for_epsilon(1 / beta + 1e-3) <= 1e-12
    # the randomized-response pair's own curve, in closed form: δ(ε) = (e^{ε₀} − e^ε)/(1 + e^{ε₀}), ε ≤ ε₀
    e0 = 1 / beta
    closed = (math.exp(e0) - np.exp(eps_grid)) / (1 + math.exp(e0))
    assert np.all(closed <= bound + 1e-12) and bound == pytest.approx(closed, abs=1e-3)  # the 1e-3 grid
    assert worst[0] >= 0.25 * bound[0]  # not vacuous: two tied candidates come close at ε = 0


def test_noisy_max_search_composes_in_pld() -> None:
    """The scaled searcher's charge (composed trials + one noisy max) has a PLD: the trials' PLD composed with
    the pure-DP pair, priced here with dp_accounting's primitives; the charge is the smaller bound."""
    from dp_accounting.pld import privacy_loss_distribution as pldlib
    from dp_accounting.pld.common import DifferentialPrivacyParameters

    trials = A.stopping_rule("composed", mean=5).search_event(
        A.trial_event(noise_multiplier=8.8, sampling_rate=0.032, steps=313, score_noise=None))
    search = A.with_selection(trials, A.NoisyMaxDpEvent(9.0))
    acc = PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(trials)
    rr = pldlib.from_privacy_parameters(DifferentialPrivacyParameters(1 / 9.0, 0.0), value_discretization_interval=1e-4)
    oracle = acc._pld.compose(rr).get_epsilon_for_delta(DELTA)  # noqa: SLF001 - the accountant's PLD
    ours = A.pld_epsilon([search], DELTA)
    assert ours is not None and oracle <= ours <= 1.01 * oracle
    assert A.epsilon([search], DELTA) == A.round_up_epsilon(min(ours, A.rdp_epsilon([search], DELTA)))


# --- calibration on the tighter bound ------------------------------------------------------------------


def test_calibration_meets_the_target_under_the_charged_bound_and_uses_less_noise() -> None:
    """The calibrated σ fits the target under the charged bound (the minimum) and σ·(1 − 2e-3) does not; it is
    below the σ RDP alone would need (the gain becomes less noise)."""
    prior = [A.with_selection(A.stopping_rule("composed", mean=5).search_event(
        A.trial_event(noise_multiplier=8.8, sampling_rate=0.032, steps=313, score_noise=None)), A.NoisyMaxDpEvent(9.0))]
    q, steps, target = 256 / 9000, 352, 2.0
    sigma = A.calibrate_noise_multiplier(prior, sampling_rate=q, steps=steps, delta=DELTA, target_epsilon=target)

    def run(s: float) -> list[de.DpEvent]:
        return [*prior, A.trial_event(noise_multiplier=s, sampling_rate=q, steps=steps, score_noise=None)]

    assert A.epsilon(run(sigma), DELTA) <= target < A.epsilon(run(sigma * (1 - 2e-3)), DELTA)
    rdp_sigma = A.calibrate_sigma(lambda s: A.rdp_epsilon(run(s), DELTA), target_epsilon=target, lo=1e-3, hi=1e6,
                                  rel_tol=2e-3)
    assert rdp_sigma is not None and sigma < 0.97 * rdp_sigma
    assert A.certify(run(sigma), DELTA).accountant == "pld"


@pytest.mark.parametrize("target", [1.0, 2.0, 6.0])
def test_calibration_after_a_search_keeps_its_guarantee_in_few_probes(target: float) -> None:
    """The final run's calibration after a composed search (the MNIST plan's shape): the guarantee under the
    charged bound, in at most 14 RDP and 5 PLD evaluations (the plain bisection with a TIGHT_STEP walk took
    16-19 and 6-10; every PLD evaluation is ~10-40 ms)."""
    prior = [A.with_selection(A.stopping_rule("composed", mean=5).search_event(
        A.trial_event(noise_multiplier=8.8, sampling_rate=0.032, steps=313, score_noise=None)), A.NoisyMaxDpEvent(9.0))]
    q, steps = 256 / 9000, 352
    calls = {"rdp": 0, "tight": 0}

    def run(s: float) -> list[de.DpEvent]:
        return [*prior, A.trial_event(noise_multiplier=s, sampling_rate=q, steps=steps, score_noise=None)]

    def rdp(s: float) -> float:
        calls["rdp"] += 1
        return A.rdp_epsilon(run(s), DELTA)

    def tight(s: float) -> float | None:
        calls["tight"] += 1
        return A.tight_epsilon(run(s), DELTA)

    sigma = A.calibrate_tight(tight, upper_cost=rdp, target_epsilon=target, lo=1e-3, hi=1e6, rel_tol=2e-3)
    assert sigma is not None
    assert A.epsilon(run(sigma), DELTA) <= target < A.epsilon(run(sigma * (1 - 2e-3)), DELTA)
    assert calls["rdp"] <= 14 and calls["tight"] <= 5, calls


def test_calibrate_tight_keeps_the_guarantee_where_both_bounds_agree() -> None:
    """Where the cost is the upper bound itself (random stopping: RDP only) the RDP σ is returned as is."""
    trial = A.trial_event(noise_multiplier=1.0, sampling_rate=0.05, steps=200, score_noise=5.0)
    rule = A.stopping_rule("poisson", mean=3)

    def cost(s: float) -> float:
        return A.epsilon([rule.search_event(A.trial_event(noise_multiplier=s, sampling_rate=0.05, steps=200,
                                                          score_noise=5.0))], DELTA)

    tight = A.calibrate_tight(cost, upper_cost=cost, target_epsilon=6.0, lo=0.5, hi=100.0, rel_tol=1e-3)
    plain = A.calibrate_sigma(cost, target_epsilon=6.0, lo=0.5, hi=100.0, rel_tol=1e-3)
    assert tight == plain and tight is not None
    assert cost(tight) <= 6.0 < cost(tight * (1 - 1e-3))
    assert trial is not None


# --- certificates and the ledger ---------------------------------------------------------------------


def test_certificate_names_its_bound_and_old_rdp_certificates_still_verify(tmp_path: Path) -> None:
    final = A.trial_event(noise_multiplier=1.1, sampling_rate=0.01, steps=1000, score_noise=None)
    cert = Certificate.build("ds", DELTA, [("final", final)], {"rule": "none"})
    assert cert.bound == "pld" and cert.epsilon == A.epsilon([final], DELTA)
    cert.save(tmp_path / "new.json")
    data = json.loads((tmp_path / "new.json").read_text())
    assert data["bound"] == "pld" and "PLD" in data["accountant"]
    assert load_certificate(tmp_path / "new.json").bound == "pld"
    # a certificate written before the PLD: no "bound", the RDP ε — it still loads and verifies, as RDP
    old = {k: v for k, v in data.items() if k != "bound"}
    old["epsilon"] = A.rdp_epsilon([final], DELTA)
    old["accountant"] = "RDP (dp_accounting orders), Papernot-Steinke random stopping, composed over events"
    (tmp_path / "old.json").write_text(json.dumps(old))
    loaded = load_certificate(tmp_path / "old.json")
    assert loaded.bound == "rdp" and loaded.epsilon > cert.epsilon
    # stating the PLD ε under the RDP name (or less than either bound) is refused
    (tmp_path / "forged.json").write_text(json.dumps({**old, "epsilon": cert.epsilon}))
    with pytest.raises(Exception, match="events cost"):
        load_certificate(tmp_path / "forged.json")
    (tmp_path / "unknown.json").write_text(json.dumps({**data, "bound": "prv"}))
    with pytest.raises(Exception, match="bound"):
        load_certificate(tmp_path / "unknown.json")


def test_ledger_totals_compose_with_the_same_bound(tmp_path: Path) -> None:
    from dptune.ledger import Ledger

    ledger = Ledger(tmp_path / "l.sqlite")
    ledger.set_budget("fp", 3.0, DELTA)
    run = A.trial_event(noise_multiplier=1.1, sampling_rate=0.01, steps=1000, score_noise=None)
    ledger.reserve("fp", "a", run)
    ledger.reserve("fp", "b", run)
    spent = ledger.spent("fp")
    assert spent == pytest.approx(A.epsilon([run, run], DELTA), rel=1e-12)
    assert spent < A.rdp_epsilon([run, run], DELTA) and spent < 2 * A.epsilon([run], DELTA)  # composed, not added
    assert spent == pytest.approx(_pld_oracle([_sgd(0.01, 1.1, 2000)]), rel=0.01)


def test_degenerate_events_are_left_to_rdp() -> None:
    """σ = 0 (no privacy), q = 0 and no events at all: the PLD does not claim them; RDP's answer stands."""
    assert A.certify([de.GaussianDpEvent(0.0)], DELTA) == A.Bound(epsilon=math.inf, delta=DELTA, accountant="rdp")
    assert A.certify([], DELTA).epsilon == 0.0
    assert A.pld_of(de.PoissonSampledDpEvent(0.0, de.GaussianDpEvent(1.0))) is None
    assert A.pld_of(A.NoisyMaxDpEvent(0.0)) is None


# --- RDP part ⊗ PLD part (final training after random stopping) -----------------------------------------


def test_rdp_pld_bound_is_exact_for_a_free_rdp_part_and_above_the_truth() -> None:
    """With an RDP part that costs nothing the bound is the PLD part's own ε; with a Gaussian as the RDP part it
    lies between the (near-exact) PLD of both and RDP of both — never below the truth."""
    from dptune.accounting._mixed import rdp_pld_epsilon

    sgd = A.trial_event(noise_multiplier=1.1, sampling_rate=0.01, steps=1000, score_noise=None)
    pld = A.pld_of(sgd)
    assert rdp_pld_epsilon(np.zeros_like(A.ORDERS), pld, DELTA) == pytest.approx(A.pld_epsilon([sgd], DELTA), abs=2e-3)
    for sigma in (2.0, 5.0):
        g = de.GaussianDpEvent(sigma)
        mixed = rdp_pld_epsilon(A.rdp_of(g), pld, DELTA)
        assert _pld_oracle([_sgd(0.01, 1.1, 1000), g]) <= mixed < A.rdp_epsilon([g, sgd], DELTA)


def test_final_training_after_random_stopping_is_charged_rdp_pld_and_calibrates_less_noise() -> None:
    search = A.stopping_rule("poisson", mean=2).search_event(
        A.trial_event(noise_multiplier=2.0, sampling_rate=128 / 1257, steps=148, score_noise=9.0))
    q, steps, target = 128 / 1437, 169, 8.0
    sigma = A.calibrate_noise_multiplier([search], sampling_rate=q, steps=steps, delta=DELTA, target_epsilon=target)

    def run(s: float) -> list[de.DpEvent]:
        return [search, A.trial_event(noise_multiplier=s, sampling_rate=q, steps=steps, score_noise=None)]

    bound = A.certify(run(sigma), DELTA)
    # rdp+pld, or since issue 25 profile+pld: the same with the search's privacy-profile bound (tests/test_profile.py)
    assert bound.accountant in ("rdp+pld", "profile+pld")
    assert bound.epsilon <= target < A.epsilon(run(sigma * (1 - 2e-3)), DELTA)
    assert A.accountant("rdp+pld").epsilon(run(sigma), delta=DELTA) is not None
    assert bound.epsilon < A.rdp_epsilon(run(sigma), DELTA)
    rdp_sigma = A.calibrate_sigma(lambda s: A.rdp_epsilon(run(s), DELTA), target_epsilon=target, lo=1e-3, hi=1e6,
                                  rel_tol=2e-3)
    assert rdp_sigma is not None and sigma < 0.97 * rdp_sigma
    # a composition without a PLD part, or without an RDP part, is not this accountant's
    assert A.accountant("rdp+pld").epsilon([search], delta=DELTA) is None
    assert A.accountant("rdp+pld").epsilon(run(sigma)[1:], delta=DELTA) is None


@pytest.mark.parametrize("sigma", [0.7, 2.0])
def test_pessimistic_gaussian_pld_dominates_at_negative_epsilon_too(sigma: float) -> None:
    """Step 2 of ``_mixed``'s proof: the PLD dptune composes is a dominating pair for every α = e^ε, ε real —
    checked against the Gaussian's exact curve Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2), μ = 1/σ."""
    from scipy.stats import norm

    pld = A.pld_of(de.GaussianDpEvent(sigma))
    assert pld is not None
    mu = 1 / sigma
    for eps in np.linspace(-3.0, 2.0, 21):
        exact = norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2)
        assert pld.get_delta_for_epsilon(float(eps)) >= exact - 1e-12


@pytest.mark.parametrize("vdi", [1e-3, 1e-4])
def test_the_vectorised_subsampled_gaussian_is_dp_accountings_distribution_byte_for_byte(vdi: float) -> None:
    """dptune builds the Poisson-subsampled Gaussian's PLD with the connect-the-dots points computed in arrays
    (``subsampled_gaussian_pld``); it must be dp_accounting's ``from_gaussian_mechanism`` exactly: every field of
    both pmfs (add and remove), bytes compared, over σ from 0.3 to 80 and q from 1e-4 to 0.95, and the ε read off."""
    from dp_accounting.pld import privacy_loss_distribution as pldlib

    from dptune.accounting._pld import subsampled_gaussian_pld

    def fields(p: object) -> list[tuple[str, object]]:
        out = []
        for side in ("_pmf_remove", "_pmf_add"):
            for k, v in sorted(vars(getattr(p, side)).items()):
                out.append((f"{side}.{k}", v.tobytes() if isinstance(v, np.ndarray) else v))
        return out

    rng = np.random.default_rng(7)
    grid = [(0.3, 0.95), (80.0, 1e-4), (1.0, 0.5), (0.8, 1.0), (25.0, 1.0)] + [
        (float(np.exp(rng.uniform(math.log(0.3), math.log(80)))), float(np.exp(rng.uniform(math.log(1e-4), math.log(0.95)))))
        for _ in range(12)]
    if vdi < 1e-3:  # dp_accounting's own interval: ten times the points (and its scalar loop ten times slower)
        grid = [(1.0, 0.01)]
    for sigma, q in grid:
        ours = subsampled_gaussian_pld(standard_deviation=sigma, sampling_prob=q, value_discretization_interval=vdi)
        theirs = pldlib.from_gaussian_mechanism(standard_deviation=sigma, sampling_prob=q,
                                                value_discretization_interval=vdi)
        assert fields(ours) == fields(theirs), (sigma, q)
        composed = ours.self_compose(50)
        assert composed.get_epsilon_for_delta(DELTA) == theirs.self_compose(50).get_epsilon_for_delta(DELTA)


def test_self_composition_is_dp_accountings() -> None:
    """``self_compose`` (the Chernoff bounds' logsumexp without SciPy's array-API layer) gives dp_accounting's
    ``PrivacyLossDistribution.self_compose``, for subsampled Gaussians (asymmetric, dense), the Gaussian (symmetric)
    and the noisy max's randomized response, from 2 to 20,000 compositions. Byte for byte until issue 58; now its
    complex power is ``_strictmath``'s (the same on every CPU) and dp_accounting's NumPy's, so the distributions agree
    as the FFT's rounding allows: the same discretization, δ(ε) to 1e-4 of itself (the tail carries the rounding of
    thousands of products) and the mass at infinity to 1e-9."""
    from dp_accounting.pld import privacy_loss_distribution as pldlib

    from dptune.accounting._pld import noisy_max_pld, self_compose, subsampled_gaussian_pld

    def fields(p: object) -> list[tuple[str, object]]:
        sides = ["_pmf_remove"] + ([] if p._symmetric else ["_pmf_add"])  # type: ignore[attr-defined]
        return [(f"{side}.{k}", v.tobytes() if isinstance(v, np.ndarray) else v)
                for side in sides for k, v in sorted(vars(getattr(p, side)).items())]

    ones = [subsampled_gaussian_pld(standard_deviation=s, sampling_prob=q) for s, q in
            [(0.6, 0.02), (3.0, 0.25), (40.0, 0.001)]]
    ones += [pldlib.from_gaussian_mechanism(standard_deviation=2.0, value_discretization_interval=1e-3),
             noisy_max_pld(gumbel_scale=4.0)]
    for i, one in enumerate(ones):
        for count in (2, 1407) if i else (2, 1407, 20000):
            ours, theirs = self_compose(one, count), one.self_compose(count)
            assert len(fields(ours)) == len(fields(theirs)) and ours._symmetric == theirs._symmetric
            for eps in (0.5, 1.0, 2.0, 4.0, 8.0):
                d_ours, d_theirs = ours.get_delta_for_epsilon(eps), theirs.get_delta_for_epsilon(eps)
                assert d_ours == pytest.approx(d_theirs, rel=1e-4, abs=1e-15), (i, count, eps)
            assert ours._pmf_remove._infinity_mass == pytest.approx(theirs._pmf_remove._infinity_mass, rel=1e-9)


def test_fftconvolve_is_scipys() -> None:
    """dp_accounting's convolutions and dptune's profile and mixed bounds use ``_pld.fftconvolve`` (SciPy's steps without
    importing scipy.signal): ``scipy.signal.fftconvolve`` in every mode, for lengths 1 to 5,000, to the FFT's rounding
    (byte for byte until issue 58; its spectra's product is now ``_strictmath.complex_multiply``, FMA-free)."""
    from scipy import signal

    from dptune.accounting._pldlib import fftconvolve

    rng = np.random.default_rng(3)
    for n1, n2 in [(1, 1), (1, 7), (7, 1), (2, 3), (1000, 1000), (4097, 311), (311, 4097), (5000, 64)]:
        a, b = rng.random(n1), rng.random(n2) * 1e-3
        for mode in ("full", "same", "valid"):
            ours, theirs = fftconvolve(a, b, mode=mode), signal.fftconvolve(a, b, mode=mode)
            assert ours.shape == theirs.shape, (n1, n2, mode)
            np.testing.assert_allclose(ours, theirs, rtol=1e-12, atol=1e-14 * float(np.abs(theirs).max()))


def test_a_plan_imports_neither_scipy_signal_nor_scipy_stats(tmp_path: Path) -> None:
    """dp_accounting's PLD modules import scipy.signal (for fftconvolve) and scipy.stats (for norm): ≈ 1 s of a plan.
    ``pld_module`` gives them stand-ins while they import; a whole PLD-calibrated, profile-bounded plan of the MNIST
    space in one fresh interpreter then loads neither, and prints what it printed with them."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    code = ("import sys, contextlib, io\n"
            "from dptune.cli import plan\n"
            "sys.argv = ['plan', '--space', 'search_spaces/mnist.yaml', '--n-train', '8000']\n"
            "out = io.StringIO()\n"
            "with contextlib.redirect_stdout(out):\n"
            "    try:\n        plan.main()\n    except SystemExit as e:\n        assert not e.code, e.code\n"
            "assert 'dp_accounting.pld.privacy_loss_distribution' in sys.modules\n"
            "print(sorted(m for m in ('scipy.signal', 'scipy.stats') if m in sys.modules))\n"
            "import scipy.signal, scipy.stats\n"  # the real modules, loadable afterwards
            "assert type(scipy.signal).__name__ == 'module' and hasattr(scipy.stats, 'norm')\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "[]"


def test_the_chernoff_bounds_logsumexp_is_scipys() -> None:
    """``_pldlib._logsumexp`` (all 40 orders of a self-composition's Chernoff bound in one 2-D pass) equals
    ``scipy.special.logsumexp`` order by order, on real pmfs and on edge rows (zeros, one mass): SciPy's steps with
    ``_strictmath``'s exp and log, so to 1e-13 (bytes equal with NumPy's own exp and log, before issue 58)."""
    from scipy import special

    from dptune.accounting._pldlib import _logsumexp, subsampled_gaussian_pld

    pmfs = [subsampled_gaussian_pld(standard_deviation=s, sampling_prob=q)._pmf_remove.to_dense_pmf()._probs
            for s, q in [(0.6, 0.02), (3.0, 0.25), (40.0, 0.001)]]
    pmfs += [np.array([1.0]), np.array([0.0, 0.5, 0.0, 0.5]), np.array([1e-300, 1.0, 1e-300])]
    for probs in pmfs:
        orders = np.concatenate((np.arange(-20, 0), np.arange(1, 21))) / len(probs)
        ours = _logsumexp(np.arange(len(probs))[None, :] * orders[:, None], probs)
        theirs = np.array([special.logsumexp(np.arange(len(probs)) * o, b=probs) for o in orders])
        np.testing.assert_allclose(ours, theirs, rtol=1e-13, atol=1e-14)
