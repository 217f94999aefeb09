"""ASHA under the RDP filter, run for real (issue 60): Ray Tune's ASHAScheduler on a local Ray, through
``dptune.search``; and the rung trainer alone on the real digits data (a refused segment never runs, a diverged
trial counts, a retried trial releases its rung score again unchanged)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml

import dptune
from dptune.accounting import FILTER_SLACK, ORDERS, RdpFilterDpEvent, rdp_of
from dptune.certificate import load_certificate
from dptune.config import TrialConfig
from dptune.config.params import rung_steps
from dptune.data import Splits
from dptune.dpsgd import run_rungs
from dptune.trials import read_trials
from tests.conftest import ROOT, digits_seed_with_k

SPACE = ROOT / "search_spaces" / "digits_asha.yaml"


def _small(epochs: int = 3, mean: int = 1) -> dict:  # type: ignore[type-arg]
    raw = yaml.safe_load(SPACE.read_text())
    raw["fixed"]["epochs"] = epochs  # rungs 1 and 3
    raw["privacy"]["mean"] = mean
    return raw


def test_an_asha_search_runs_on_ray_and_every_rung_score_is_noised_and_admitted(tmp_path: Path,
                                                                                isolated_env: dict[str, str]) -> None:
    raw = _small()
    found = dptune.search(raw, budget_epsilon=30, ledger=tmp_path / "l.sqlite", runs_dir=tmp_path / "runs", name="a",
                          num_cpus=2)
    plan = dptune.plan(raw)
    cert = load_certificate(tmp_path / "runs" / "a" / "release" / "certificate.json")
    (role, event), = cert.events
    assert isinstance(event, RdpFilterDpEvent) and cert.bound == "rdp"
    assert cert.stopping["rule"] == "filter" and cert.stopping["orders"] == [float(a) for a in ORDERS]
    assert found.epsilon == pytest.approx(plan.search_epsilon, rel=1e-9)
    sealed = tmp_path / "runs" / "a" / "sealed"
    filt = json.loads((sealed / "filter.json").read_text())
    rows = read_trials(sealed / "trials.parquet")
    assert rows, "no trial ran"
    admitted = filt["admitted"]
    spent = np.sum([np.asarray(v) for v in admitted.values()], axis=0)
    budget = np.asarray(filt["budget"])
    assert np.all(spent <= budget * (1 + FILTER_SLACK))  # never over the bound at any order
    assert np.allclose(budget, rdp_of(event.budget), rtol=0, atol=0)  # the bound is the charge's
    for r in rows:  # each rung the scheduler saw: a segment admitted before it ran, its score noised
        rung = int(r.measured["rung"])
        assert all(f"{r.index}/{k}" in admitted for k in range(rung + 1))
        assert r.measured["applied_score_noise"] == 9.0
        cfg = TrialConfig.from_dict({**raw["fixed"], **r.params})
        steps = rung_steps(epochs=3, batch_size=cfg.batch_size, basis=1257, rungs=(1, 3))
        assert r.steps == steps[rung]  # it ran exactly its admitted segments
    assert len(admitted) == sum(int(r.measured["rung"]) + 1 for r in rows)  # no segment admitted and not run
    released = found.config
    top = [r for r in rows if r.measured["rung"] == 1]
    if top:  # the release is the best noised score among the trials trained to the last rung
        best = max(top, key=lambda r: (r.score, -r.index))
        assert {k: released[k] for k in best.params} == best.params


def test_a_refused_segment_never_runs_and_a_retry_releases_the_same_score(digits: Splits, tmp_path: Path) -> None:
    cfg = TrialConfig(model="gn_cnn", epochs=3, batch_size=256, noise_multiplier=5.0, learning_rate=0.5,
                      score_noise=9.0, seed=12345, groups=4)
    asked, reported = [], []
    result = run_rungs(cfg, digits, (1, 3), admit=lambda k: asked.append(k) or k == 0,
                       report=lambda k, r: reported.append((k, r)), checkpoint_path=tmp_path / "t.pt")
    steps = rung_steps(epochs=3, batch_size=256, basis=len(digits.train[1]), rungs=(1, 3))
    assert asked == [0, 1] and [k for k, _ in reported] == [0]
    assert result is not None and result.steps == steps[0] and result.noise_additions == steps[0]
    assert result.applied_score_noise == 9.0 and result.score != result.val_accuracy_raw
    # a retry from the checkpoint (saved at the rung before its score was drawn): the same release, again
    again: list[float] = []
    retried = run_rungs(cfg, digits, (1, 3), admit=lambda k: k == 0, report=lambda k, r: again.append(r.score),
                        checkpoint_path=tmp_path / "t.pt")
    assert retried is not None and again == [result.score] and retried.steps == steps[0]
    # refused at the first segment: nothing of the data touched, nothing reported
    none = run_rungs(cfg.replace(seed=7), digits, (1, 3), admit=lambda k: False, report=lambda k, r: reported.append(r))
    assert none is None and len(reported) == 1


def test_a_diverged_asha_trial_counts_with_minus_infinity(digits: Splits) -> None:
    cfg = TrialConfig(model="gn_cnn", epochs=3, batch_size=256, noise_multiplier=0.5, learning_rate=1e38,
                      score_noise=9.0, seed=99, groups=4, momentum=0.0)
    reported: list[tuple[int, float]] = []
    result = run_rungs(cfg, digits, (1, 3), admit=lambda k: True, report=lambda k, r: reported.append((k, r.score)))
    assert result is not None and result.diverged and result.score == -math.inf
    assert reported and reported[-1][1] == -math.inf


@pytest.mark.integration  # make test-slow (CI runs it): a whole own_curve search on Ray, ~15 s
def test_own_curve_stops_a_trial_on_its_own_noised_scores_and_is_charged_at_every_rung(
        tmp_path: Path, isolated_env: dict[str, str]) -> None:
    """Route 2: random stopping over trials that each stop themselves; the charge is the worst case, a score at every
    rung (4 for epochs 15 at grace 1, η 3), the same whatever the trials do."""
    from dptune.tuning.trainable import stops_on_own_curve

    assert [stops_on_own_curve(s) for s in ([0.5], [0.5, 0.6], [0.5, 0.5], [0.6, 0.4])] == [False, False, True, True]
    raw = yaml.safe_load((ROOT / "search_spaces" / "digits_own_curve.yaml").read_text())
    plan = dptune.plan(raw)
    assert {p.scores for p in plan.points} == {4} and plan.stopping.random_stopping
    raw["fixed"]["epochs"] = 3
    found = dptune.search(raw, budget_epsilon=30, ledger=tmp_path / "l.sqlite", runs_dir=tmp_path / "runs", name="o",
                          num_cpus=2, seed=digits_seed_with_k(2, 4))
    assert found.epsilon == pytest.approx(dptune.plan(raw).search_epsilon, rel=1e-9)
    rows = read_trials(tmp_path / "runs" / "o" / "sealed" / "trials.parquet")
    assert len(rows) >= 2
    for r in rows:
        assert r.measured["rungs"] == 2 and r.measured["applied_score_noise"] == 9.0
        assert r.steps == rung_steps(epochs=3, batch_size=int(r.params["batch_size"]), basis=1257,
                                     rungs=(1, 3))[int(r.measured["rung"])]


@pytest.mark.slow  # make test-slow (CI runs it): an ASHA search interrupted and resumed, ~1 min of Ray restarts
def test_a_resumed_asha_search_continues_the_same_filter(tmp_path: Path, isolated_env: dict[str, str]) -> None:
    """Ctrl-C once the filter has admitted segments, then ``--resume``: the charge stays the one reservation, every
    segment admitted before is still admitted (none charged twice: the filter's spend is the sum over its keys), and
    every row's segments were admitted before they ran."""
    import subprocess
    import sys

    from dptune.ledger import Ledger
    from tests.conftest import free_port, interrupt_when

    raw = _small(epochs=9, mean=2)
    space = tmp_path / "asha.yaml"
    space.write_text(yaml.safe_dump(raw))
    env = {**isolated_env, "PYTHONPATH": str(ROOT)}
    args = [sys.executable, "-m", "dptune.search", "--space", str(space), "--name", "r", "--ledger", "ledger.sqlite",
            "--budget-epsilon", "100", "--num-cpus", "2", "--dashboard-port", str(free_port())]
    filt = tmp_path / "runs" / "r" / "sealed" / "filter.json"
    proc = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    out = interrupt_when(proc, lambda: filt.exists() and len(json.loads(filt.read_text())["admitted"]) >= 3, 240.0)
    assert proc.returncode == 130, out
    before = json.loads(filt.read_text())["admitted"]
    assert [c.status for c in Ledger(tmp_path / "ledger.sqlite").charges()] == ["reserved"]
    done = subprocess.run([*args, "--resume"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert [c.status for c in Ledger(tmp_path / "ledger.sqlite").charges()] == ["committed"]  # no second charge
    after = json.loads(filt.read_text())
    assert all(after["admitted"][k] == v for k, v in before.items())  # the same filter, continued
    spent = np.sum([np.asarray(v) for v in after["admitted"].values()], axis=0)
    assert np.all(spent <= np.asarray(after["budget"]) * (1 + FILTER_SLACK))
    for r in read_trials(tmp_path / "runs" / "r" / "sealed" / "trials.parquet"):
        assert all(f"{r.index}/{k}" in after["admitted"] for k in range(int(r.measured["rung"]) + 1))
