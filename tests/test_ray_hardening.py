"""What a search leaves where other local users or other hosts could reach it (issue 22, items 11-15): trial
work dirs, Ray's temp dir, token authentication, usage statistics, listening sockets."""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from dptune.ledger import Ledger
from tests.conftest import ROOT, digits_seed_with_k, free_port, run_cli

SPACE = "search_spaces/digits.yaml"


def _search_args(tmp_path: Path, name: str, *extra: str) -> list[str]:
    return ["-m", "dptune.search", "--space", SPACE, "--name", name, "--runs-dir", str(tmp_path / "runs"),
            "--ledger", str(tmp_path / "ledger.sqlite"), "--budget-epsilon", "30", "--num-cpus", "2",
            "--dashboard-port", str(free_port()), "--smoke-test", *extra]


@pytest.mark.integration  # a whole search end to end (make test-slow; CI runs it)
@pytest.mark.ray
def test_trial_work_dirs_with_their_secrets_are_not_left_in_tmp(tmp_path: Path,
                                                               isolated_env: dict[str, str]) -> None:
    """Item 13: a trial's work dir (seed, RNG states) lives under Ray's trial dir, inside the search's
    owner-only Ray temp dir, and is removed in a finally, --save-checkpoint included; never in $TMPDIR.
    Issue 26 part 5: RAY_AIR_NEW_OUTPUT=1 in the curator's environment made Tune print its table with the
    "Number of trials" (K) to the terminal; a search now runs Tune's old, silent output whatever it says."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**isolated_env, "TMPDIR": str(tmp), "RAY_AIR_NEW_OUTPUT": "1"}
    r = run_cli(_search_args(tmp_path, "work", "--seed", str(digits_seed_with_k(1, 2)), "--save-checkpoint",
                             "--checkpoint-every", "1"), env)
    assert r.returncode == 0, r.stdout + r.stderr
    # item 12: the mode is printed as verified after Ray started, not assumed
    assert "verified, the dashboard refused a request without the token (HTTP 401)" in r.stdout, r.stdout
    assert "Ray listens on loopback only" in r.stdout  # item 15: measured after start, printed
    assert "Number of trials" not in r.stdout + r.stderr and "Search algorithm" not in r.stdout
    assert (tmp_path / "runs" / "work" / "release" / "best_checkpoint.pt").is_file()
    left = [p for p in tmp.rglob("*") if p.name.startswith("dptune-trial-") or p.name == "trial.pt"]
    assert left == [], left


@pytest.mark.parametrize("mode", ["disabled", "DISABLED", "none"])
def test_ray_auth_mode_disabled_in_the_environment_is_refused_before_any_charge(
        tmp_path: Path, isolated_env: dict[str, str], mode: str) -> None:
    """Item 12: RAY_AUTH_MODE=disabled in the curator's shell used to turn token auth off while dptune printed
    that it was on; now: exit 2 naming RAY_AUTH_MODE, nothing charged, no run directory, Ray never started."""
    r = run_cli(_search_args(tmp_path, "noauth", "--seed", str(digits_seed_with_k(1, 2))),
                {**isolated_env, "RAY_AUTH_MODE": mode})
    assert r.returncode == 2, r.stdout + r.stderr
    assert "RAY_AUTH_MODE" in r.stderr and "token" in r.stderr
    assert "token authentication is on" not in r.stdout and "Ray dashboard" not in r.stdout
    assert not (tmp_path / "runs" / "noauth").exists()
    assert not (tmp_path / "ledger.sqlite").exists() or Ledger(tmp_path / "ledger.sqlite").charges() == []


def _reachable_by_others(path: Path) -> bool:
    """Another user (neither owner nor group) can reach ``path`` only if every directory above it lets
    others traverse (o+x)."""
    return all(p.stat().st_mode & stat.S_IXOTH for p in path.parents)


_SESSION = """
import sys
from dptune.tuning.options import RayOptions
from dptune.tuning.raysession import RaySession
import ray
s = RaySession(RayOptions(num_cpus=1, dashboard_port=int(sys.argv[1])))
s.__enter__()
print(s.parent, ray._private.worker._global_node.get_session_dir_path(), flush=True)
sys.stdin.readline()  # until the test closes stdin: then a normal exit
s.__exit__()
"""


def _session(env: dict[str, str]) -> tuple[subprocess.Popen[str], Path, Path]:
    """A search's Ray session in a process of its own: (process, dptune's parent dir, Ray's session dir)."""
    proc = subprocess.Popen([sys.executable, "-c", _SESSION, str(free_port())], cwd=ROOT, env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
    line = proc.stdout.readline().split()  # type: ignore[union-attr]
    assert len(line) == 2, line
    return proc, Path(line[0]), Path(line[1])


@pytest.mark.ray
def test_ray_temp_dir_is_unreachable_by_other_users_and_removed_after_a_kill(
        tmp_path: Path, isolated_env: dict[str, str]) -> None:
    """Item 11: Ray chmods its temp dir and session dirs 0777; they must sit below a 0700 parent that we own
    (checked from outside: the mode bits along the path), and a SIGKILLed search's is removed on the next start."""
    env = {**isolated_env, "PYTHONPATH": str(ROOT)}
    killed, stale, _ = _session(env)
    os.kill(killed.pid, signal.SIGKILL)  # the driver alone, as a SIGKILLed search: Ray's processes outlive it
    killed.wait(timeout=60)
    assert stale.is_dir() and any(stale.rglob("session_*")), stale
    assert _using(stale), "no Ray process outlived the driver: nothing for the next start to reap"

    proc, parent, session_dir = _session(env)
    try:
        assert not stale.exists()  # the killed search's session files, logs and sockets are gone
        # issue 40, item 11: ray::DashboardAgent, ray::RuntimeEnvAgent, … (alive 28 s later) were left running
        assert not _using(stale), _using(stale)
        assert session_dir.is_relative_to(parent)
        st = parent.stat()
        assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()
        assert stat.S_IMODE(session_dir.stat().st_mode) == 0o777  # Ray's chmod: why the parent must hold
        for p in (session_dir, session_dir / "logs", session_dir / "sockets"):
            assert p.exists() and not _reachable_by_others(p), p
    finally:
        proc.communicate("\n", timeout=120)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(killed.pid, signal.SIGKILL)
    assert proc.returncode == 0
    assert not parent.exists()


def _using(folder: Path) -> list[str]:
    """This user's live processes with an open file or their working directory below ``folder`` (as ps sees them:
    name and pid), read from /proc (a process's links survive the deletion of what they point to)."""
    out = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if entry.stat().st_uid != os.getuid() or (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            targets = [os.readlink(entry / "cwd"), *(os.readlink(fd) for fd in (entry / "fd").iterdir())]
            name = (entry / "comm").read_text().strip()
        except OSError:
            continue
        if any(t.startswith(f"{folder}/") for t in targets):
            out.append(f"{name} {entry.name}")
    return out


def _metrics(port: int) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, ""
    except Exception:  # not HTTP (a gRPC port)
        return 0, ""


@pytest.mark.ray
def test_a_local_search_listens_on_loopback_only_and_no_exporter_serves_trial_series(
        tmp_path: Path, isolated_env: dict[str, str]) -> None:
    """Item 15: Ray's Prometheus exporters answered GET /metrics on 0.0.0.0 without the token
    (``ray_actors{Name="ImplicitFunc"}``, ``ray_tasks``: K and per-trial timing). Measured from outside on the
    session's process tree: no port beyond loopback serves /metrics, none on loopback serves actor or task
    series; in fact nothing listens beyond loopback, and dptune's own check (printed after start) agrees."""
    import importlib

    from dptune.tuning.raysession import is_loopback, listening_beyond_loopback  # imports Ray (ships psutil)

    psutil = importlib.import_module("psutil")

    proc, _, _ = _session({**isolated_env, "PYTHONPATH": str(ROOT)})
    try:
        tree = {p.pid for p in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]}
        listening = [c for c in psutil.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN and c.pid in tree]
        assert listening
        for c in listening:
            status, body = _metrics(c.laddr.port)
            if not is_loopback(c.laddr.ip):
                assert status != 200 or "# TYPE" not in body, (c, body[:200])
            assert "ray_actors" not in body and "ray_tasks" not in body, (c, body[:200])
        # a local search's Ray node is on 127.0.0.1: nothing of it listens beyond loopback, as dptune reports
        beyond = [c for c in listening if not is_loopback(c.laddr.ip)]
        assert beyond == [] and listening_beyond_loopback(proc.pid) == [], beyond
    finally:
        proc.communicate("\n", timeout=120)


def test_the_dashboard_url_said_before_ray_starts_follows_rays_port_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 26 part 5: the URL is printed before Ray starts, so it is predicted by Ray's own rule for a local
    dashboard — the first port from its default on which the host binds — or taken from --dashboard-port."""
    import socket

    import ray._private.ray_constants as ray_constants

    from dptune.tuning.options import RayOptions
    from dptune.tuning.raysession import expected_dashboard_url

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setattr(ray_constants, "DEFAULT_DASHBOARD_PORT", port)
        url = expected_dashboard_url(RayOptions())
        assert url.startswith("http://127.0.0.1:") and int(url.rsplit(":", 1)[1]) > port, url
    assert expected_dashboard_url(RayOptions(dashboard_port=port)) == f"http://127.0.0.1:{port}"


_SECRET_SESSION = """
import os, sys
from dptune.tuning.options import RayOptions
from dptune.tuning.raysession import RaySession
import ray
s = RaySession(RayOptions(num_cpus=1, dashboard_port=int(sys.argv[1])))
s.__enter__()

@ray.remote
def trial():
    return os.getpid(), "PGPASSWORD" in os.environ

print(os.getpid(), *ray.get(trial.remote()), "PGPASSWORD" in os.environ, flush=True)
sys.stdin.readline()
s.__exit__()
"""


@pytest.mark.ray
def test_no_ray_process_holds_the_ledger_password(isolated_env: dict[str, str]) -> None:
    """Issue 59 item 5: PGPASSWORD (how a curator gives libpq the team ledger's password) stays in the driver, which
    needs it to charge and close; Ray's processes (GCS, raylet, dashboard, agents) and every trial worker start
    without it. Measured from /proc/<pid>/environ of every live process, and from inside a worker."""
    secret = "pw-" + os.urandom(8).hex()
    env = {**isolated_env, "PYTHONPATH": str(ROOT), "PGPASSWORD": secret}
    proc = subprocess.Popen([sys.executable, "-c", _SECRET_SESSION, str(free_port())], cwd=ROOT, env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
    try:
        driver, worker, worker_has, driver_has = proc.stdout.readline().split()  # type: ignore[union-attr]
        assert (worker_has, driver_has) == ("False", "True")  # the driver keeps it for the ledger
        holders = []
        for entry in Path("/proc").glob("[0-9]*"):
            with contextlib.suppress(OSError):
                if secret.encode() in (entry / "environ").read_bytes():
                    holders.append((entry.name, (entry / "cmdline").read_bytes().replace(b"\0", b" ")[:80]))
        assert [pid for pid, _ in holders] == [driver], holders
        assert int(worker) != int(driver)
    finally:
        proc.communicate("\n", timeout=120)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0
