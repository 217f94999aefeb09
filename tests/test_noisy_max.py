"""``privacy.selection: noisy_max``: the report-noisy-max selection of the scaled searcher.

Oracles: dp_accounting's Gaussian RDP (the same curve, λ/(8β²), below the pure-DP cap 1/β), the exact Rényi
divergence of the exponential mechanism on neighbouring count vectors (computed here from its definition),
and the exponential mechanism's own distribution, against which dptune's Gumbel-max selection is measured."""

from __future__ import annotations

import dataclasses
import itertools
import math
from pathlib import Path

import numpy as np
import pytest
from dp_accounting import dp_event as de
from dp_accounting.rdp import RdpAccountant

from dptune import accounting as A
from dptune.config import ConfigError, load_space
from dptune.release import release_document, released_params, select, select_noisy_max
from dptune.trials import TrialRow

ROOT = Path(__file__).resolve().parent.parent
DIGITS_SCALED = ROOT / "search_spaces" / "digits_scaled.yaml"
MNIST_SCALED = ROOT / "search_spaces" / "mnist_scaled.yaml"


def _gaussian_rdp(sigma: float) -> np.ndarray:
    acc = RdpAccountant(orders=[float(o) for o in A.ORDERS])
    acc.compose(de.GaussianDpEvent(sigma))
    return np.array(acc._rdp)  # noqa: SLF001 - dp_accounting's curve at these orders


@pytest.mark.parametrize("beta", [0.5, 2.6, 9.0, 40.0])
def test_noisy_max_rdp_is_the_capped_gaussian_curve(beta: float) -> None:
    """1/(8β²)-zCDP is the RDP of a Gaussian of noise multiplier 2β; (1/β)-DP caps it at every order."""
    got = A.rdp_of(A.NoisyMaxDpEvent(beta))
    assert got == pytest.approx(np.minimum(_gaussian_rdp(2 * beta), 1 / beta), rel=1e-12)
    below = np.asarray(A.ORDERS) <= 8 * beta
    assert got[below] == pytest.approx(_gaussian_rdp(2 * beta)[below], rel=1e-12)
    # ε at δ: never more than the zCDP bound ρ + 2√(ρ log 1/δ) (Bun & Steinke 2016), nor than the pure 1/β
    # plus the conversion's log(1/δ)/(λ − 1) at the largest order
    rho = 1 / (8 * beta**2)
    eps = A.epsilon([A.NoisyMaxDpEvent(beta)], 1e-5)
    assert eps <= rho + 2 * math.sqrt(rho * math.log(1e5)) + 1e-12
    assert eps <= 1 / beta + math.log(1e5) / (A.ORDERS.max() - 1) + 1e-12
    # the event survives the certificate's JSON round trip
    assert A.event_from_json(A.event_to_json(A.NoisyMaxDpEvent(beta))) == A.NoisyMaxDpEvent(beta)


def _renyi(p: np.ndarray, q: np.ndarray, order: float) -> float:
    return float(np.log(np.sum(p**order * q ** (1 - order))) / (order - 1))


@pytest.mark.parametrize("k", [2, 3, 5])
def test_exponential_mechanism_stays_within_the_charged_curve(k: int) -> None:
    """Exact Rényi divergences of P ∝ exp(u/β) between count vectors u and u + d, d ∈ {0, 1}^k (one example
    added to the validation split: every count grows by 0 or 1), both directions, over random and
    adversarial u: never above the charged curve, and within a factor 2 of it somewhere (it is not vacuous)."""
    rng = np.random.default_rng(7)
    orders = [1.5, 2.0, 4.0, 8.0, 32.0]
    for beta in (0.3, 1.0, 4.0):
        bound = {a: min(a / (8 * beta**2), 1 / beta) for a in orders}
        worst = dict.fromkeys(orders, 0.0)
        utilities = [rng.normal(0, 3 * beta, size=k) for _ in range(150)]
        utilities += [np.array([0.0] + [c * beta] * (k - 1)) for c in np.linspace(-6, 6, 25)]
        for u in utilities:
            for d in itertools.product((0.0, 1.0), repeat=k):
                p, q = np.exp((u - u.max()) / beta), np.exp((u + np.array(d) - u.max()) / beta)
                p, q = p / p.sum(), q / q.sum()
                for a in orders:
                    div = max(_renyi(p, q, a), _renyi(q, p, a))
                    assert div <= bound[a] * (1 + 1e-9) + 1e-12, (beta, u, d, a, div, bound[a])
                    worst[a] = max(worst[a], div)
        assert max(worst[a] / bound[a] for a in orders) > 0.5


def _rows(accuracies: list[float | None], crashed: tuple[int, ...] = ()) -> list[TrialRow]:
    return [TrialRow(index=i, params={}, seed="0", score=(a if a is not None else -math.inf), val_accuracy_raw=a,
                     crashed=i in crashed, diverged=a is None and i not in crashed)
            for i, a in enumerate(accuracies)]


def test_gumbel_max_selection_is_the_exponential_mechanism() -> None:
    """dptune's selection, run over 6,000 seeds, picks candidate i with frequency exp(c_i/β)/Σ exp(c_j/β)."""
    n_val, beta = 180, 2.6
    acc = [0.70, 0.72, 0.73, 0.65]
    counts = np.array([round(a * n_val) for a in acc], dtype=float)
    expected = np.exp((counts - counts.max()) / beta)
    expected /= expected.sum()
    rows = _rows(list(acc))
    picks = np.zeros(len(acc))
    n = 6000
    for seed in range(n):
        best, noised = select_noisy_max(rows, gumbel_scale=beta, n_val=n_val, seed=seed)
        assert best is not None and best.index == int(np.argmax(noised))
        picks[best.index] += 1
    freq = picks / n
    se = np.sqrt(expected * (1 - expected) / n)
    assert np.all(np.abs(freq - expected) <= 4 * se + 1e-3), (freq, expected)
    # the noise is Gumbel(0, β): mean γβ and std πβ/√6 (Euler–Mascheroni γ), measured from the draws
    draws = np.array([select_noisy_max(rows, gumbel_scale=beta, n_val=n_val, seed=s)[1][0] - counts[0]
                      for s in range(4000)])
    assert draws.mean() == pytest.approx(0.5772 * beta, abs=4 * math.pi * beta / math.sqrt(6) / math.sqrt(4000))
    assert draws.std() == pytest.approx(math.pi * beta / math.sqrt(6), rel=0.05)


def test_noisy_max_is_fixed_by_its_seed_and_never_picks_a_failed_trial() -> None:
    rows = _rows([0.9, None, 0.2, 0.95], crashed=(3,))  # trial 1 diverged, trial 3 crashed
    picks = {select_noisy_max(rows, gumbel_scale=50.0, n_val=100, seed=s)[0].index for s in range(300)}  # type: ignore[union-attr]
    assert picks == {0, 2}  # huge noise: any finite trial can win, a failed one never
    # a resumed search (rows in another order, same sealed seed) selects the same trial
    for s in range(50):
        a = select_noisy_max(rows, gumbel_scale=1.0, n_val=100, seed=s)[0]
        b = select_noisy_max(rows[::-1], gumbel_scale=1.0, n_val=100, seed=s)[0]
        assert a is not None and b is not None and a.index == b.index
    only_failed = _rows([None, None], crashed=(1,))
    assert select_noisy_max(only_failed, gumbel_scale=1.0, n_val=100, seed=1)[0].index == 0  # type: ignore[union-attr]
    assert select_noisy_max([], gumbel_scale=1.0, n_val=100, seed=1) == (None, [])


def test_noisy_max_releases_the_candidate_and_no_score() -> None:
    """The sealed trial scores are raw accuracies under the noisy max: none may reach the release."""
    space = load_space(DIGITS_SCALED)
    assert space.privacy.selection == "noisy_max" and space.fixed.score_noise is None
    rows = _rows([0.91, 0.97, 0.88])
    best = select(space, rows, n_val=180, seed=3)
    assert best is not None
    plan = A.plan_search(space, 1257)
    scaled = A.plan_transfer(space, plan, final_n=1437)
    best = dataclasses.replace(best, params=dict(scaled.candidates[best.index]))  # sealed: the final run's params
    params, score = released_params(space, best, 1257, transfer=scaled)
    assert score is None and params["learning_rate"] == scaled.candidates[best.index]["learning_rate"]
    assert params["noise_multiplier"] == scaled.final_sigma(256, 15)
    doc = release_document(space, params, score, transfer=scaled)
    assert doc["score"] is None and "report-noisy-max" in doc["score_kind"]
    assert not any(str(r.val_accuracy_raw) in str(doc) for r in rows)
    # the same rows under a per-trial Gaussian score release the winning (noised) score itself
    scores = space.with_privacy(selection="best_score", score_noise=9.0)
    assert scores.fixed.score_noise == 9.0
    assert released_params(scores, select(scores, rows, n_val=180, seed=3), 1257, transfer=scaled)[1] == 0.97


def test_shipped_spaces_pay_what_the_gaussian_scores_they_replace_paid() -> None:
    """Each shipped scaled space's Gumbel scale β = σ_s/(2√K) (rounded) of the K Gaussian score releases of
    std σ_s it replaced: the same zCDP, so the same search RDP at any σ to within the rounding. Charged at the
    smaller of RDP and PLD, the Gaussian scores gain more (their PLD is exact, the noisy max's only its pure-DP
    pair): the cheap-trial σ under the noisy max is at most 10 % above theirs (7 % on digits, 9 % on MNIST)."""
    for path, old_noise, n_train in ((DIGITS_SCALED, 9.0, 1257), (MNIST_SCALED, 44.1, 8000)):
        space = load_space(path)
        k = int(space.privacy.mean)
        beta = space.privacy.score_noise
        assert beta is not None and beta == pytest.approx(old_noise / (2 * math.sqrt(k)), rel=0.02)
        noisy_plan = A.plan_search(space, n_train)
        scores_plan = A.plan_search(space.with_privacy(selection="best_score", score_noise=old_noise), n_train)
        # the costliest point's σ (each (B, E) runs at its share of it: _planner.transfer_weights)
        noisy = max(pt.noise_multiplier for pt in noisy_plan.points)
        scores = max(pt.noise_multiplier for pt in scores_plan.points)
        assert scores <= noisy <= 1.1 * scores
        # at one σ, the two searches' RDP agree (the same zCDP)
        at_noisy = space.with_privacy(selection="best_score", score_noise=old_noise)
        same_sigma = A.plan_search(at_noisy, n_train, sigma_low=noisy).search_event
        assert A.rdp_epsilon([same_sigma], 1e-5) == pytest.approx(A.rdp_epsilon([noisy_plan.search_event], 1e-5),
                                                                  rel=0.01)


def test_a_space_whose_trials_disagree_with_its_privacy_is_refused() -> None:
    """Replacing privacy without the trials' score noise would run (and release) raw scores: refused."""
    import dataclasses

    space = load_space(MNIST_SCALED)
    stale = dataclasses.replace(space, privacy=dataclasses.replace(space.privacy, selection="best_score",
                                                                    score_noise=40.0))
    with pytest.raises(ConfigError) as e:
        A.plan_search(stale, 8000)
    assert e.value.field == "privacy.score_noise"


def test_curator_report_reads_a_noisy_max_charge() -> None:
    """``search_parts`` (the curator report's plots) sets the selection aside and returns the trials' part."""
    space = load_space(DIGITS_SCALED)
    plan = A.plan_search(space, 1257)
    trial, rule, fraction = A.search_parts(plan.search_event)
    assert (trial, rule.label(), fraction) == (plan.trial_event, "composed(3 trials)", 1.0)
    assert A.split_selection(plan.search_event)[1] == A.NoisyMaxDpEvent(2.6)
    assert A.epsilon([rule.search_event(trial), A.NoisyMaxDpEvent(2.6)], 1e-5) == pytest.approx(plan.search_epsilon)
