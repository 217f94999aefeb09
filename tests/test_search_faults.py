"""Faults around a charged search (issue 22, items 16-20): every failure after the reservation keeps the charge,
says where it stands and how to resume; resume works from the default relative runs directory and when Tune's
own state is unreadable; library log lines name no trial by its index in the draw."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from dptune.ledger import Ledger
from tests.conftest import (
    ROOT,
    digits_seed_with_k,
    free_port,
    interrupt_when,
    kill_one_trial_once_checkpointed,
    wait_until,
)

pytestmark = pytest.mark.ray

SPACE = str(ROOT / "search_spaces" / "digits.yaml")


def _env(isolated_env: dict[str, str]) -> dict[str, str]:
    return {**isolated_env, "PYTHONPATH": str(ROOT)}


def _args(name: str, *extra: str) -> list[str]:
    """A search from the default (relative) runs directory: no --runs-dir; a relative --ledger."""
    return ["-m", "dptune.search", "--space", SPACE, "--name", name, "--ledger", "ledger.sqlite",
            "--budget-epsilon", "100", "--num-cpus", "2", "--dashboard-port", str(free_port()), "--epochs", "6",
            "--seed", str(digits_seed_with_k(2, 3)), "--checkpoint-every", "1", *extra]


def _run(cwd: Path, args: list[str], env: dict[str, str], timeout: int = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)


def _interrupted(cwd: Path, name: str, env: dict[str, str]) -> str:
    """Start a search in ``cwd`` and Ctrl-C it once a trial has checkpointed; returns its output."""
    proc = subprocess.Popen([sys.executable, *_args(name)], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    tune_dir = cwd / "runs" / name / "sealed" / "ray" / "tune"
    out = interrupt_when(proc, lambda: any(tune_dir.glob("*/checkpoint_*")), 180.0)
    assert proc.returncode == 130, out
    assert [c.status for c in Ledger(cwd / "ledger.sqlite").charges()] == ["reserved"]
    return out


def _finished_the_draw(cwd: Path, name: str) -> None:
    run = cwd / "runs" / name
    draw = json.loads((run / "sealed" / "draw.json").read_text())
    trials = sorted(pq.read_table(run / "sealed" / "trials.parquet").to_pylist(), key=lambda t: t["index"])
    assert [(t["index"], t["seed"]) for t in trials] == [(t["index"], str(t["seed"])) for t in draw["trials"]]
    assert (run / "release" / "certificate.json").is_file()
    assert [c.status for c in Ledger(cwd / "ledger.sqlite").charges()] == ["committed"]


@pytest.mark.slow  # CI runs it (make test-slow): the default suite stays well under 15 min
def test_resume_after_ctrl_c_from_the_default_relative_runs_dir_cli(tmp_path: Path,
                                                                    isolated_env: dict[str, str]) -> None:
    """Item 20: the very command the interrupt prints works with the default, relative runs directory."""
    env = _env(isolated_env)
    out = _interrupted(tmp_path, "rel", env)
    assert "--resume" in out
    r = _run(tmp_path, _args("rel", "--resume"), env)
    assert r.returncode == 0, r.stdout + r.stderr
    _finished_the_draw(tmp_path, "rel")


@pytest.mark.slow  # CI runs it (make test-slow); ~35 s of Ray restarts
def test_resume_after_ctrl_c_from_the_default_relative_runs_dir_api(tmp_path: Path,
                                                                    isolated_env: dict[str, str]) -> None:
    """Item 20: ``dptune.search(..., resume=True)`` with the default ``runs_dir``. Issue 26 part 5: an interrupted
    API search raised a bare "interrupted"; its exception now names the run, where the charge stands and the
    exact call that continues it — which, run as printed, finishes the draw."""
    env = _env(isolated_env)
    seed = digits_seed_with_k(2, 3)
    code = (f"import dptune; dptune.search({SPACE!r}, ledger='ledger.sqlite', budget_epsilon=100, name='relapi', "
            f"epochs=6, num_cpus=2, seed={seed})")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    tune_dir = tmp_path / "runs" / "relapi" / "sealed" / "ray" / "tune"
    try:
        wait_until(lambda: any(tune_dir.glob("trial_*/")), 180.0, 0.05)  # a trial started (no checkpoints here)
        os.kill(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1 and [c.status for c in Ledger(tmp_path / "ledger.sqlite").charges()] == ["reserved"]
    last = err.strip().splitlines()[-1]
    assert last.startswith("dptune.tuning.failures.SearchStopped: search 'relapi' was interrupted. "), err
    charged = float(re.search(r"charged to the ledger before any trial: epsilon = ([0-9.]+)", out)[1])  # type: ignore[index]
    assert (f"the charge of epsilon = {charged:.4f} in {(tmp_path / 'ledger.sqlite').resolve()} stays reserved" in last
            and "Nothing was released" in last), last
    call = last.split("Continue with: ", 1)[1]
    assert call == (f"dptune.search({SPACE!r}, name='relapi', resume=True, ledger='ledger.sqlite', epochs=6, "
                    f"num_cpus=2, seed={seed})"), call
    r = _run(tmp_path, ["-c", f"import dptune; {call}"], env)
    assert r.returncode == 0, r.stdout + r.stderr
    _finished_the_draw(tmp_path, "relapi")


@pytest.mark.slow  # CI runs it (make test-slow): the default suite stays well under 15 min
def test_a_lost_worker_prints_one_fixed_line_and_no_trial_index(tmp_path: Path, isolated_env: dict[str, str]) -> None:
    """Item 16: Ray Tune's ERROR lines (``Trial task failed for trial dptune_trial_77dbd_00001``) named trials by
    their index in the sealed draw. Now Ray's and Tune's log records go to sealed/logs/ray.log, trials have
    random names, and the terminal gets one fixed line."""
    env = _env(isolated_env)
    proc = subprocess.Popen([sys.executable, *_args("lost")], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    run = tmp_path / "runs" / "lost"
    out = kill_one_trial_once_checkpointed(proc, run / "sealed" / "ray" / "tune", timeout=180.0, step=0.05)
    assert proc.returncode == 0, out
    assert out.count("a worker was lost; the trial was retried as the same trial") == 1, out
    assert "Trial task failed" not in out and "dptune_trial" not in out and "_0000" not in out, out
    assert "Trial task failed" in (run / "sealed" / "logs" / "ray.log").read_text()
    trial_dirs = [p.name for p in (run / "sealed" / "ray" / "tune").iterdir() if p.is_dir()]
    assert trial_dirs and all(re.fullmatch(r"trial_[0-9a-f]{12}", n) for n in trial_dirs), trial_dirs
    trials = pq.read_table(run / "sealed" / "trials.parquet").to_pylist()  # retried from its checkpoint
    assert max(t["attempts"] for t in trials) >= 2 and not any(t["crashed"] for t in trials), trials


# a model factory that builds on the driver (checked before the charge) and fails on every Ray worker, as a
# missing library or driver on the nodes would: a failure that does not depend on the data
BROKEN_NET = '''
import ray
from torch import nn


def net(num_classes, input_shape, groups, width=8):
    if ray.is_initialized() and ray.get_runtime_context().worker.mode == ray.WORKER_MODE:
        raise RuntimeError("the model factory cannot run on this node")
    c, h, w = input_shape
    return nn.Sequential(nn.Conv2d(c, width, 3, padding=1), nn.GroupNorm(groups, width), nn.Tanh(),
                         nn.Flatten(), nn.Linear(width * h * w, num_classes))
'''


@pytest.mark.slow  # CI runs it (make test-slow); ~35 s of Ray restarts
def test_a_factory_failing_on_the_workers_stops_with_the_charge_reserved_and_resumes(
        tmp_path: Path, isolated_env: dict[str, str]) -> None:
    """Item 17: every trial crashed on the workers, and the search said "no trial was drawn", exited 0 and
    released trial 0's config. An infrastructure failure is not a result: exit 1, nothing released, the charge
    reserved, the exact resume command printed, no claim about K; after the fix the command finishes the draw."""
    import yaml

    code = tmp_path / "code"
    code.mkdir()
    (code / "brokenmodels.py").write_text(BROKEN_NET)
    raw = yaml.safe_load(Path(SPACE).read_text())
    raw["model"] = {"factory": "brokenmodels:net", "kwargs": {"width": 8}}
    space = tmp_path / "broken.yaml"
    space.write_text(yaml.safe_dump(raw))
    env = {**_env(isolated_env), "PYTHONPATH": f"{ROOT}:{code}"}
    args = _args("broken", "--max-failures", "1")
    args[args.index("--space") + 1] = str(space)
    args[args.index("--epochs") + 1] = "2"
    r = _run(tmp_path, args, env)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "no trial was drawn" not in out and "Traceback" not in out and "score:" not in out, out
    assert "a worker was lost" not in out and "a trial raised an error" in out, out  # issue 40, item 11
    assert "not a result of the data" in r.stderr and "stays reserved" in r.stderr, r.stderr
    run = tmp_path / "runs" / "broken"
    assert not any((run / "release").iterdir())
    assert [c.status for c in Ledger(tmp_path / "ledger.sqlite").charges()] == ["reserved"]
    assert "the model factory cannot run on this node" in (run / "sealed" / "logs" / "trials.log").read_text()
    command = r.stderr.split("continue with: ", 1)[1].strip()
    assert command.startswith(f"{sys.executable} -m dptune.search ") and command.endswith(" --resume"), command

    (code / "brokenmodels.py").write_text(BROKEN_NET.replace("raise RuntimeError", "pass  #"))
    again = subprocess.run([sys.executable, *command.split()[1:]], capture_output=True, text=True, env=env,
                           cwd=tmp_path, timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    _finished_the_draw(tmp_path, "broken")
    trials = pq.read_table(run / "sealed" / "trials.parquet").to_pylist()
    assert all(t["steps"] > 0 and not t["crashed"] for t in trials), trials


@pytest.mark.slow  # CI runs it (make test-slow); ~35 s of Ray restarts
def test_resume_rebuilds_from_the_sealed_draw_when_tune_state_is_unreadable(tmp_path: Path,
                                                                          isolated_env: dict[str, str]) -> None:
    """Item 18: a full disk left Tune's experiment state half-written and every --resume died in Tuner.restore
    (EOFError), so the reserved charge could never be released. Resume runs the same trials (indices, seeds)
    from the sealed draw instead, under the same charge."""
    env = _env(isolated_env)
    _interrupted(tmp_path, "torn", env)
    tune_dir = tmp_path / "runs" / "torn" / "sealed" / "ray" / "tune"
    state_files = [p for p in tune_dir.iterdir() if p.is_file()]
    assert any(p.name == "tuner.pkl" for p in state_files), state_files
    for p in state_files:  # every top-level state file cut in half, as a full disk leaves them
        data = p.read_bytes()
        p.write_bytes(data[: len(data) // 2])
    r = _run(tmp_path, _args("torn", "--resume"), env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "continues from its sealed draw" in r.stdout, r.stdout
    _finished_the_draw(tmp_path, "torn")


@pytest.mark.slow  # CI runs it (make test-slow); ~35 s of Ray restarts
def test_a_killed_head_raylet_says_where_the_charge_stands_and_resumes(tmp_path: Path,
                                                                       isolated_env: dict[str, str]) -> None:
    """Item 19: a killed head raylet ended the search with exit 1 and no word from dptune (Ray's driver exits
    at once). Now: the charge's state and the exact resume command, no Ray banner; the command finishes the draw."""
    env = _env(isolated_env)
    proc = subprocess.Popen([sys.executable, *_args("raylet")], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    run = tmp_path / "runs" / "raylet"
    try:
        state = run / "sealed" / "state.json"  # Ray is up, no trial has finished: the search cannot end well
        wait_until(lambda: state.exists() and json.loads(state.read_text()).get("status") == "running", 180.0, 0.05)
        ps = subprocess.run(["ps", "-eo", "pid,sid,comm"], capture_output=True, text=True).stdout.splitlines()[1:]
        [raylet] = [int(p) for p, s, c in (line.split(None, 2) for line in ps) if int(s) == proc.pid and c == "raylet"]
        os.kill(raylet, signal.SIGKILL)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0, out + err
    assert "stays reserved" in err and "Traceback" not in err and "Raylet is terminated" not in out + err, err
    assert "lost objects" not in out + err, err  # issue 40, item 11: Ray's C++ line goes to sealed/logs/ray.log
    assert [c.status for c in Ledger(tmp_path / "ledger.sqlite").charges()] == ["reserved"]
    assert not (run / "release" / "best_config.yaml").exists()
    command = err.split("Continue with: ", 1)[1].strip()
    assert command.startswith(f"{sys.executable} -m dptune.search ") and command.endswith(" --resume"), command
    again = _run(tmp_path, command.split()[1:], env)
    assert again.returncode == 0, again.stdout + again.stderr
    _finished_the_draw(tmp_path, "raylet")


@pytest.mark.integration  # make test-slow (CI runs it): a whole search command, ~16 s
def test_an_unwritable_run_folder_after_the_reservation_says_where_the_charge_stands(
        tmp_path: Path, isolated_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Item 19: a run folder that cannot be written (as a full disk) gave a raw traceback, and the failure
    handler itself crashed writing driver.log. Now: exit 1, the charge's state and the exact resume command,
    whatever else fails; the command works once the folder can be written. K = 0: no Ray needed."""
    from dptune.config import load_space
    from dptune.tuning import driver
    from dptune.tuning.runner import SearchInterrupted

    monkeypatch.chdir(tmp_path)
    seed = str(digits_seed_with_k(0, 0))
    req = driver.SearchRequest(space=load_space(SPACE), run_dir=Path("runs") / "full", ledger=Path("ledger.sqlite"),
                               budget_epsilon=100, seed=int(seed))

    def interrupted(*args: object, **kwargs: object) -> object:
        raise SearchInterrupted([])

    with monkeypatch.context() as mp:  # a search stopped after its reservation, to resume below
        mp.setattr(driver, "_run_trials", interrupted)
        with pytest.raises(driver.SearchStopped):
            driver.run_search(req, say=lambda line: None)
    sealed = tmp_path / "runs" / "full" / "sealed"
    blockers = [sealed / ".trials.parquet.tmp", sealed / "logs" / "driver.log"]
    for b in blockers:  # the trials file cannot be written, nor the failure handler's log
        b.mkdir()
    args = ["-m", "dptune.search", "--space", SPACE, "--name", "full", "--ledger", "ledger.sqlite", "--seed", seed,
            "--resume"]
    r = _run(tmp_path, args, _env(isolated_env))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and "after the charge was reserved" in r.stderr, r.stderr
    assert "could not be written" in r.stderr and "stays reserved" in r.stderr, r.stderr
    assert [c.status for c in Ledger(tmp_path / "ledger.sqlite").charges()] == ["reserved"]
    command = r.stderr.split("continue with: ", 1)[1].strip()
    assert command == f"{sys.executable} -m dptune.search " + " ".join(args[2:]), command
    for b in blockers:
        b.rmdir()
    again = _run(tmp_path, command.split()[1:], _env(isolated_env))
    assert again.returncode == 0, again.stdout + again.stderr
    assert [c.status for c in Ledger(tmp_path / "ledger.sqlite").charges()] == ["committed"]


@pytest.fixture
def immutable() -> Iterator[Callable[[Path], None]]:
    """Make a folder read-only even for root (chattr +i; chmod does not stop root), undone afterwards."""
    folders: list[Path] = []

    def make(folder: Path) -> None:
        r = subprocess.run(["chattr", "+i", str(folder)], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"chattr +i unavailable here: {r.stderr.strip()}")
        folders.append(folder)

    yield make
    for f in folders:
        subprocess.run(["chattr", "-i", str(f)], check=False)


def test_ledger_show_reads_a_ledger_in_a_read_only_folder(tmp_path: Path, isolated_env: dict[str, str],
                                                          immutable: Callable[[Path], None]) -> None:
    """Item 19: `ledger show` could not read a ledger whose folder is read-only (SQLite's WAL needs to create
    files beside it): the curator could not even see where a failed search's charge stands."""
    import dp_accounting

    folder = tmp_path / "ro"
    folder.mkdir()
    ledger = Ledger(folder / "ledger.sqlite")
    ledger.set_budget("f" * 64, 10.0, 1e-5, label="digits")
    ledger.reserve("f" * 64, "digits-run", dp_accounting.GaussianDpEvent(5.0))
    immutable(folder)
    r = subprocess.run([sys.executable, "-m", "dptune.cli.ledger", "show", "--ledger", str(folder / "ledger.sqlite")],
                       capture_output=True, text=True, env=_env(isolated_env), cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "reserved" in r.stdout and "digits-run" in r.stdout, r.stdout


@pytest.mark.slow  # CI runs it (make test-slow); ~35 s of Ray restarts
def test_a_ledger_folder_turned_read_only_mid_search_keeps_the_charge_and_resumes(
        tmp_path: Path, isolated_env: dict[str, str], immutable: Callable[[Path], None]) -> None:
    """Item 19: a ledger folder that became read-only before the commit gave a raw traceback. Now: exit 1,
    nothing released (no half-written release), the charge read back as reserved, the exact resume command."""
    env = _env(isolated_env)
    (tmp_path / "led").mkdir()
    args = _args("roled")
    args[args.index("--ledger") + 1] = "led/ledger.sqlite"
    proc = subprocess.Popen([sys.executable, *args], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    state = tmp_path / "runs" / "roled" / "sealed" / "state.json"
    try:
        wait_until(lambda: state.exists() and json.loads(state.read_text()).get("status") == "running", 180.0, 0.05)
        immutable(tmp_path / "led")
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1, out + err
    assert "Traceback" not in err and "stays reserved" in err, err
    assert not any((tmp_path / "runs" / "roled" / "release").iterdir())
    command = err.split("continue with: ", 1)[1].strip()
    subprocess.run(["chattr", "-i", str(tmp_path / "led")], check=True)
    again = _run(tmp_path, command.split()[1:], env)
    assert again.returncode == 0, again.stdout + again.stderr
    assert [c.status for c in Ledger(tmp_path / "led" / "ledger.sqlite").charges()] == ["committed"]
