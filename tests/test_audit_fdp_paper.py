"""The f-DP one-run audit against the numbers of its own paper: Mahloujifar, Melis & Chaudhuri, "Auditing
f-Differential Privacy in One Run" (ICML 2025, PMLR 267; arXiv 2410.22235). Section, table and algorithm
numbers are the ICML version's.

What the paper prints that can be recomputed without training, and what becomes of it here:
- Table 1, "Theoretical": ε at δ = 1e-5 of the audited Gaussian mechanisms (σ = 0.5, 1, 2, 4): reproduced
  by ``gdp_epsilon`` (the paper truncates to two decimals).
- Appendix B, "Varying δ and confidence levels": its idealized setting (Algorithm 4) with m = 10^5
  canaries, c' = 1,500 guesses and σ = 1 gives c = 1,429 correct guesses: reproduced by this file's model
  of Algorithm 4, which the Table 1 checks then use.
- Algorithm 3 as its appendix code runs it (``audit_rh_with_cap``): dptune's ``rejects`` decides as a
  transcription of it on every observation tried, and ``gdp_mu_lower_bound`` agrees with the paper's own
  search for the reported claim (a grid of noise levels) to one grid step.
- Table 1, "Steinke et al." and "Ours": NOT reproduced to their printed precision. Recomputed in the
  reconstructed idealized setting (expected correct guesses, best c' over a 160-point grid), dptune gives

      σ, m         Steinke et al.: paper / dptune     Ours (f-DP, GDP claims): paper / dptune
      0.5, 10^5    4.99 / 4.91                        8.16 / 7.58
      1,   10^5    2.61 / 2.68                        3.61 / 3.37
      2,   10^5    1.33 / 1.30                        1.59 / 1.51
      4,   10^6    0.61 / 0.61                        0.82 / 0.73

  The Steinke et al. column comes back to within 0.09, the f-DP column 0.08 to 0.59 lower. The recursion is
  the paper's (the transcription test), so the gap lies in the observations behind "Ours", which the paper
  does not print: c is simulated (Algorithm 4), and the grid of c' and the way the best one is picked are
  not given. One simulated run per c' instead of the expectation, with the best c' picked on it, gave 4.0 to
  4.9 for σ = 1 in four tries (selection on noise), so the printed values are within what such a procedure
  produces; no single convention tried (m/2 canaries in the test, τ = 0.1, the guessed canaries alone as m)
  gives all four rows. What the paper reads from the table is reproduced: on the same observations the f-DP
  bound lies above Steinke et al.'s and below the theoretical ε on every row, and it keeps improving with m
  while Steinke et al.'s does not (Section 4.1, Figure 1).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import numpy as np
import pytest
from scipy import optimize, special

from dptune.audit import epsilon_lower_bound, fdp_epsilon_lower_bound, gdp_epsilon, gdp_mu_lower_bound
from dptune.audit._fdp import _inverse_blow_up_gaussian, _largest_rejected, rejects

DELTA = 1e-5  # every empirical ε of the paper is "at δ = 10^-5"
TAU = 0.05  # the paper's probability threshold τ (95 % confidence), its default in Algorithm 3


def idealized_correct(*, canaries: int, guesses: int, sigma: float) -> int:
    """Expected correct guesses of the paper's idealized setting (Appendix D, Algorithm 4, k = 2): each
    canary is s = ±1 with probability 1/2, observed as s + N(0, (2σ)²) (a 1/σ-GDP mechanism); the auditor
    takes the ``guesses``/2 highest scores, and c = ⌈c' × (share of s = +1 among them)⌉. Algorithm 4 averages
    100 simulated runs; here the share is its expectation at the threshold t where m · P(score > t) = c'/2."""

    def above(t: float, s: int) -> float:
        return float(special.ndtr((s - t) / (2 * sigma)))

    t = optimize.brentq(lambda x: canaries * (above(x, 1) + above(x, -1)) / 2 - guesses // 2, -99.0, 99.0)
    return math.ceil(guesses * above(t, 1) / (above(t, 1) + above(t, -1)))


def gaussian_inverse_blow_up(mu: float) -> Callable[[float], float]:
    # the appendix code's gaussianDP_blow_up_inverse(noise = 1/μ): x ↦ Φ(Φ⁻¹(x) − μ)
    return lambda x: float(special.ndtr(special.ndtri(min(x, 1.0)) - mu))


def paper_algorithm_3(inverse_blow_up: Callable[[float], float], *, m: int, c: int, c_prime: int,
                      k: int = 2, tau: float = TAU) -> bool:
    """Algorithm 3 as the paper's appendix code runs it (``audit_rh_with_cap``): h and r over i = c … 0,
    with the code's max (the printed algorithm omits it) and strict comparison; True = the claim is
    rejected."""
    h, r = [0.0] * (c + 1), [0.0] * (c + 1)
    r[c], h[c] = tau * c / m, tau * (c_prime - c) / m
    for i in range(c - 1, -1, -1):
        h[i] = max(h[i + 1], (k - 1) * inverse_blow_up(r[i + 1]))
        r[i] = r[i + 1] + i / (c_prime - i) * (h[i] - h[i + 1])
    return r[0] + h[0] > c_prime / m


@pytest.mark.parametrize(("sigma", "printed"), [(0.5, 9.99), (1.0, 4.37), (2.0, 1.99), (4.0, 0.92)])
def test_table_1_theoretical_epsilon(sigma: float, printed: float) -> None:
    # Table 1, "Theoretical": the Gaussian mechanism with noise σ (μ = 1/σ) at δ = 1e-5. dptune: 9.9973,
    # 4.3772, 1.9931, 0.9263; the paper truncates (rounding would print 10.00, 4.38, 0.93)
    assert printed <= gdp_epsilon(1 / sigma, DELTA) < printed + 0.01


def test_appendix_b_idealized_correct_guesses() -> None:
    # Appendix B: "number of canaries 10^5, number of guesses 1,500, number of correct guesses 1,429,
    # suggested by the idealized setting", Gaussian mechanism with standard deviation 1.0
    assert idealized_correct(canaries=10**5, guesses=1500, sigma=1.0) == 1429
    # and the expectation is what Algorithm 4's simulation averages to (20 runs here, 100 in the paper)
    rng = np.random.default_rng(0)
    runs = []
    for _ in range(20):
        s = rng.integers(0, 2, 10**5) * 2 - 1
        score = s + rng.normal(0.0, 2.0, 10**5)
        top = np.argsort(score)[-750:]
        runs.append(math.ceil(1500 * float(np.mean(s[top] == 1))))
    assert abs(np.mean(runs) - 1429) <= 3


def _rejects_gdp(mu: float, *, m: int, c_prime: int, c: int, k: int) -> bool:
    return rejects(gaussian_inverse_blow_up(mu), canaries=m, guesses=c_prime, correct=c, level=TAU,
                   alphabet=k)


@pytest.mark.parametrize("k", [2, 5])
def test_rejects_is_the_papers_algorithm_3(k: int) -> None:
    """dptune's recursion decides as the paper's on the paper's example observation and others (all guesses;
    few guesses of many canaries; all correct), for membership (k = 2) and a reconstruction game (k = 5, the
    paper's Algorithm 2), at μ-GDP claims far from and just either side of the boundary."""
    observations = [(100, 100, 70), (1000, 200, 170), (1000, 40, 40), (10**5, 1500, 1429),
                    (10**5, 656, 633)]
    for m, c_prime, c in observations:
        boundary = _largest_rejected(partial(_rejects_gdp, m=m, c_prime=c_prime, c=c, k=k), 1e-6)
        for mu in (0.25, 0.5, 1.0, 2.0, 4.0, boundary * 0.999, boundary * 1.001):
            ours = _rejects_gdp(mu, m=m, c_prime=c_prime, c=c, k=k)
            theirs = paper_algorithm_3(gaussian_inverse_blow_up(mu), m=m, c=c, c_prime=c_prime, k=k)
            assert ours == theirs, (m, c_prime, c, mu)
    # dptune's own Gaussian blow-up is the appendix code's
    for mu in (0.3, 1.0, 2.5):
        for x in (1e-9, 1e-4, 0.01, 0.3, 0.9):
            assert _inverse_blow_up_gaussian(mu)(x) == pytest.approx(gaussian_inverse_blow_up(mu)(x),
                                                                     rel=1e-12)


def test_mu_search_agrees_with_the_papers_noise_grid() -> None:
    """The appendix code reports empirical privacy by walking the claims σ = σ_0, σ_0 + 0.01, … (μ = 1/σ)
    from the true σ_0 and taking the first one rejected; ``gdp_mu_lower_bound`` bisects on μ instead. On the
    paper's own observation (Appendix B) they agree to that grid step."""
    m, c_prime, c = 10**5, 1500, 1429
    sigma = 1.0
    while not paper_algorithm_3(gaussian_inverse_blow_up(1 / sigma), m=m, c=c, c_prime=c_prime):
        sigma = round(sigma + 0.01, 2)
    assert sigma == 1.28
    mu = gdp_mu_lower_bound(canaries=m, guesses=c_prime, correct=c, level=TAU)  # 0.78180
    assert 1 / sigma <= mu < 1 / (sigma - 0.01)
    # what either reports for this observation: ε 3.29 (grid) and 3.30 (dptune) at δ = 1e-5, of a true 4.38
    assert gdp_epsilon(1 / sigma, DELTA) <= gdp_epsilon(mu, DELTA) < gdp_epsilon(1 / (sigma - 0.01),
                                                                                   DELTA)
    assert 3.29 < gdp_epsilon(mu, DELTA) < 3.31


def test_epsilon_delta_claims_match_the_papers_proposition_2_3() -> None:
    """The paper writes (ε, δ)-DP as f̄(x) = e^ε x + δ (Proposition 2.3); dptune's claim is the exact tradeoff
    curve of (ε, δ)-DP, which has the second piece 1 − e^{−ε}(1 − δ − x) too. That piece only matters for
    events of probability near 1, so dptune's bound is never below the paper's; here they coincide."""
    for m, c_prime, c in [(10**5, 1500, 1429), (1000, 1000, 950), (1000, 1000, 700), (100, 100, 90)]:

        def paper_rejects(eps: float, m: int = m, c_prime: int = c_prime, c: int = c) -> bool:
            return paper_algorithm_3(lambda y: max(0.0, (y - DELTA) * math.exp(-eps)), m=m, c=c,
                                     c_prime=c_prime)

        lo, hi = 0.0, 20.0
        while hi - lo > 1e-5:
            lo, hi = ((lo + hi) / 2, hi) if paper_rejects((lo + hi) / 2) else (lo, (lo + hi) / 2)
        ours = fdp_epsilon_lower_bound(canaries=m, guesses=c_prime, correct=c, delta=DELTA, level=TAU)
        assert ours == pytest.approx(lo, abs=1e-3)  # the paper's observation: 2.787 (Steinke et al.: 2.669)


# Table 1 rows: σ, m, the paper's "Steinke et al." and "Ours", and the best c' for Steinke et al.'s bound and
# for the f-DP bound over a 160-point geometric grid of c' in [20, min(m, 40000)], each with its expected c
# (found offline)
TABLE_1 = [
    (0.5, 10**5, 4.99, 8.16, 7506, 2166),
    (1.0, 10**5, 2.61, 3.61, 1478, 656),
    (2.0, 10**5, 1.33, 1.59, 756, 756),
    (4.0, 10**6, 0.61, 0.82, 16918, 2272),
]


@pytest.mark.parametrize(("sigma", "m", "paper_steinke", "paper_ours", "steinke_guesses", "fdp_guesses"),
                         TABLE_1)
def test_table_1_steinke_below_f_dp_below_theory(sigma: float, m: int, paper_steinke: float,
                                                 paper_ours: float, steinke_guesses: int,
                                                 fdp_guesses: int) -> None:
    """Table 1 in the reconstructed idealized setting: the ordering the paper reads from it holds, and the
    values stand where the module docstring says (Steinke et al. within 0.09, f-DP below the paper's)."""
    c = idealized_correct(canaries=m, guesses=steinke_guesses, sigma=sigma)
    steinke = epsilon_lower_bound(canaries=m, guesses=steinke_guesses, correct=c, delta=DELTA,
                                  confidence=1 - TAU)
    c = idealized_correct(canaries=m, guesses=fdp_guesses, sigma=sigma)
    fdp = gdp_epsilon(gdp_mu_lower_bound(canaries=m, guesses=fdp_guesses, correct=c, level=TAU), DELTA)
    assert steinke < fdp < gdp_epsilon(1 / sigma, DELTA)
    assert paper_steinke < fdp  # above even the paper's Steinke et al. column
    assert abs(steinke - paper_steinke) < 0.09
    assert paper_ours - 0.6 < fdp < paper_ours  # not reproduced: 0.08 to 0.59 below the printed value


def test_figure_1_f_dp_keeps_improving_with_more_canaries() -> None:
    """Section 4.1 on Figure 1: "while the bound in Steinke et al. (2023) degrades as the number of canaries
    increases, our bounds continue to improve". σ = 1, the best c' per m over the same grid (found offline):
    f-DP 3.10, 3.37, 3.56, 3.69 for m = 10^4 … 10^7; Steinke et al. 2.68 at 10^5, 2.61 at 10^6."""
    best_fdp_guesses = {10**4: 234, 10**5: 656, 10**6: 1110, 10**7: 2622}
    fdp = []
    for m, guesses in best_fdp_guesses.items():
        c = idealized_correct(canaries=m, guesses=guesses, sigma=1.0)
        fdp.append(gdp_epsilon(gdp_mu_lower_bound(canaries=m, guesses=guesses, correct=c, level=TAU), DELTA))
    assert fdp == sorted(fdp) and fdp[-1] - fdp[0] > 0.5
    steinke = [epsilon_lower_bound(canaries=m, guesses=g, delta=DELTA, confidence=1 - TAU,
                                   correct=idealized_correct(canaries=m, guesses=g, sigma=1.0))
               for m, g in ((10**5, 1478), (10**6, 18616))]
    assert steinke[1] < steinke[0]
