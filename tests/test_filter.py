"""ASHA's accounting (issue 60): the RDP filter (Feldman & Zrnic 2021) that admits rung segments, its bound, its
charge (RDP only), and the spaces that may use it. Known answers from the accountant's own interpreters."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import yaml
from dp_accounting import dp_event as de

from dptune.accounting import (
    FILTER_SLACK,
    ORDERS,
    RdpFilter,
    RdpFilterDpEvent,
    certify,
    event_from_json,
    event_to_json,
    plan_search,
    rdp_of,
    rdp_to_epsilon,
    segment_costs,
    trial_event,
)
from dptune.config import ConfigError, load_space
from dptune.config.params import asha_rungs, rung_steps
from dptune.ledger._event_rules import event_problem
from tests.conftest import ROOT

SPACE = ROOT / "search_spaces" / "digits_asha.yaml"
N_TRAIN = 1797 - 180 - 360


def _trial(sigma: float = 5.0, q: float = 256 / N_TRAIN, epochs: int = 15) -> tuple[list[np.ndarray], np.ndarray]:
    rungs = asha_rungs(epochs=epochs, grace_period=1, reduction_factor=3)
    at = rung_steps(epochs=epochs, batch_size=256, basis=N_TRAIN, rungs=rungs)
    costs = segment_costs(noise_multiplier=sigma, sampling_rate=q, rung_steps=at, score_noise=9.0)
    full = rdp_of(trial_event(noise_multiplier=sigma, sampling_rate=q, steps=at[-1], score_noise=9.0,
                              scores=len(rungs)))
    return costs, full


def test_the_rungs_and_their_steps_are_the_loops() -> None:
    assert asha_rungs(epochs=15, grace_period=1, reduction_factor=3) == (1, 3, 9, 15)
    assert asha_rungs(epochs=9, grace_period=1, reduction_factor=3) == (1, 3, 9)
    assert asha_rungs(epochs=4, grace_period=2, reduction_factor=2) == (2, 4)
    # 1257 / 256: 5 steps an epoch, T = ceil(15 * 1257 / 256) = 74: the last rung's steps are the trial's T
    assert rung_steps(epochs=15, batch_size=256, basis=N_TRAIN, rungs=(1, 3, 9, 15)) == (5, 15, 45, 74)


def test_segments_add_up_to_the_full_trial() -> None:
    costs, full = _trial()
    assert np.allclose(np.sum(costs, axis=0), full, rtol=1e-13, atol=0)


def test_the_filter_admits_exactly_what_fits_and_never_a_segment_that_crosses() -> None:
    costs, full = _trial()
    filt = RdpFilter(2 * full)
    for n in range(2):  # two full trials fit exactly
        assert all(filt.admit(f"{n}/{k}", c) for k, c in enumerate(costs))
    before = filt.spent.copy()
    assert not filt.admit("2/0", costs[0])  # the third trial's first segment would cross: refused
    assert np.array_equal(filt.spent, before) and "2/0" not in filt.admitted
    small = costs[0] * 1e-3  # a cheaper segment may still fit where the bound has room at no order
    assert filt.admit("x/0", small) is bool(np.all(before + small <= 2 * full * (1 + FILTER_SLACK)))
    # a segment admitted before (a retried trial) is admitted again at no charge, only with the same cost
    spent = filt.spent.copy()
    assert filt.admit("0/1", costs[1]) and np.array_equal(filt.spent, spent)
    with pytest.raises(ValueError, match="another cost"):
        filt.admit("0/1", costs[2])


def test_the_edge_a_segment_that_would_cross_at_one_order_only() -> None:
    budget = np.ones_like(ORDERS)
    filt = RdpFilter(budget)
    cost = np.full_like(ORDERS, 0.5)
    cost[3] = 1.0 + 1e-6  # over the bound at one order
    assert not filt.admit("a/0", cost)
    cost[3] = 1.0  # exactly at the bound everywhere it is tight
    assert filt.admit("a/0", cost)
    assert not filt.admit("b/0", np.full_like(ORDERS, 1e-9))  # nothing more fits at that order


def test_the_charge_is_the_bound_in_rdp_never_pld() -> None:
    _, full = _trial()
    trial = trial_event(noise_multiplier=5.0, sampling_rate=256 / N_TRAIN, steps=74, score_noise=9.0, scores=4)
    event = RdpFilterDpEvent(de.SelfComposedDpEvent(trial, 2))
    bound = certify([event], 1e-5)
    assert bound.accountant == "rdp"  # PLD composition assumes mechanisms fixed in advance: not the filter's
    expected = rdp_to_epsilon(ORDERS, 2 * full * (1 + FILTER_SLACK), delta=1e-5)
    assert expected <= bound.epsilon <= expected * (1 + 1e-5)  # rounded up to the grid
    assert certify([de.SelfComposedDpEvent(trial, 2)], 1e-5).epsilon <= bound.epsilon  # fixed composition: PLD too
    assert event_from_json(event_to_json(event)) == event
    assert event_problem(event_to_json(event)) is None


def test_the_asha_space_plans_a_filter_of_full_trials() -> None:
    space = load_space(SPACE)
    plan = plan_search(space, N_TRAIN)
    assert space.rungs == (1, 3, 9, 15) and space.accounting == "filter"
    assert isinstance(plan.search_event, RdpFilterDpEvent)
    (t,) = {p.scores for p in plan.points}
    assert t == 4  # a score released at each rung, every one charged
    assert math.isclose(plan.stopping.mean, 2)


def _variant(tmp_path, **changes) -> None:  # type: ignore[no-untyped-def]
    raw = yaml.safe_load(SPACE.read_text())
    for path, value in changes.items():
        section, key = path.split("__")
        if value is None:
            raw[section].pop(key)
        else:
            raw.setdefault(section, {})[key] = value
    p = tmp_path / "v.yaml"
    p.write_text(yaml.safe_dump(copy.deepcopy(raw)))
    load_space(p)


@pytest.mark.parametrize(("changes", "field"), [
    ({"privacy__stopping": "poisson"}, "search.scheduler"),  # ASHA under random stopping: refused, names filter
    ({"privacy__stopping": "tnb"}, "search.scheduler"),
    ({"search__scheduler": "fifo", "search__grace_period": None, "search__reduction_factor": None},
     "privacy.stopping"),  # a filter without ASHA
    ({"space__epochs": {"type": "categorical", "choices": [5, 15]}, "fixed__epochs": None, "default__epochs": 15},
     "space.epochs"),
    ({"search__grace_period": 0}, "search.grace_period"),
    ({"search__reduction_factor": 1}, "search.reduction_factor"),
])
def test_asha_runs_only_under_the_filter_and_its_own_settings(tmp_path, changes, field) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError) as e:
        _variant(tmp_path, **changes)
    assert e.value.field == field, e.value
    if field == "search.scheduler":
        assert "privacy.stopping: filter" in e.value.fix


def test_a_resumed_search_continues_the_same_sealed_filter(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """What the filter actor keeps (dptune/tuning/asha.py): every admission on disk before the trial hears yes; a
    resumed search reads it back (no segment charged twice, the spent sum kept), and refuses another bound."""
    from dptune.tuning.asha import SealedFilter

    costs, full = _trial()
    path = tmp_path / "filter.json"
    first = SealedFilter(path, [float(b) for b in 2 * full])
    assert first.admit("0/0", [float(c) for c in costs[0]]) and first.admit("0/1", [float(c) for c in costs[1]])
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    resumed = SealedFilter(path, [float(b) for b in 2 * full])  # the crash: a fresh actor, the same file
    assert sorted(resumed.filter.admitted) == ["0/0", "0/1"]
    assert np.array_equal(resumed.filter.spent, first.filter.spent)
    assert resumed.admit("0/1", [float(c) for c in costs[1]])  # the retried segment: admitted, not charged again
    assert np.array_equal(resumed.filter.spent, first.filter.spent)
    for k in (2, 3):
        assert resumed.admit(f"0/{k}", [float(c) for c in costs[k]])
    assert all(resumed.admit(f"1/{k}", [float(c) for c in c_]) for k, c_ in enumerate(costs))
    assert not SealedFilter(path, [float(b) for b in 2 * full]).admit("2/0", [float(c) for c in costs[0]])
    with pytest.raises(ValueError, match="bound"):
        SealedFilter(path, [float(b) for b in 3 * full])


def test_the_planner_prints_what_the_filter_admits_before_anything_is_charged(capsys) -> None:  # type: ignore[no-untyped-def]
    from dptune.cli.plan import main

    assert main(["--space", str(SPACE)]) == 0
    out = capsys.readouterr().out
    assert "rungs at epochs 1, 3, 9, 15" in out and "2 full-length trials' worth" in out
    fits = {int(r): int(n) for n, r in __import__("re").findall(r"(\d+) stopping at epoch (\d+)", out)}
    assert fits[15] == 2 and fits[1] > fits[3] > fits[9] >= fits[15]  # early stops buy configurations
