"""Searches that plan their final run (issue 21): the transfer rule of every searcher by hand, the planner's
verdict gate before any charge, and ``--tune-anyway`` through a real Ray search."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from dptune import accounting as A
from dptune.config import ConfigError, load_space, parse_space
from dptune.config.params import sampling_rate, trial_steps
from dptune.ledger import Ledger
from tests.conftest import free_port, isolated_env_for, run_cli

ROOT = Path(__file__).resolve().parent.parent
DIGITS_SCALED = ROOT / "search_spaces" / "digits_scaled.yaml"
N_TRAIN, N_VAL = 1257, 180


def _digits_random(searcher: str = "random") -> dict[str, object]:
    """digits' random-search space planning its final run (σ set by the budget, two batch sizes)."""
    raw = yaml.safe_load((ROOT / "search_spaces" / "digits.yaml").read_text())
    raw["space"].pop("noise_multiplier")
    raw["default"].pop("noise_multiplier")
    raw["privacy"]["search_share"] = 0.3
    if searcher == "tpe":
        raw["privacy"].update(stopping="composed", mean=3)
        raw["search"].update(accounting="composed", searcher="tpe")
    return raw


@pytest.mark.parametrize("searcher", ["random", "tpe", "scaled"])
def test_each_searchers_transfer_rule_against_a_hand_computed_case(searcher: str) -> None:
    """σ_c(B, E) ∝ q·√T (the costliest point's σ fitting the search share), σ_f(B, E) from the budget, and the
    trial of final-run config (B, E, L) runs at lr = L·σ_f(B, E)/σ_c(B, E): computed here by hand."""
    space = load_space(DIGITS_SCALED) if searcher == "scaled" else parse_space(_digits_random(searcher))
    plan = A.plan_search(space, N_TRAIN, compare=False)
    tp = A.plan_transfer(space, plan, final_n=N_TRAIN + N_VAL)
    top = max(b / N_TRAIN * math.sqrt(trial_steps(epochs=e, batch_size=b, basis=N_TRAIN)) for b, e, _, _ in tp.sigmas)
    for b, e, sc, sf in tp.sigmas:
        w = b / N_TRAIN * math.sqrt(trial_steps(epochs=e, batch_size=b, basis=N_TRAIN))
        assert sc == pytest.approx(max(0.5, tp.trial_sigma * w / top), rel=1e-12)
        final = A.trial_event(noise_multiplier=sf, sampling_rate=sampling_rate(batch_size=b, basis=N_TRAIN + N_VAL),
                              steps=trial_steps(epochs=e, batch_size=b, basis=N_TRAIN + N_VAL), score_noise=None)
        assert A.epsilon([plan.search_event, final], 1e-5) <= 8 * (1 + 1e-6)
        cfg = space.fixed.replace(batch_size=b, epochs=e, learning_rate=0.9)
        t = tp.trial_config(cfg)
        assert t.noise_multiplier == sc and t.learning_rate == pytest.approx(0.9 * sf / sc, rel=1e-12)
        assert tp.lr_times_sigma(cfg) == pytest.approx(0.9 * sf, rel=1e-12)  # what the release carries
    # the search costs what the share allows, at the worst case over the trial points it runs
    assert plan.search_epsilon <= 0.3 * 8 * (1 + 1e-6)
    if searcher != "scaled":  # two batch sizes: the small one runs at less noise than the large one
        (b1, _, s1, _), (b2, _, s2, _) = sorted(tp.sigmas)
        assert b1 < b2 and s1 < s2


def test_a_space_that_plans_its_final_run_refuses_a_searched_noise_multiplier() -> None:
    raw = _digits_random()
    raw["space"]["noise_multiplier"] = {"type": "float", "low": 5.0, "high": 7.5}
    raw["default"]["noise_multiplier"] = 5.0
    with pytest.raises(ConfigError) as e:
        parse_space(raw)
    assert e.value.field == "space.noise_multiplier" and "budget" in e.value.problem


def _write(tmp_path: Path, raw: dict[str, object], name: str) -> Path:
    out = tmp_path / f"{name}.yaml"
    out.write_text(yaml.safe_dump(raw))
    return out


def _hopeless(tmp_path: Path) -> Path:
    """digits_scaled with priors under which nothing pays (a tiny spread, a steep loss per noise doubling)."""
    raw = yaml.safe_load(DIGITS_SCALED.read_text())
    raw["planner"] = {"proxy": "test priors", "accuracy_spread": 0.0005, "loss_per_noise_doubling": 0.5}
    return _write(tmp_path, raw, "hopeless")


def test_the_verdict_gate_exits_2_before_anything_is_charged(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    from dptune.cli.search import main as search_main

    ledger = tmp_path / "ledger.sqlite"
    rc = search_main(["--space", str(_hopeless(tmp_path)), "--ledger", str(ledger), "--budget-epsilon", "30",
                      "--runs-dir", str(tmp_path / "runs")])
    captured = capsys.readouterr()
    assert rc == 2, captured.err
    assert "error: --tune-anyway:" in captured.err and "not expected to pay" in captured.out
    assert "priors from test priors" in captured.out
    assert not ledger.exists() or Ledger(ledger).charges() == []
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


@pytest.mark.integration  # a whole search end to end (make test-slow; CI runs it)
def test_tune_anyway_runs_the_search_and_says_so(tmp_path: Path) -> None:
    """A real Ray search (3 trials, 1 epoch) of a space the planner does not expect to pay, with --tune-anyway:
    it runs, says so, charges the plan, and each trial measured the noise of its planned σ_c."""
    env = {**isolated_env_for(tmp_path), "RAY_ADDRESS": "local"}
    ledger = tmp_path / "ledger.sqlite"
    r = run_cli(["-m", "dptune.search", "--space", str(_hopeless(tmp_path)), "--name", "anyway", "--runs-dir",
                 str(tmp_path / "runs"), "--ledger", str(ledger), "--budget-epsilon", "30", "--num-cpus", "2",
                 "--epochs", "1", "--dashboard-port", str(free_port()), "--tune-anyway"], env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "not expected to pay" in r.stdout and "--tune-anyway: searching although" in r.stdout
    space = load_space(_hopeless(tmp_path))
    space = space.__class__(**{**space.__dict__, "fixed": space.fixed.replace(epochs=1.0),
                               "default": space.default.replace(epochs=1.0)})
    plan = A.plan_search(space, N_TRAIN)
    (charge,) = Ledger(ledger).charges()
    assert charge.epsilon == pytest.approx(plan.search_epsilon, rel=1e-9)
    rows = pq.read_table(tmp_path / "runs" / "anyway" / "sealed" / "trials.parquet").to_pylist()
    assert len(rows) == 3
    for row in rows:
        m = json.loads(row["measured"])
        assert m["noise_std"] == pytest.approx(plan.points[0].noise_multiplier, rel=0.05)  # clip C = 1


def test_the_verdict_prices_against_the_planner_baseline() -> None:
    """mnist.yaml names the literature default (Opacus' MNIST example) as the config its search must beat: the
    verdict's baseline is that config trained once with the whole budget, not the space's own default."""
    space = load_space(ROOT / "search_spaces" / "mnist.yaml")
    assert (space.baseline.batch_size, space.baseline.learning_rate, space.baseline.epochs) == (64, 0.1, 10.0)
    assert space.default.batch_size == 256  # released when K = 0: another config
    n_train, n_val = 8000, 1000
    a = A.advise_transfer(space, n_train, n_val=n_val)
    q = sampling_rate(batch_size=64, basis=n_train + n_val)
    steps = trial_steps(epochs=10.0, batch_size=64, basis=n_train + n_val)
    expected = A.calibrate_noise_multiplier([], sampling_rate=q, steps=steps, delta=1e-5, target_epsilon=2.0)
    assert a.baseline_sigma == pytest.approx(expected, rel=1e-12)
    own = A.advise_transfer(space, n_train, n_val=n_val, baseline=space.default)
    assert own.baseline_sigma != pytest.approx(expected, rel=1e-3)
    raw = yaml.safe_load((ROOT / "search_spaces" / "mnist.yaml").read_text())
    raw["planner"]["baseline"] = {"seed": 3}
    with pytest.raises(ConfigError, match="planner.baseline.seed: is not a hyperparameter"):
        parse_space(raw)
    raw["planner"]["baseline"] = {"batch_size": "large"}
    with pytest.raises(ConfigError, match="planner.baseline.batch_size"):
        parse_space(raw)


def _rehearsed(gains: dict[float, float], key: str | None = None,
               se: dict[float, float] | None = None) -> dict[str, object]:
    """digits_scaled with a rehearsal of its own search (``key``: another one's; ``se``: its std errors)."""
    raw = yaml.safe_load(DIGITS_SCALED.read_text())
    raw["planner"] = {"proxy": "test rehearsal", "accuracy_spread": 0.05, "loss_per_noise_doubling": 0.1}
    raw["planner"].update(rehearsal=gains, rehearsal_of=key or A.rehearsal_key(parse_space(raw)))
    if se is not None:
        raw["planner"]["rehearsal_se"] = se
    return raw


def test_a_rehearsal_on_the_proxy_is_the_verdict() -> None:
    """planner.rehearsal (the search rehearsed on a public proxy, per total ε) decides: above 0 pays; between two
    rehearsed ε it is linear in log ε (ε 4 between 2 and 8: the mean of the two), outside them the nearest one."""
    space = parse_space(_rehearsed({8: -0.02, 2: 0.01}))
    assert space.planner.rehearsal == {2.0: 0.01, 8.0: -0.02}
    eps = (1.5, 2.0, 4.0, 6.0, 16.0)
    got = {e: A.advise_transfer(space, N_TRAIN, target_epsilon=e) for e in eps}
    assert got[1.5].rehearsed == got[2.0].rehearsed == 0.01 and got[16.0].rehearsed == -0.02
    assert got[4.0].rehearsed == pytest.approx(-0.005, abs=1e-15)
    assert got[6.0].rehearsed == pytest.approx(0.01 - 0.03 * math.log(3) / math.log(4), rel=1e-12)
    assert [got[e].pays for e in eps] == [True, True, False, False, False]
    assert "rehearsed on the public proxy: -2.00 points" in got[16.0].verdict
    assert "not expected to pay" in got[16.0].verdict and "interpolated between epsilon 2 and 8" in got[4.0].verdict
    # the analytic model with the same priors says the opposite at ε 1.5 and 16: the rehearsal overrides it
    plain = dataclasses.replace(space, planner=dataclasses.replace(space.planner, rehearsal=None))
    analytic = {e: A.advise_transfer(plain, N_TRAIN, target_epsilon=e) for e in (1.5, 16.0)}
    assert analytic[1.5].rehearsed is None and not analytic[1.5].pays and analytic[16.0].pays
    assert got[1.5].proxy == analytic[1.5].proxy  # the analytic figures are still computed and printed


def test_a_rehearsal_of_another_search_does_not_judge_this_one() -> None:
    """A rehearsal holds for the search it rehearsed (``rehearsal_of``): another range, a flag's override, a
    what-if stopping rule, another training-set size or another baseline is judged by the analytic model, and
    the verdict says so."""
    space = parse_space(_rehearsed({2: -0.02, 8: -0.02}))
    assert not A.advise_transfer(space, N_TRAIN).pays  # its own search: the rehearsal says no
    # the same baseline with another space's score noise (it is trained once, releasing no score) is the same
    assert A.advise_transfer(space, N_TRAIN, baseline=space.baseline.replace(score_noise=7.0)).rehearsed == -0.02
    raw = _rehearsed({2: -0.02, 8: -0.02})
    raw["space"]["learning_rate"]["choices"] = [0.3, 0.6, 2.4]  # another search, the same rehearsal lines
    edited = parse_space(raw)
    epochs = dataclasses.replace(space, fixed=space.fixed.replace(epochs=1.0), default=space.default.replace(epochs=1.0))
    plan = A.plan_search(space, N_TRAIN, A.STOPPING_RULES["composed"](mean=2.0), compare=False)
    what_if = (plan, A.plan_transfer(space, plan, final_n=N_TRAIN + N_VAL))
    for a in (A.advise_transfer(edited, N_TRAIN), A.advise_transfer(epochs, N_TRAIN),
              A.advise_transfer(space, N_TRAIN, planned=what_if), A.advise_transfer(space, N_TRAIN - 100),
              A.advise_transfer(space, N_TRAIN, baseline=space.default.replace(learning_rate=0.05))):
        assert a.rehearsed is None and a.pays == (a.proxy >= a.min_gain)
        assert "rehearsal (planner.rehearsal) is of another search or baseline" in a.verdict
    with pytest.raises(ConfigError) as e:
        parse_space({**raw, "planner": {**raw["planner"], "rehearsal_of": None}})  # type: ignore[dict-item]
    assert e.value.field == "planner.rehearsal_of"


def test_a_gain_within_its_standard_error_is_not_expected_to_pay() -> None:
    """planner.rehearsal_se: the verdict pays only when the rehearsed gain is above its standard error over the
    proxy seeds (interpolated like the gain); without one, above 0."""
    gains, se = {2: 0.004, 8: 0.03}, {2: 0.005, 8: 0.01}
    space = parse_space(_rehearsed(gains, se=se))
    assert space.planner.rehearsal_se == {2.0: 0.005, 8.0: 0.01}
    got = {e: A.advise_transfer(space, N_TRAIN, target_epsilon=e) for e in (2.0, 4.0, 8.0)}
    assert got[4.0].rehearsed_se == pytest.approx(0.0075, abs=1e-15)  # halfway in log ε
    assert [got[e].pays for e in (2.0, 4.0, 8.0)] == [False, True, True]  # +0.4 ± 0.5, +1.7 ± 0.75, +3 ± 1 points
    assert "+0.40 points (std error 0.50 over its proxy seeds)" in got[2.0].verdict
    assert "<= its std error: not expected to pay" in got[2.0].verdict
    assert A.advise_transfer(parse_space(_rehearsed(gains)), N_TRAIN, target_epsilon=2.0).pays  # no se: the sign
    for bad, field in (({2: 0.005}, "planner.rehearsal_se"), ({2: 0.005, 8: 0.0}, "planner.rehearsal_se"),
                       ({2: 0.005, 8: 3}, "planner.rehearsal_se.8"), (0.01, "planner.rehearsal_se")):
        with pytest.raises(ConfigError) as e:
            parse_space(_rehearsed(gains, se=bad))  # type: ignore[arg-type]
        assert e.value.field == field and e.value.fix, bad
    raw = _rehearsed(gains, se=se)
    del raw["planner"]["rehearsal"]  # type: ignore[index]
    with pytest.raises(ConfigError, match="without planner.rehearsal"):
        parse_space(raw)


@pytest.mark.integration  # make test-slow (CI runs it): every shipped MNIST rehearsal planned, ~18 s
def test_the_shipped_mnist_rehearsals_are_of_the_shipped_searches() -> None:
    """Each MNIST space's rehearsal is current (a change to the search or its code would leave it stale, and the
    verdict would fall back silently), carries its standard error, and is what judges: at total ε 1 no search
    is expected to pay (random search and the scaled searcher are rehearsed below the baseline; TPE's fourth
    version +0.23 points, within its std error 0.84); at ε 2 and 4 each is above its std error."""
    for name in ("mnist", "mnist_tpe", "mnist_scaled"):
        space = load_space(ROOT / "search_spaces" / f"{name}.yaml")
        assert A.rehearsal_key(space) == space.planner.rehearsal_of, name
        assert space.planner.rehearsal_se is not None and set(space.planner.rehearsal_se) == {1.0, 2.0, 4.0}, name
        got = {e: A.advise_transfer(space, 8000, n_val=1000, target_epsilon=e) for e in (1.0, 2.0, 4.0)}
        assert got[1.0].rehearsed == space.planner.rehearsal[1.0], name  # type: ignore[index]
        assert [got[e].pays for e in (1.0, 2.0, 4.0)] == [False, True, True], name


@pytest.mark.parametrize(("gains", "field"), [({0: 0.01}, "planner.rehearsal"), ({-1: 0.01}, "planner.rehearsal"),
                                              ({1: 5}, "planner.rehearsal.1"), ({2: "much"}, "planner.rehearsal.2"),
                                              ({}, "planner.rehearsal")])
def test_a_bad_rehearsal_names_the_field(gains: dict[float, object], field: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_space(_rehearsed(gains))  # type: ignore[arg-type]
    assert e.value.field == field and e.value.fix


def test_the_gate_refuses_a_search_its_rehearsal_says_loses(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    from dptune.cli.search import main as search_main

    ledger = tmp_path / "ledger.sqlite"
    path = _write(tmp_path, _rehearsed({1: -0.02, 16: -0.001}), "rehearsed")
    rc = search_main(["--space", str(path), "--ledger", str(ledger), "--budget-epsilon", "30",
                      "--runs-dir", str(tmp_path / "runs")])
    captured = capsys.readouterr()
    assert rc == 2, captured.err
    assert "rehearsed on the public proxy" in captured.out and "not expected to pay" in captured.out
    assert not ledger.exists() or Ledger(ledger).charges() == []
