"""Budget-split advice: plans fit the target when re-priced independently; tiny budgets are told no."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
from dp_accounting import dp_event as de
from dp_accounting.rdp import rdp_privacy_accountant as rdp_acc

from dptune import accounting as A
from dptune.accounting import _advice as adv
from dptune.accounting._convert import rdp_to_epsilon
from dptune.cli.plan import main
from dptune.config import load_space

SPACE = load_space("search_spaces/digits.yaml")
N = 1257


def test_fast_paths_match_the_accountant() -> None:
    sig = np.array([1.0, 3.0])
    fast = adv._sgd_curves(0.1, 50, sig)
    for row, s in zip(fast, sig):
        exact = A.rdp_of(de.SelfComposedDpEvent(de.PoissonSampledDpEvent(0.1, de.GaussianDpEvent(s)), 50))
        ints = np.round(A.ORDERS) == A.ORDERS
        assert row[ints & (A.ORDERS <= 256)] == pytest.approx(exact[ints & (A.ORDERS <= 256)], rel=1e-9)
        # the one conversion, batched, is dp_accounting's compute_epsilon
        oracle = rdp_acc.compute_epsilon(A.ORDERS, row, 1e-5)[0]
        assert rdp_to_epsilon(A.ORDERS, row[None], delta=1e-5)[0] == pytest.approx(oracle, rel=1e-12)
    for rule in A.comparison_rules(3.0):  # a batch of curves is priced as each curve alone
        batch = rule.search_rdp(fast)
        for row, out in zip(fast, batch):
            assert out == pytest.approx(rule.search_rdp(row), rel=1e-12)


@pytest.fixture(scope="module")
def advice4() -> A.Advice:
    return A.advise(SPACE, N, target_epsilon=4.0)


def test_best_plan_fits_target(advice4: A.Advice) -> None:
    best = advice4.best
    assert best is not None and best.total_epsilon <= 4.0
    space = dataclasses.replace(SPACE, tune_fraction=best.tune_fraction,
                                fixed=SPACE.fixed.replace(score_noise=best.score_noise))
    search = A.plan_search(space, N, best.stopping, sigma_low=best.search_sigma, compare=False).search_event
    final = A.trial_event(noise_multiplier=best.final_sigma, sampling_rate=best.final_batch_size / N,
                          steps=best.final_steps, score_noise=None)
    total = A.epsilon([search, final], SPACE.privacy.delta)
    assert total <= 4.0 * 1.01  # independent re-pricing (dp_accounting leaves); the fast path is an upper bound
    assert A.epsilon([search], SPACE.privacy.delta) <= best.search_share * 4.0 * 1.01
    assert advice4.baseline_sigma is not None and advice4.candidates == tuple(
        sorted(advice4.candidates, key=lambda c: (-c.proxy, c.total_epsilon)))
    assert {c.stopping.name for c in advice4.candidates} <= {n for n, r in A.STOPPING_RULES.items() if r.random_stopping}


def test_tiny_budget_cannot_pay() -> None:
    a = A.advise(SPACE, N, target_epsilon=0.3)
    assert not a.can_pay and "cannot pay" in a.verdict
    assert any("public validation" in s for s in a.suggestions)


def test_cli_advice_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--space", "search_spaces/digits.yaml", "--target-epsilon", "2", "--tune-fraction", "0.5",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tune_fraction"] == 0.5 and "advice" in out and out["advice"]["candidates"]
    assert out["noise_multiplier_floor"] is not None and math.isfinite(out["search_epsilon"])


@pytest.mark.parametrize("args, flag", [
    (["--tune-fraction", "0"], "--tune-fraction"), (["--tune-fraction", "1.5"], "--tune-fraction"),
    (["--tune-fraction", "-0.2"], "--tune-fraction"), (["--tune-fraction", "nan"], "--tune-fraction"),
    (["--tune-fraction", "0.05"], "--tune-fraction"),  # batches of 256 exceed the expected subsample
    (["--target-epsilon", "0"], "--target-epsilon"), (["--target-epsilon", "-1"], "--target-epsilon"),
])
def test_bad_inputs_exit_2(args: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--space", "search_spaces/digits.yaml", *args]) == 2
    assert flag in capsys.readouterr().err
