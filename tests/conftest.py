from __future__ import annotations

import contextlib
import functools
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def isolated_env(tmp_path: Path) -> dict[str, str]:
    """Environment for CLI subprocesses that start Ray: a private HOME (Ray 2.60 writes its auth token
    there), loopback only, small temp dirs."""
    return isolated_env_for(tmp_path)


def isolated_env_for(tmp_path: Path) -> dict[str, str]:
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_") and k != "DPTUNE_TEST_DRAW_SEED"}
    env.update(HOME=str(home), PYTHONUNBUFFERED="1", RAY_USAGE_STATS_ENABLED="0", OMP_NUM_THREADS="1")
    return env


def run_cli(args: list[str], env: dict[str, str], timeout: int = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=timeout)


def factory_search(tmp_path: Path, folder: Path, factory: str, kwargs: dict[str, Any],
                   clipping: str) -> tuple[subprocess.CompletedProcess[str], list[Any]]:
    """``dptune search`` of the digits space with a user's ``factory:`` model (importable from ``folder``) under
    ``clipping``, in a subprocess as a user runs it: the finished process and the charges its ledger holds."""
    import yaml

    space = yaml.safe_load((ROOT / "search_spaces" / "digits.yaml").read_text())
    space["model"] = {"factory": factory, "kwargs": kwargs}
    space["fixed"]["clipping"] = clipping
    path = tmp_path / "user_model.yaml"
    path.write_text(yaml.safe_dump(space))
    env = isolated_env_for(tmp_path)
    env["PYTHONPATH"] = f"{folder}:{ROOT}"
    ledger = tmp_path / "ledger.sqlite"
    res = run_cli(["-m", "dptune.search", "--space", str(path), "--ledger", str(ledger), "--budget-epsilon", "8",
                   "--runs-dir", str(tmp_path / "runs")], env)
    if not ledger.exists():
        return res, []
    from dptune.ledger import Ledger

    return res, list(Ledger(ledger).charges())


@contextlib.contextmanager
def importable_module(folder: Path, name: str, source: str) -> Iterator[Path]:
    """``source`` written as module ``name`` in ``folder`` and importable (``factory:<name>:…`` models) while inside;
    afterwards off sys.path and out of sys.modules."""
    (folder / f"{name}.py").write_text(source)
    sys.path.insert(0, str(folder))
    try:
        yield folder
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop(name, None)


def digits_seed_with_k(lo: int, hi: int) -> int:
    """A (NOT PRIVATE, test-only) draw seed for which the digits space's stopping rule draws lo <= K <= hi."""
    import numpy as np

    from dptune.accounting import rule_of
    from dptune.config import load_space

    p = load_space(ROOT / "search_spaces" / "digits.yaml").privacy
    rule = rule_of(p)
    return next(s for s in range(10_000) if lo <= rule.draw_k(np.random.default_rng([s, 0])) <= hi)


@pytest.fixture(scope="module")
def digits() -> Any:
    """The embedded digits data, default split (loaded once per test module)."""
    from dptune.config import DatasetSpec
    from dptune.data import load_dataset

    return load_dataset(DatasetSpec())


@pytest.fixture(scope="module")
def small(digits: Any) -> Any:
    """A fixed 20 % Poisson subsample of ``digits``: fast trials."""
    from dptune.data import poisson_subsample

    return poisson_subsample(digits, 0.2, seed=0)


def trial_processes(sid: int) -> list[int]:
    """Ray trial worker processes of the search started in session ``sid`` (``start_new_session=True``): never
    another search's or another user's on this host."""
    out = subprocess.run(["ps", "-eo", "pid,sid,args"], capture_output=True, text=True).stdout
    rows = [line.split(None, 2) for line in out.splitlines()[1:]]
    return [int(r[0]) for r in rows if len(r) == 3 and int(r[1]) == sid and "ImplicitFunc" in r[2]]


def wait_until(cond: Callable[[], bool], timeout: float = 120.0, step: float = 0.2) -> None:
    t0 = time.time()
    while not cond():
        if time.time() - t0 > timeout:
            raise AssertionError("timed out waiting")
        time.sleep(step)


def interrupt_when(proc: subprocess.Popen[str], ready: Callable[[], bool], timeout: float = 120.0) -> str:
    """Ctrl-C ``proc`` (a search started in its own session, output piped) once ``ready()``: its output. Killed
    outright (its whole session) if it is still running after that."""
    try:
        wait_until(ready, timeout, 0.05)
        os.kill(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return str(out)


def kill_one_trial_once_checkpointed(proc: subprocess.Popen[str], tune_dir: Path, *, timeout: float = 120.0,
                                     step: float = 0.2) -> str:
    """Once a trial of the search ``proc`` (its own session) has checkpointed under ``tune_dir``, SIGKILL one of
    its trial processes (an infrastructure failure); the search's output once it ends."""
    try:
        wait_until(lambda: any(tune_dir.glob("*/checkpoint_*")), timeout, step)
        victims = trial_processes(proc.pid)
        assert victims, "no trial process to kill"
        os.kill(victims[0], signal.SIGKILL)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return out


@pytest.fixture(scope="session")
def pg() -> Any:
    """One real PostgreSQL server for the session (tests/pg.py); each test takes a fresh database (``pg_url``).
    Without the binaries the PostgreSQL tests skip, except under CI, where they fail."""
    from tests.pg import pg_server

    try:
        cm = pg_server()
        server = cm.__enter__()
    except FileNotFoundError as e:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"CI must run the PostgreSQL ledger tests: {e}")
        pytest.skip(str(e))
    try:
        yield server
    finally:
        cm.__exit__(None, None, None)


@pytest.fixture
def pg_url(pg: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A fresh database on the session's server, as a password-free URL (the password is in PGPASSFILE); its
    curator key in the test's folder (``DPTUNE_LEDGER_KEY``), not in the real home."""
    monkeypatch.setenv("DPTUNE_LEDGER_KEY", str(tmp_path / "team.key"))
    name = pg.new_database()
    try:
        yield pg.url(name)
    finally:
        pg.drop_database(name)


@pytest.fixture(params=["sqlite", "postgresql"])
def ledger_at(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Where a ledger test's ledger lives: a SQLite file, or a fresh PostgreSQL database (the same test on both)."""
    if request.param == "sqlite":
        return str(tmp_path / "l.sqlite")
    return str(request.getfixturevalue("pg_url"))


# Markers from what a test uses (make test-fast = -m "not slow and not integration and not gpu and not ray and not train and not db
# and not subprocess";
# slow and integration are set by hand, tests/test_markers.py checks the commands leave nothing out): a CLI
# subprocess environment (isolated HOME for Ray's token) means Ray; the real digits data means a DP-SGD run.
_RAY_FIXTURES = frozenset({"isolated_env"})
# a whole search (the CLI or the API: Ray starts, or the command runs up to it) in the test or one of its fixtures
_RAY_CALLS = ("isolated_env_for(", "\"dptune.search\"", "dptune.search(", "factory_search(")
_TRAIN_FIXTURES = frozenset({"digits", "small"})
# a model's gradients computed (the clipping guard, an engine's step, the CLI's training): as slow as training
_TRAIN_CALLS = ("run_trial(", "run_final(", "dptune.train", "run_group(", "validate_model(", "make_engine(",
                "guarded_clipping(", "train_main(")
# a real PostgreSQL server (tests/pg.py starts one per session: initdb, pg_ctl)
_DB_FIXTURES = frozenset({"pg", "pg_url"})
# a fresh interpreter (a subprocess or a spawned process: seconds of imports each), directly or through a module's
# helper
_SUBPROCESS_CALLS = ("subprocess.", "sys.executable", "run_cli(", "get_context(\"spawn\")", "factory_search(")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        source = _source(item)
        if names & _RAY_FIXTURES or any(s in source for s in _RAY_CALLS):
            item.add_marker(pytest.mark.ray)
        if names & _TRAIN_FIXTURES or any(s in source for s in _TRAIN_CALLS):
            item.add_marker(pytest.mark.train)
        if any(s in source for s in _SUBPROCESS_CALLS + _spawning_helpers(getattr(item, "module", None))):
            item.add_marker(pytest.mark.subprocess)
        callspec = getattr(item, "callspec", None)
        if names & _DB_FIXTURES or (callspec is not None and callspec.params.get("ledger_at") == "postgresql"):
            item.add_marker(pytest.mark.db)


@functools.cache
def _spawning_helpers(module: Any) -> tuple[str, ...]:
    """Calls (``name(``) of the module's own functions that start a subprocess."""
    import inspect

    out = []
    for name, obj in vars(module or object()).items():
        if inspect.isfunction(obj) and obj.__module__ == getattr(module, "__name__", None):
            try:
                src = inspect.getsource(obj)
            except (OSError, TypeError):
                continue
            if any(s in src for s in _SUBPROCESS_CALLS):
                out.append(f"{name}(")
    return tuple(out)


def _source(item: pytest.Item) -> str:
    """The test's source and that of every fixture it uses (a module fixture running a whole search is the test's
    cost too)."""
    import inspect

    fns = [getattr(item, "function", None)]
    info = getattr(item, "_fixtureinfo", None)
    for defs in (info.name2fixturedefs.values() if info is not None else ()):
        fns.extend(d.func for d in defs if not d.func.__module__.startswith("_pytest"))
    out = []
    for fn in fns:
        try:
            out.append(inspect.getsource(fn) if fn is not None else "")
        except (OSError, TypeError):
            continue
    return "\n".join(out)


@pytest.hookimpl(trylast=True)  # after the durations table: the run's last lines
def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """The run's last lines say what it skipped and why (issue 58): a user's ``make test`` without PostgreSQL or
    Chromium (which ``.ci/run`` installs) passes, and says which tests did not run and what to install for them."""
    reasons: dict[str, int] = {}
    for report in terminalreporter.stats.get("skipped", []):
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
        reason = reason.removeprefix("Skipped: ").strip().splitlines()[0] if reason.strip() else "no reason given"
        reasons[reason] = reasons.get(reason, 0) + 1
    if not reasons:
        return
    total = sum(reasons.values())
    terminalreporter.write_sep("-", f"dptune: {total} test{'s' if total != 1 else ''} skipped, and why")
    for reason, count in sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0])):
        terminalreporter.write_line(f"{count:4d}  {reason[:200]}")
