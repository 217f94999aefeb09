"""Failures never lose spend and never change what a search releases.

- an infrastructure failure (a trial's worker process killed) is retried from the trial's checkpoint with
  the same seed and hyperparameters: every trial's score equals the uninterrupted run's;
- the driver SIGKILLed mid-search, then `--resume`: same sealed draw, no second charge, same release;
- a diverging trial counts with score −∞ and is not retried.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from dptune.ledger import Ledger
from tests.conftest import (
    ROOT,
    digits_seed_with_k,
    free_port,
    interrupt_when,
    kill_one_trial_once_checkpointed,
    run_cli,
    trial_processes,
    wait_until,
)

pytestmark = pytest.mark.ray

SPACE = "search_spaces/digits.yaml"
EPOCHS = "6"


def _seed() -> int:
    return digits_seed_with_k(2, 3)


def _args(base: Path, name: str, *extra: str) -> list[str]:
    return ["-m", "dptune.search", "--space", SPACE, "--name", name, "--runs-dir", str(base / "runs"),
            "--ledger", str(base / "ledger.sqlite"), "--budget-epsilon", "100", "--num-cpus", "2",
            "--dashboard-port", str(free_port()), "--epochs", EPOCHS, "--seed", str(_seed()),
            "--checkpoint-every", "1", *extra]


def _trials(base: Path, name: str) -> list[dict]:
    return sorted(pq.read_table(base / "runs" / name / "sealed" / "trials.parquet").to_pylist(),
                  key=lambda r: r["index"])


def _release(base: Path, name: str) -> dict:
    return yaml.safe_load((base / "runs" / name / "release" / "best_config.yaml").read_text())


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted run with the same (test-only) seed."""
    base = tmp_path_factory.mktemp("ref")
    from tests.conftest import isolated_env_for

    r = run_cli(_args(base, "ref"), isolated_env_for(base))
    assert r.returncode == 0, r.stdout + r.stderr
    return base


def _popen(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


@pytest.mark.slow  # CI runs it (make test-slow): the default suite stays well under 15 min
def test_killed_trial_process_resumes_the_same_trial(tmp_path: Path, reference: Path,
                                                    isolated_env: dict[str, str]) -> None:
    proc = _popen(_args(tmp_path, "killtrial"), isolated_env)
    tune_dir = tmp_path / "runs" / "killtrial" / "sealed" / "ray" / "tune"
    out = kill_one_trial_once_checkpointed(proc, tune_dir, step=0.05)
    assert proc.returncode == 0, out
    trials, ref = _trials(tmp_path, "killtrial"), _trials(reference, "ref")
    assert max(t["attempts"] for t in trials) >= 2, trials  # the killed trial was retried …
    for t, r in zip(trials, ref, strict=True):  # … as the same trial, from its checkpoint
        assert (t["index"], t["params"], t["seed"]) == (r["index"], r["params"], r["seed"])
        assert t["score"] == pytest.approx(r["score"], abs=1e-9)
        assert not t["crashed"]
    assert _release(tmp_path, "killtrial") == _release(reference, "ref")
    assert [c.status for c in Ledger(tmp_path / "ledger.sqlite").charges()] == ["committed"]


@pytest.mark.slow  # CI runs it (make test-slow); ~35 s of Ray restarts
def test_sigkilled_driver_resumes_the_same_draw(tmp_path: Path, reference: Path,
                                                isolated_env: dict[str, str]) -> None:
    proc = _popen(_args(tmp_path, "killdriver"), isolated_env)
    state = tmp_path / "runs" / "killdriver" / "sealed" / "state.json"
    try:
        wait_until(lambda: state.exists() and json.loads(state.read_text()).get("status") == "running")
        wait_until(lambda: bool(trial_processes(proc.pid)))
        time.sleep(2.0)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver and the Ray it started: a crashed machine
        proc.wait(timeout=60)
    ledger = Ledger(tmp_path / "ledger.sqlite")
    [charge] = ledger.charges()
    assert charge.status == "reserved"  # the spend survived the crash
    draw_before = (tmp_path / "runs" / "killdriver" / "sealed" / "draw.json").read_text()

    r = run_cli(_args(tmp_path, "killdriver", "--resume"), isolated_env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "runs" / "killdriver" / "sealed" / "draw.json").read_text() == draw_before
    assert [c.status for c in ledger.charges()] == ["committed"]  # no second charge
    assert _release(tmp_path, "killdriver") == _release(reference, "ref")
    cert = json.loads((tmp_path / "runs" / "killdriver" / "release" / "certificate.json").read_text())
    assert cert["epsilon"] == pytest.approx(ledger.charges()[0].epsilon, rel=1e-9)

    again = run_cli(_args(tmp_path, "killdriver", "--resume"), isolated_env)
    assert again.returncode == 2 and "already finished" in again.stderr


@pytest.mark.slow  # CI runs it (make test-slow); ~35 s of Ray restarts
def test_interrupted_search_never_releases_and_resumes_the_rest(tmp_path: Path, reference: Path,
                                                              isolated_env: dict[str, str]) -> None:
    """Issue items 15 and 2: Ctrl-C mid-search releases nothing (a release from the trials that happened to
    finish would cap K), keeps the charge, seals what finished and says how to continue; --resume with a flag
    that changes what runs is refused (exit 2, nothing charged); the same flags finish the same draw."""
    proc = _popen(_args(tmp_path, "intr"), isolated_env)
    tune_dir = tmp_path / "runs" / "intr" / "sealed" / "ray" / "tune"
    out = interrupt_when(proc, lambda: any(tune_dir.glob("*/checkpoint_*")))
    assert proc.returncode == 130, out
    assert "interrupted; nothing was released" in out and "--resume" in out and "Traceback" not in out
    run = tmp_path / "runs" / "intr"
    assert not (run / "release" / "best_config.yaml").exists()
    assert json.loads((run / "sealed" / "state.json").read_text())["status"] == "interrupted"
    ledger = Ledger(tmp_path / "ledger.sqlite")
    assert [c.status for c in ledger.charges()] == ["reserved"]  # the spend counts
    changed = _args(tmp_path, "intr", "--resume")
    changed[changed.index("--epochs") + 1] = str(2 * int(EPOCHS))  # costs more than was charged
    r = run_cli(changed, isolated_env)
    assert r.returncode == 2 and "--resume" in r.stderr and "fixed" in r.stderr, r.stderr
    assert [c.status for c in ledger.charges()] == ["reserved"]
    r = run_cli(_args(tmp_path, "intr", "--resume"), isolated_env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "resuming; charged at reserve time" in r.stdout
    assert [c.status for c in ledger.charges()] == ["committed"]
    trials, ref = _trials(tmp_path, "intr"), _trials(reference, "ref")
    assert [(t["index"], t["params"], t["seed"]) for t in trials] == [(t["index"], t["params"], t["seed"]) for t in ref]
    assert _release(tmp_path, "intr") == _release(reference, "ref")


@pytest.mark.integration  # a whole search end to end (make test-slow; CI runs it)
def test_diverging_trials_count_with_minus_infinity(tmp_path: Path, isolated_env: dict[str, str]) -> None:
    space = yaml.safe_load((ROOT / SPACE).read_text())
    space["space"]["learning_rate"] = {"type": "float", "low": 1e30, "high": 1e32, "log": True}
    space["default"]["learning_rate"] = 1e30
    f = tmp_path / "diverge.yaml"
    f.write_text(yaml.safe_dump(space))
    args = _args(tmp_path, "div")
    args[args.index("--space") + 1] = str(f)
    args[args.index("--epochs") + 1] = "2"
    r = run_cli(args, isolated_env)
    assert r.returncode == 0, r.stdout + r.stderr
    trials = _trials(tmp_path, "div")
    assert trials and all(t["diverged"] and t["score"] == -math.inf and t["attempts"] == 1 for t in trials)
    assert _release(tmp_path, "div")["score"] is None
