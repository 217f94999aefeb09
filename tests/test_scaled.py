"""The scaled searcher (``search.searcher: scaled``): known-answer accounting against dp_accounting, its
planner verdict, bad input, and a real Ray search + final training on the embedded digits data."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from dp_accounting import dp_event as de
from dp_accounting.rdp import RdpAccountant

from dptune import accounting as A
from dptune.config import ConfigError, SearchSpace, load_space
from dptune.config.params import sampling_rate, trial_steps
from dptune.ledger import Ledger
from tests.conftest import free_port, isolated_env_for, run_cli

ROOT = Path(__file__).resolve().parent.parent
SPACE = ROOT / "search_spaces" / "digits_scaled.yaml"
MNIST = ROOT / "search_spaces" / "mnist_scaled.yaml"
N_TRAIN, N_VAL = 1257, 180  # digits: 1797 - 360 test - 180 validation


def _swap_noisy_max(event: de.DpEvent, as_gaussian: bool) -> tuple[de.DpEvent, list[float]]:
    """``event`` with its noisy maxes replaced (by a Gaussian of noise multiplier 2β, the same RDP below the cap,
    or removed) and the Gumbel scales found."""
    if isinstance(event, A.NoisyMaxDpEvent):
        return (de.GaussianDpEvent(2 * event.gumbel_scale) if as_gaussian else de.NoOpDpEvent()), [event.gumbel_scale]
    if isinstance(event, de.ComposedDpEvent):
        parts = [_swap_noisy_max(e, as_gaussian) for e in event.events]
        return de.ComposedDpEvent([p for p, _ in parts]), [b for _, bs in parts for b in bs]
    return event, []


def _on_grid_above(charged: float, oracle: float) -> bool:
    """A charge on dptune's grid (six significant digits, rounded up: at most 1e-5 of ε above) against an independent
    oracle's unrounded ε (its own agreement with dptune: 1e-6)."""
    return oracle * (1 - 1e-6) <= charged <= oracle * (1 + 1e-5 + 1e-6)


def _eps(events: list[de.DpEvent], delta: float = 1e-5) -> float:
    """Independent pricing of what dptune charges, the smaller valid bound: dp_accounting's RDP accountant at
    dptune's orders (a noisy max as a Gaussian of noise multiplier 2β: λ/(8β²), which dptune caps at the
    pure-DP 1/β above order 8β) and its PLD accountant at dptune's 1e-3 grid (a noisy max as the pure
    (1/β)-DP randomized-response pair)."""
    from dp_accounting.pld import PLDAccountant
    from dp_accounting.pld import privacy_loss_distribution as pldlib
    from dp_accounting.pld.common import DifferentialPrivacyParameters

    rdp = RdpAccountant(orders=[float(o) for o in A.ORDERS])
    pld = PLDAccountant(value_discretization_interval=1e-3)
    betas: list[float] = []
    for e in events:
        rdp.compose(_swap_noisy_max(e, True)[0])
        plain, found = _swap_noisy_max(e, False)
        pld.compose(plain)
        betas += found
    total = pld._pld  # noqa: SLF001 - the accountant's PLD, to compose the noisy max's pure-DP pair with
    for b in betas:
        total = total.compose(pldlib.from_privacy_parameters(DifferentialPrivacyParameters(1 / b, 0.0),
                                                             value_discretization_interval=1e-3))
    return min(float(rdp.get_epsilon(delta)), float(total.get_epsilon_for_delta(delta)))


def _trials(sigma: float, q: float, steps: int, score_noise: float, k: int) -> de.DpEvent:
    one = de.ComposedDpEvent([de.SelfComposedDpEvent(de.PoissonSampledDpEvent(q, de.GaussianDpEvent(sigma)), steps),
                              de.GaussianDpEvent(score_noise)])
    return de.SelfComposedDpEvent(one, k)


def _noisy_max_search(sigma: float, q: float, steps: int, beta: float, k: int) -> de.DpEvent:
    """k composed trials that release nothing, and the one noisy max (priced by :func:`_eps`)."""
    training = de.SelfComposedDpEvent(de.PoissonSampledDpEvent(q, de.GaussianDpEvent(sigma)), steps)
    return de.ComposedDpEvent([de.SelfComposedDpEvent(training, k), A.NoisyMaxDpEvent(beta)])


def _final(sigma: float, epochs: float, n: int, batch: int = 256) -> de.DpEvent:
    q, steps = sampling_rate(batch_size=batch, basis=n), trial_steps(epochs=epochs, batch_size=batch, basis=n)
    return de.SelfComposedDpEvent(de.PoissonSampledDpEvent(q, de.GaussianDpEvent(sigma)), steps)


def test_trial_and_final_sigma_known_answer() -> None:
    space = load_space(SPACE)
    p = space.privacy
    assert p.target_epsilon == 8 and p.search_share == 0.3 and p.score_noise is not None
    plan = A.plan_search(space, N_TRAIN)
    scaled = A.plan_transfer(space, plan, final_n=N_TRAIN + N_VAL)
    q, steps = 256 / N_TRAIN, math.ceil(15 * N_TRAIN / 256)
    sc, sf = scaled.trial_sigma, scaled.final_sigma(256, 15)
    assert p.selection == "noisy_max" and p.score_noise == 2.6
    search = _noisy_max_search(sc, q, steps, p.score_noise, 3)
    # the cheap trials: the smallest σ whose 3 composed trials and the one noisy max fit share·target
    assert _eps([search]) <= 0.3 * 8 * (1 + 1e-6) < _eps([_noisy_max_search(0.99 * sc, q, steps, 2.6, 3)])
    assert _on_grid_above(plan.search_epsilon, _eps([search]))
    # the trials release no score: each is charged for its training only, the selection once
    assert plan.search_event == de.ComposedDpEvent([
        de.SelfComposedDpEvent(A.trial_event(noise_multiplier=sc, sampling_rate=q, steps=steps, score_noise=None), 3),
        A.NoisyMaxDpEvent(2.6)])
    # the final run: the smallest σ whose run on train ∪ validation, composed with the search, fits the target
    assert _eps([search, _final(sf, 15, N_TRAIN + N_VAL)]) <= 8 * (1 + 1e-6)
    assert _eps([search, _final(0.99 * sf, 15, N_TRAIN + N_VAL)]) > 8
    assert sc > 3 * sf  # the trials are cheap: several times the final run's noise
    # each trial runs its candidate at the final run's update noise lr·σ: by hand, trial lr = L·σ_f/σ_c
    assert scaled.candidates == ({"learning_rate": 0.3}, {"learning_rate": 0.6}, {"learning_rate": 1.2})
    for c in scaled.candidates:
        t = scaled.trial_config(space.fixed.replace(**c))
        assert t.noise_multiplier == sc and t.learning_rate == pytest.approx(c["learning_rate"] * sf / sc, rel=1e-12)
        assert scaled.final_config(space.fixed.replace(**c)).noise_multiplier == sf


def test_search_share_that_cannot_pay_names_the_field() -> None:
    space = load_space(SPACE)
    starved = dataclasses.replace(space, privacy=dataclasses.replace(space.privacy, target_epsilon=0.5,
                                                                      search_share=0.05))
    with pytest.raises(ConfigError) as e:
        A.plan_search(starved, N_TRAIN)
    assert e.value.field == "privacy.search_share"


def test_mnist_spaces_run_each_batch_and_epochs_at_its_own_cheap_sigma() -> None:
    """The whole-space MNIST searchers (random, TPE, scaled B × lr): every reachable (B, E) has its own trial σ_c,
    in proportion to q·√T (about the same cost each; small batches are not run at a large batch's noise), the
    charge is the exact worst case over those points, and trial lr = L·s(B)·σ_f(B, E)/σ_c(B, E) by hand (s(B): the
    space's lr batch scaling, √(B/256) in the whole-space spaces, 1 in the scaled one)."""
    for name in ("mnist.yaml", "mnist_tpe.yaml", "mnist_scaled.yaml"):
        space = load_space(ROOT / "search_spaces" / name)
        plan = A.plan_search(space, 8000, compare=False)
        tp = A.plan_transfer(space, plan, final_n=9000)
        w = {(b, e): (b / 8000) * math.sqrt(trial_steps(epochs=e, batch_size=b, basis=8000)) for b, e, _, _ in tp.sigmas}
        top = max(w.values())
        for b, e, sc, sf in tp.sigmas:
            assert sc == pytest.approx(max(0.5, tp.trial_sigma * w[b, e] / top), rel=1e-12)
            cfg = space.fixed.replace(batch_size=b, epochs=e, learning_rate=0.7)
            t = tp.trial_config(cfg)
            scale = math.sqrt(b / 256) if name != "mnist_scaled.yaml" else 1.0
            assert (t.noise_multiplier, t.learning_rate) == (sc, pytest.approx(0.7 * scale * sf / sc, rel=1e-12))
            # σ_f(B, E): the smallest σ whose final run on 9000 examples, composed with the search, fits the target
            # (dptune's accountant: dp_accounting prices neither a worst case nor random stopping)
            assert A.epsilon([plan.search_event, _final(sf, e, 9000, b)], 1e-5) <= 2 * (1 + 1e-6)
            assert A.epsilon([plan.search_event, _final(0.99 * sf, e, 9000, b)], 1e-5) > 2
        # the charge: the whole search at exactly these points, priced by the same planner at the same σ's
        assert plan.search_epsilon <= 0.3 * 2 * (1 + 1e-6)
        assert {(pt.noise_multiplier, pt.sampling_rate, pt.steps) for pt in plan.points} == {
            (sc, b / 8000, trial_steps(epochs=e, batch_size=b, basis=8000)) for b, e, sc, _ in tp.sigmas}


def test_transfer_advice_is_its_formula_by_hand() -> None:
    """The verdict's proxy for the scaled searcher on digits, recomputed here from its definition."""
    space = load_space(SPACE)
    a = A.advise_transfer(space, N_TRAIN, accuracy_spread=0.02, loss_per_noise_doubling=0.03, min_gain=0.005)
    tp = a.plan
    (b, e, sc, sf), = tp.sigmas
    d = space.default
    t_a = trial_steps(epochs=d.epochs, batch_size=d.batch_size, basis=N_TRAIN + N_VAL)
    t_f = trial_steps(epochs=e, batch_size=b, basis=N_TRAIN + N_VAL)
    assert a.noise_ratio == pytest.approx((sf / (b * math.sqrt(t_f))) / (a.baseline_sigma / (d.batch_size * math.sqrt(t_a))))
    err = math.hypot(2.6 * math.pi / math.sqrt(6) / N_VAL, math.sqrt(0.25 / N_VAL))
    rho = 0.02 / math.hypot(0.02, err)
    from dptune.accounting._advice import expected_max

    gain = rho * 0.02 * expected_max(3) / (1 + math.log2(sc / sf))
    assert a.expected_gain == pytest.approx(gain, rel=1e-9)
    assert a.proxy == pytest.approx(gain - 0.03 * math.log2(a.noise_ratio), rel=1e-9)
    assert a.pays == (a.proxy >= 0.005)
    # the verdict follows the priors: 15 points lost per noise doubling and a tiny spread make it not pay
    assert not A.advise_transfer(space, N_TRAIN, accuracy_spread=0.001, loss_per_noise_doubling=0.15).pays


def _variant(tmp_path: Path, name: str, edit: dict[str, dict[str, object]], base: Path = SPACE) -> Path:
    raw = yaml.safe_load(base.read_text())
    for section, changes in edit.items():
        for key, value in changes.items():
            if value is None:
                raw[section].pop(key, None)
            else:
                raw[section][key] = value
    out = tmp_path / f"{name}.yaml"
    out.write_text(yaml.safe_dump(raw))
    return out


BAD = [  # (name, edit, base space, field the message must name)
    ("no_share", {"privacy": {"search_share": None}}, SPACE, "privacy.search_share"),
    ("no_target", {"privacy": {"target_epsilon": None}}, SPACE, "privacy.target_epsilon"),
    ("share_1", {"privacy": {"search_share": 1.0}}, SPACE, "privacy.search_share"),
    ("mean", {"privacy": {"mean": 2}}, SPACE, "privacy.mean"),
    ("batch", {"space": {"batch_size": {"type": "int", "low": 128, "high": 256}},
               "default": {"batch_size": 256}, "fixed": {"batch_size": None}}, SPACE, "space.batch_size"),
    ("sigma_searched", {"space": {"noise_multiplier": {"type": "categorical", "choices": [1.0, 2.0]}},
                        "default": {"noise_multiplier": 1.0}}, SPACE, "space.noise_multiplier"),
    ("float_lr", {"space": {"learning_rate": {"type": "float", "low": 0.1, "high": 2.0}}}, SPACE,
     "space.learning_rate"),
    ("random_stopping", {"search": {"accounting": "random_stopping"}}, SPACE, "search.accounting"),
    ("subsample", {"search": {"tune_fraction": 0.5}}, SPACE, "search.tune_fraction"),
    ("share_on_random", {"privacy": {"search_share": 0.3}}, ROOT / "search_spaces" / "digits.yaml",
     "space.noise_multiplier"),
    ("starved", {"privacy": {"target_epsilon": 0.5, "search_share": 0.05}}, SPACE, "privacy.search_share"),
    ("selection_unknown", {"privacy": {"selection": "argmax"}}, SPACE, "privacy.selection"),
    ("noisy_max_on_random", {"privacy": {"selection": "noisy_max"}}, ROOT / "search_spaces" / "digits.yaml",
     "privacy.selection"),
    ("noisy_max_public", {"dataset": {"public_validation": True}}, SPACE, "privacy.selection"),
    ("noisy_max_no_noise", {"privacy": {"score_noise": 0.0}}, SPACE, "privacy.score_noise"),
]


@pytest.mark.parametrize("name, edit, base, field", BAD, ids=[b[0] for b in BAD])
def test_bad_scaled_space_exits_2_and_charges_nothing(name: str, edit: dict[str, dict[str, object]], base: Path,
                                                      field: str, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from dptune.cli.plan import main as plan_main
    from dptune.cli.search import main as search_main

    space = _variant(tmp_path, name, edit, base)
    ledger = tmp_path / "ledger.sqlite"
    rc = search_main(["--space", str(space), "--ledger", str(ledger), "--budget-epsilon", "30", "--runs-dir",
                      str(tmp_path / "runs")])
    err = capsys.readouterr().err
    assert rc == 2 and "error: " in err and field in err, err
    assert not ledger.exists() or Ledger(ledger).charges() == []
    assert plan_main(["--space", str(space)]) == 2
    assert field in capsys.readouterr().err


@pytest.mark.parametrize("args, flag", [
    (["--baseline", "no/such.yaml"], "--baseline"), (["--accuracy-spread", "0"], "--accuracy-spread"),
    (["--loss-per-doubling", "-1"], "--loss-per-doubling"), (["--min-gain", "nan"], "--min-gain"),
])
def test_bad_plan_flags_exit_2(args: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    from dptune.cli.plan import main as plan_main

    assert plan_main(["--space", str(SPACE), *args]) == 2
    assert flag in capsys.readouterr().err


def test_plan_cli_prints_the_scaled_plan(capsys: pytest.CaptureFixture[str]) -> None:
    from dptune.cli.plan import main as plan_main

    assert plan_main(["--space", str(SPACE), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["transfer"]
    scaled = A.plan_transfer(load_space(SPACE), A.plan_search(load_space(SPACE), N_TRAIN), final_n=N_TRAIN + N_VAL)
    assert out["trial_noise_multiplier"] == scaled.trial_sigma
    assert out["final_noise_multipliers"] == [{"batch_size": 256, "epochs": 15.0,
                                               "noise_multiplier": scaled.final_sigma(256, 15)}]
    assert out["candidates"] == [{"learning_rate": c} for c in (0.3, 0.6, 1.2)]
    assert out["search_epsilon"] <= 0.3 * 8 and isinstance(out["pays"], bool) and out["searcher"] == "scaled"
    assert plan_main(["--space", str(SPACE), "--target-epsilon", "4", "--json"]) == 0  # re-sized for ε 4
    assert (json.loads(capsys.readouterr().out)["transfer"]["final_noise_multipliers"][0]["noise_multiplier"]
            > scaled.final_sigma(256, 15))


def _space_at(epochs: float, path: Path = SPACE) -> SearchSpace:
    space = load_space(path)
    return dataclasses.replace(space, fixed=space.fixed.replace(epochs=epochs),
                               default=space.default.replace(epochs=epochs))


def _noisy_max_choice(run: Path, rows: list[dict[str, object]], beta: float) -> int:
    """The index report-noisy-max must have released, recomputed from the sealed draw's selection stream and
    the sealed raw validation accuracies (180 validation examples)."""
    import numpy as np

    from dptune.tuning.draw import Draw

    seed = Draw.load(run / "sealed" / "draw.json").stream_seed("selection")
    gumbel = np.random.default_rng(seed).gumbel(0.0, beta, size=len(rows))
    by_index = sorted(rows, key=lambda r: int(r["index"]))  # type: ignore[call-overload]
    noised = [round(float(r["val_accuracy_raw"]) * N_VAL) + gumbel[i]  # type: ignore[arg-type]
              for i, r in enumerate(by_index)]
    return int(np.argmax(noised))


# make test-slow (CI runs it): a real search and its final run, ~40 s each selection rule; tests/test_search.py
# keeps the main job's end-to-end search in the default suite
@pytest.mark.integration
@pytest.mark.parametrize("selection", ["noisy_max", "best_score"])
def test_scaled_search_and_final_training_end_to_end(selection: str, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A real Ray search (3 trials, 3 epochs) and the final run it prints: what ran is what was charged, and
    what was released is what the selection rule chose (the shipped noisy max, or a noised score per trial)."""
    import torch

    from dptune.cli.train import main as train_main

    env = {**isolated_env_for(tmp_path), "RAY_ADDRESS": "local"}
    ledger = tmp_path / "ledger.sqlite"
    space_file = SPACE if selection == "noisy_max" else _variant(
        tmp_path, "scores", {"privacy": {"selection": "best_score", "score_noise": 9.0}})
    r = run_cli(["-m", "dptune.search", "--space", str(space_file), "--name", "sc", "--runs-dir",
                 str(tmp_path / "runs"), "--ledger", str(ledger), "--budget-epsilon", "30", "--num-cpus", "2",
                 "--epochs", "3", "--dashboard-port", str(free_port())], env)
    assert r.returncode == 0, r.stdout + r.stderr
    # the printed final command carries no target to type back: the release holds the space's (issue 41 item 4)
    assert "--train-on-validation" in r.stdout and "search + training <= epsilon 8" in r.stdout
    assert "learning_rate = " in r.stdout
    space = _space_at(3.0, space_file)
    plan = A.plan_search(space, N_TRAIN)
    scaled = A.plan_transfer(space, plan, final_n=N_TRAIN + N_VAL)
    sigma_f = scaled.final_sigma(256, 3)
    lrs = [c["learning_rate"] for c in scaled.candidates]
    run = tmp_path / "runs" / "sc"
    rows = pq.read_table(run / "sealed" / "trials.parquet").to_pylist()
    assert sorted(r["index"] for r in rows) == [0, 1, 2]
    t = trial_steps(epochs=3, batch_size=256, basis=N_TRAIN)
    # measured by the trial, not copied from the plan: no score noise is drawn under the noisy max
    score_noise = None if selection == "noisy_max" else 9.0
    for row in rows:
        m, params = json.loads(row["measured"]), json.loads(row["params"])
        assert m["noise_additions"] == t and m.get("applied_score_noise") == score_noise
        assert m["noise_std"] == pytest.approx(scaled.trial_sigma * 1.0, rel=0.03)  # clip C = 1
        # the sealed params are the final run's candidate; the trial ran it at lr L·σ_f/σ_c (measured: the
        # trainer's own steps applied that lr, checked through the noise std and the candidate order)
        assert params == scaled.candidates[row["index"]]
    # the charge is the composed trials at that σ (and the one noisy max), priced independently
    charge = Ledger(ledger).charges()[0]
    search = (_noisy_max_search(scaled.trial_sigma, 256 / N_TRAIN, t, 2.6, 3) if selection == "noisy_max"
              else _trials(scaled.trial_sigma, 256 / N_TRAIN, t, 9.0, 3))
    assert _on_grid_above(charge.epsilon, _eps([search]))
    released = yaml.safe_load((run / "release" / "best_config.yaml").read_text())
    cert = json.loads((run / "release" / "certificate.json").read_text())
    if selection == "noisy_max":  # only the index leaves sealed/: no score, the event names the mechanism
        best_index = _noisy_max_choice(run, rows, 2.6)
        assert released["score"] is None and "report-noisy-max" in released["score_kind"]
        assert "score:  none — not released" in r.stdout and "NoisyMaxDpEvent" in json.dumps(cert)
        assert cert["details"]["selection"]["gumbel_scale"] == 2.6
    else:
        best_index = int(max(rows, key=lambda r: r["score"])["index"])
        assert released["score"] == max(r["score"] for r in rows) and "NoisyMaxDpEvent" not in json.dumps(cert)
    lr = released["config"]["learning_rate"]
    assert lr == lrs[best_index] and released["config"]["noise_multiplier"] == sigma_f
    assert released["scaling_rule"]["lr_times_sigma"] == pytest.approx(lr * sigma_f)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for extra, n in (["--train-on-validation"], N_TRAIN + N_VAL), ([], N_TRAIN):
            out = tmp_path / f"final{len(extra)}"
            assert train_main(["--release", str(run / "release"), "--out", str(out), "--ledger", str(ledger),
                               "--target-epsilon", "8", *extra]) == 0
            m = json.loads((out / "metrics.json").read_text())
            sigma = m["noise_multiplier"]
            # the final lr follows the rule for the σ this run calibrated (σ_f when on train ∪ validation)
            assert m["learning_rate"] * sigma == pytest.approx(lr * sigma_f, rel=1e-9)
            assert m["n_train"] == n and m["steps"] == trial_steps(epochs=3, batch_size=256, basis=n)
            total = _eps([search, _final(sigma, 3, n)])
            assert total <= 8 * (1 + 1e-6) and m["test_accuracy"] > 0.5
            if n == N_TRAIN + N_VAL:
                assert sigma == pytest.approx(sigma_f, rel=2e-3)
            else:
                assert sigma > sigma_f * 1.01  # fewer examples: more noise, and a smaller lr
        capsys.readouterr()
    finally:
        torch.set_num_threads(threads)
