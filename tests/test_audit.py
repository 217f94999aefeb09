"""The one-run privacy audit (dptune.audit): the paper's own numbers for the guesses → ε conversion."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dptune.audit import audit_epsilon, epsilon_lower_bound, guess_grid, guesses, p_value

DELTA = 1e-5


# --- guesses -> ε lower bound: Steinke, Nasr & Jagielski (NeurIPS 2023) -------------------------------------

@pytest.mark.parametrize("m, r, v, delta, published", [
    (100, 100, 75, 0.0, 0.702),  # §5 example: 75 of 100 guesses correct, no abstention, δ = 0
    (100, 100, 75, 1e-4, 0.699),  # the same with δ = 1e-4
    (1000, 100, 75, 1e-4, 0.673),  # 900 abstentions (m = 1000): App. D's example
    (100_000, 1510, 1439, 1e-5, 2.675),  # §7 (their Fig. 11 point)
])
def test_lower_bound_reproduces_the_papers_examples(m: int, r: int, v: int, delta: float, published: float) -> None:
    eps = epsilon_lower_bound(canaries=m, guesses=r, correct=v, delta=delta, confidence=0.95)
    assert abs(eps - published) < 1e-3  # one unit of the last printed digit (rounded or truncated)


def test_p_value_reproduces_the_papers_example() -> None:
    # 75 of 100 correct is unsurprising for ε = log 3 (randomized response is right 3/4 of the time)
    assert p_value(canaries=100, guesses=100, correct=75, epsilon=math.log(3), delta=0) == pytest.approx(0.553, abs=5e-4)


@pytest.mark.parametrize("r", [1, 16, 100, 1000])
def test_all_correct_closed_form(r: int) -> None:
    """δ = 0, every guess correct: P[Binomial(r, p) = r] = p^r = β  ⇔  ε = −log(β^(−1/r) − 1) (one correct
    guess proves nothing: 0)."""
    expected = max(0.0, -math.log(0.05 ** (-1 / r) - 1))
    eps = epsilon_lower_bound(canaries=r, guesses=r, correct=r, delta=0.0)
    assert expected - 1e-6 <= eps <= expected


def test_lower_bound_shape_and_bad_inputs() -> None:
    bound = [epsilon_lower_bound(canaries=1000, guesses=100, correct=v, delta=DELTA) for v in (50, 60, 75, 90, 100)]
    assert bound[0] == 0.0 and all(a < b for a, b in zip(bound, bound[1:]))  # chance level proves nothing
    # abstentions are not free when δ > 0 (the 2mδ term), and δ itself weakens the bound
    assert epsilon_lower_bound(canaries=10**5, guesses=100, correct=90, delta=DELTA) < bound[3]
    assert epsilon_lower_bound(canaries=1000, guesses=100, correct=90, delta=0.0) > bound[3]
    for kw in (dict(canaries=10, guesses=11, correct=5), dict(canaries=10, guesses=5, correct=6),
               dict(canaries=10, guesses=5, correct=True)):
        with pytest.raises((ValueError, TypeError)):
            epsilon_lower_bound(delta=DELTA, **kw)  # type: ignore[arg-type]


def test_guesses_and_bonferroni() -> None:
    scores = np.array([5.0, 4.0, 3.0, 2.0, 1.0, 0.0])
    included = np.array([True, True, False, True, False, False])
    g = guesses(scores, included, k_plus=2, k_minus=2)
    assert (g.guesses, g.correct) == (4, 4)
    assert guesses(scores, included, k_plus=3, k_minus=0).correct == 2
    rng = np.random.default_rng(0)
    inc = rng.random(2000) < 0.5
    s = inc + rng.normal(0, 1, 2000)
    grid = guess_grid(2000)
    a = audit_epsilon(s, inc, ks=grid, delta=DELTA)
    per_k = [epsilon_lower_bound(canaries=2000, guesses=kp + km, correct=guesses(s, inc, k_plus=kp, k_minus=km).correct,
                                 delta=DELTA, confidence=1 - 0.05 / len(grid)) for kp, km in grid]
    assert a.epsilon == max(per_k) and a.tried == len(grid)
