"""A grouped search (``--group-trials``) against the same search one trial at a time: real local Ray (2 CPUs,
loopback), real trials on digits, the same NOT PRIVATE draw seed."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import yaml

from dptune.config import TrialConfig
from dptune.ledger import Ledger
from dptune.tuning.grouping import plan_groups
from tests.conftest import ROOT, digits_seed_with_k, free_port, run_cli, trial_processes, wait_until


def _space(tmp_path: Path) -> Path:
    """The digits space with the MLP under whole-model vmap: its grouped trials equal its lone trials bitwise."""
    space = yaml.safe_load((ROOT / "search_spaces" / "digits.yaml").read_text())
    space["model"] = {"name": "mlp"}
    space["fixed"]["clipping"] = "functorch"
    path = tmp_path / "digits_mlp.yaml"
    path.write_text(yaml.safe_dump(space))
    return path


def _search(tmp_path: Path, env: dict[str, str], name: str, seed: int, *extra: str) -> tuple[str, Path]:
    r = run_cli(["-m", "dptune.search", "--space", str(_space(tmp_path)), "--name", name, "--runs-dir",
                 str(tmp_path / "runs"), "--ledger", str(tmp_path / f"{name}.sqlite"), "--budget-epsilon", "30",
                 "--num-cpus", "2", "--dashboard-port", str(free_port()), "--smoke-test", "--seed", str(seed),
                 *extra], env)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout, tmp_path / "runs" / name


def _rows(run: Path) -> list[dict[str, Any]]:
    keep = ("index", "params", "seed", "score", "val_accuracy_raw", "diverged", "crashed", "steps", "sampling_rate",
            "noise_multiplier")
    rows = pq.read_table(run / "sealed" / "trials.parquet").to_pylist()
    out = []
    for r in sorted(rows, key=lambda r: r["index"]):
        measured = {k: v for k, v in json.loads(r["measured"]).items() if k != "device"}
        out.append({**{k: r[k] for k in keep}, "measured": measured})
    return out


def _transcript(text: str, name: str, tmp_path: Path) -> str:
    """What differs between two runs whatever they do: the folder, the run's name, a budget's random id, the port."""
    text = text.replace(str(tmp_path), "<tmp>").replace(name, "<name>")
    text = re.sub(r"\(id [0-9a-f]{16,}\)", "(id <random>)", text)
    return re.sub(r"127\.0\.0\.1:\d+", "127.0.0.1:<port>", text)


KS = {"K1-2": (1, 2), "K4-6": (4, 6)}  # groups of one trial, and groups of several


@pytest.fixture(scope="module")
def searches(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, tuple[str, Path]]]:
    """Per K: the same draw searched one trial at a time and grouped (stdout, run folder)."""
    from tests.conftest import isolated_env_for

    out: dict[str, dict[str, tuple[str, Path]]] = {}
    for label, k in KS.items():
        base = tmp_path_factory.mktemp(label)
        env = isolated_env_for(base)
        seed = digits_seed_with_k(*k)
        out[label] = {"alone": _search(base, env, "alone", seed), "base": ("", base),
                      "grouped": _search(base, env, "grouped", seed, "--group-trials")}
    return out


@pytest.mark.integration  # two whole searches through Ray per K (make test-slow; CI runs it)
@pytest.mark.parametrize("label", list(KS))
def test_grouped_search_equals_one_at_a_time(searches: dict[str, dict[str, tuple[str, Path]]], label: str) -> None:
    """Same draw: every sealed row (score, raw accuracy, steps, measured noise and batches), the released config,
    the certificate's charge, and the terminal transcript are those of the one-at-a-time search."""
    (out_a, run_a), (out_b, run_b), (_, base) = (searches[label][m] for m in ("alone", "grouped", "base"))
    assert _rows(run_a) == _rows(run_b)
    assert (run_a / "release" / "best_config.yaml").read_text() == (run_b / "release" / "best_config.yaml").read_text()
    cert_a, cert_b = (json.loads((r / "release" / "certificate.json").read_text()) for r in (run_a, run_b))
    assert (cert_a["epsilon"], cert_a["delta"], cert_a["events"]) == (cert_b["epsilon"], cert_b["delta"],
                                                                        cert_b["events"])
    assert _transcript(out_a, "alone", base) == _transcript(out_b, "grouped", base)


@pytest.mark.integration  # the searches above (make test-slow; CI runs it)
def test_the_transcript_is_the_same_for_every_k(searches: dict[str, dict[str, tuple[str, Path]]]) -> None:
    """Grouped, at K 1-2 and 4-6: the transcripts differ only in what is released (the config and its noised
    score), with the rows above checked to differ in number, so nothing on the terminal tells K."""
    a, b = (searches[label] for label in KS)
    assert len(_rows(a["grouped"][1])) < len(_rows(b["grouped"][1]))

    def released_masked(label: str) -> str:
        text = _transcript(searches[label]["grouped"][0], "grouped", searches[label]["base"][1])
        text = re.sub(r"(?m)^(  config: ).*$", r"\1<released>", text)
        return re.sub(r"(?m)^(  score:  )[0-9.]+", r"\1<score>", text)

    first, second = (released_masked(label) for label in KS)
    assert "<released>" in first and "<score>" in first
    assert first == second


def test_groups_are_one_architecture_balanced_over_the_slots() -> None:
    """A function of the configs and the slots: one architecture per group, each over at most ``slots`` groups,
    every trial exactly once, the longest trials spread first."""
    base = TrialConfig(model="mlp", batch_size=64, epochs=1.0)
    configs = [base, base.replace(epochs=4.0), base.replace(groups=2), base.replace(epochs=2.0),
               base.replace(epochs=3.0), base.replace(groups=2, epochs=2.0)]
    groups = plan_groups(configs, slots=2, basis=1000.0)
    assert sorted(i for g in groups for i in g) == list(range(6))
    assert sorted(groups) == [[0, 1], [2], [3, 4], [5]]  # loads 4+1, 3+2 (T ∝ epochs); groups=2 apart
    assert plan_groups(configs, slots=1, basis=1000.0) == [[0, 1, 3, 4], [2, 5]]
    assert plan_groups(configs[:1], slots=4, basis=1000.0) == [[0]]


@pytest.mark.integration  # two whole searches through Ray, one killed, and the K4-6 one above (make test-slow; CI runs it)
def test_a_killed_grouped_search_resumes_its_own_groups(tmp_path: Path, isolated_env: dict[str, str],
                                                        searches: dict[str, dict[str, tuple[str, Path]]]) -> None:
    """A grouped search SIGKILLed with its Ray once Tune saved its trials (the groups), then resumed on one CPU
    (where the draw would be split into fewer groups: Tune's saved group numbers then named other members, or
    none): the resume restores Tune's experiment with the first session's groups, charges nothing more, and every
    sealed row equals the one-at-a-time search's. Resumed without --group-trials it says it keeps them."""
    seed = digits_seed_with_k(*KS["K4-6"])
    alone = searches["K4-6"]["alone"][1]  # the same draw, one trial at a time
    name = "killed"
    args = ["-m", "dptune.search", "--space", str(_space(tmp_path)), "--name", name, "--runs-dir",
            str(tmp_path / "runs"), "--ledger", str(tmp_path / "killed.sqlite"), "--budget-epsilon", "30",
            "--smoke-test", "--seed", str(seed)]
    proc = subprocess.Popen([sys.executable, *args, "--num-cpus", "2", "--dashboard-port", str(free_port()),
                             "--group-trials"], cwd=ROOT, env=isolated_env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    state = tmp_path / "runs" / name / "sealed" / "state.json"
    try:
        wait_until(lambda: state.exists() and json.loads(state.read_text()).get("status") == "running")
        wait_until(lambda: bool(trial_processes(proc.pid)) or proc.poll() is not None, step=0.05)
        # Tune's own saved experiment (its trials: the groups), which the resume restores
        wait_until(lambda: any(state.parent.glob("ray/*/experiment_state*.json")) or proc.poll() is not None,
                   step=0.05)
        assert proc.poll() is None, "the search finished before its trials could be killed"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    groups = json.loads(state.read_text()).get("groups")
    assert groups and sorted(i for g in groups for i in g) == list(range(len(_rows(alone))))
    ledger = Ledger(tmp_path / "killed.sqlite")
    assert [c.status for c in ledger.charges()] == ["reserved"]
    r = run_cli([*args, "--num-cpus", "1", "--dashboard-port", str(free_port()), "--group-trials", "--resume"],
                isolated_env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "could not be read" not in r.stdout, r.stdout  # Tune's own state restored, not a fresh experiment
    assert json.loads(state.read_text())["groups"] == groups
    assert [c.status for c in ledger.charges()] == ["committed"]
    assert _rows(tmp_path / "runs" / name) == _rows(alone)


def test_a_resume_keeps_the_first_sessions_grouping(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The grouping is decided once, before Tune saves anything, and sealed: a resume reads it back whatever
    ``--group-trials`` says now, and says when the flag differs."""
    from dptune.rundir import RunDir
    from dptune.tuning.options import RayOptions
    from dptune.tuning.runner import _stored_groups

    run = RunDir(tmp_path / "run")
    run.sealed.mkdir(parents=True)
    run.write_state(groups=[[0, 2], [1]])
    assert _stored_groups(run.read_state()["groups"], RayOptions(group_trials=True)) == [[0, 2], [1]]
    assert capsys.readouterr().out == ""
    assert _stored_groups(run.read_state()["groups"], RayOptions(group_trials=False)) == [[0, 2], [1]]
    assert "started with --group-trials and resumes that way" in capsys.readouterr().out
    run.write_state(groups=None)
    assert _stored_groups(run.read_state()["groups"], RayOptions(group_trials=True)) is None
    assert "started without --group-trials and resumes that way" in capsys.readouterr().out


RAISES_LATE = '''
import torch
from torch import nn


class Net(nn.Module):
    """An MLP that raises in evaluation once training has moved its weights, when built with 8 groups: the user's own
    exception, late enough that the clipping guard's probes (fresh copies at their init) never meet it. In the
    captured program: torch._assert on the parameters against a copy of their init (a buffer), never on the data."""

    def __init__(self, num_classes, shape, groups):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(shape[0] * shape[1] * shape[2], 32), nn.Tanh(),
                                  nn.Linear(32, num_classes))
        self.groups = groups
        self.register_buffer("init", self.body[1].weight.detach().clone())

    def forward(self, x):
        if self.groups == 8 and not self.training:
            torch._assert((self.body[1].weight - self.init).abs().max() < 1e-6, "the user's model raised")
        return self.body(x)


def make(num_classes, input_shape, groups):
    return Net(num_classes, input_shape, groups)
'''


@pytest.mark.integration  # two whole searches through Ray, each stopped (make test-slow; CI runs it)
def test_a_member_that_raises_stops_the_grouped_search_as_it_stops_the_search_alone(
        tmp_path: Path, isolated_env: dict[str, str]) -> None:
    """A trial whose model raises is infrastructure alone (retried, then the search stops: nothing released, the
    charge reserved). Grouped, its exception scored it −∞ and the search released the best of the others: a
    raise on the private data chose the release. Now both searches stop the same way."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "raiseslate.py").write_text(RAISES_LATE)
    space = yaml.safe_load(_space(tmp_path).read_text())
    space["model"] = {"factory": "raiseslate:make"}
    path = tmp_path / "raises.yaml"
    path.write_text(yaml.safe_dump(space))
    env = {**isolated_env, "PYTHONPATH": f"{ROOT}:{code}"}
    seed = digits_seed_with_k(*KS["K4-6"])
    outcomes = {}
    for name, extra in (("alone", []), ("grouped", ["--group-trials"])):
        r = run_cli(["-m", "dptune.search", "--space", str(path), "--name", name, "--runs-dir", str(tmp_path / "runs"),
                     "--ledger", str(tmp_path / f"{name}.sqlite"), "--budget-epsilon", "30", "--num-cpus", "2",
                     "--dashboard-port", str(free_port()), "--smoke-test", "--seed", str(seed), "--max-failures", "1",
                     *extra], env)
        release = tmp_path / "runs" / name / "release"
        outcomes[name] = (r.returncode, "a trial raised an error" in r.stdout + r.stderr,
                          release.exists() and any(release.iterdir()),
                          [c.status for c in Ledger(tmp_path / f"{name}.sqlite").charges()])
    assert outcomes["alone"] == (1, True, False, ["reserved"]), outcomes
    assert outcomes["grouped"] == outcomes["alone"], outcomes
