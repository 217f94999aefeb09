"""Starting or joining Ray for a search, safely: token auth with an owner-only token, session files in an
owner-only temp dir, the dashboard on loopback, nothing printed that names trials.

Ray makes its temp dir and every session, log and socket dir in it mode 0777 (``try_make_directory_shared``),
whatever mode dptune gave it: any local user could read K from log sizes and put files beside Ray's sockets.
So Ray's temp dir is a child of a 0700 parent that dptune owns (``/tmp/dptune-ray-*``): Ray's chmod reaches
the child only, and no other user can traverse the parent. The parent names the driver process that owns
it; a parent whose driver is gone (a SIGKILLed search) is removed when the next search starts (or by the search's
watcher, at once), and the processes that still use it (Ray's agents outlive a killed driver) are ended first.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ray
import ray._private.ray_constants as ray_constants

from dptune.errors import ConfigError
from dptune.tuning.options import RayOptions, check_auth_mode, check_token_file

__all__ = ["RaySession", "expected_dashboard_url", "is_loopback", "listening_beyond_loopback", "private_ray_parent",
           "reap_processes_below", "remove_stale_ray_dirs"]

_PARENT_PREFIX = "dptune-ray-"
_OWNER = "owner"  # "<pid> <process start time>" of the driver that made the parent


def _start_time(pid: int) -> str | None:
    """The process's start time (clock ticks since boot, /proc/<pid>/stat field 22): with the pid it names
    one process, even after the pid is reused. None: no such process."""
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            return ""
        return ""  # alive; no /proc here
    return stat_line.rsplit(")", 1)[1].split()[19]


def private_ray_parent(root: str = "/tmp") -> Path:
    """A fresh 0700 directory owned by this process (mkdtemp), recorded as this driver's. Short: Ray's Unix
    socket paths below it must stay under ~107 bytes."""
    parent = Path(tempfile.mkdtemp(prefix=_PARENT_PREFIX, dir=root))
    (parent / _OWNER).write_text(f"{os.getpid()} {_start_time(os.getpid()) or ''}")
    return parent


def remove_stale_ray_dirs(root: str = "/tmp") -> list[Path]:
    """Remove the private Ray parents of this user whose driver is no longer running (a SIGKILLed search
    leaves its session files, logs and trial work dirs behind). Others' and live searches' are kept."""
    removed = []
    for parent in Path(root).glob(_PARENT_PREFIX + "*"):
        try:
            st = parent.lstat()
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            continue
        try:
            pid, _, started = (parent / _OWNER).read_text().partition(" ")
        except OSError:  # no owner record: a removal cut short (a dying Ray still writing), or one being made
            if time.time() - st.st_mtime > 60:
                shutil.rmtree(parent, ignore_errors=True)
                removed.append(parent)
            continue
        now = _start_time(int(pid)) if pid.isdigit() else None
        if now is None or (started and now and now != started.strip()):
            reap_processes_below(parent)
            shutil.rmtree(parent, ignore_errors=True)
            removed.append(parent)
    return removed


def reap_processes_below(folder: Path, grace: float = 3.0) -> list[int]:
    """End this user's processes that hold a file, their working directory or their command line below
    ``folder`` (a killed search's private Ray folder): Ray's agents outlive a SIGKILLed driver and rename
    themselves (``ray::DashboardAgent``), but keep their logs open there. SIGTERM, then SIGKILL after ``grace``
    seconds. Linux (/proc); elsewhere nothing is found. Returns the pids signalled."""
    import signal

    root = str(folder.resolve())
    mine = [p for p in _own_pids() if p != os.getpid() and _uses(p, root)]
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 0.0)):
        left = []
        for pid in mine:
            try:
                os.kill(pid, sig)
                left.append(pid)
            except OSError:  # gone already
                continue
        deadline = time.time() + wait
        while left and time.time() < deadline:
            time.sleep(0.05)
            left = [p for p in left if _start_time(p) is not None and not _zombie(p)]
        if not left:
            break
    return mine


def _own_pids() -> list[int]:
    uid = os.getuid()
    out = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if entry.stat().st_uid == uid:
                out.append(int(entry.name))
        except (OSError, ValueError):
            continue
    return out


def _uses(pid: int, root: str) -> bool:
    """Whether process ``pid`` has its working directory, an open file or its command line below ``root``."""
    base = Path(f"/proc/{pid}")
    try:
        links = [base / "cwd", *(base / "fd").iterdir()]
        if re.search(re.escape(root) + "(/|$|\0)", (base / "cmdline").read_bytes().decode(errors="replace")):
            return True
    except OSError:
        return False
    for link in links:
        try:
            target = os.readlink(link)
        except OSError:
            continue
        if target == root or target.startswith(root + "/"):
            return True
    return False


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return False


def _runtime_env(paths: tuple[str, ...], parent: Path) -> dict[str, Any] | None:
    """Ray ships package directories as py_modules; a single-file module goes in a working_dir of its own
    (py_modules takes directories and wheels only)."""
    if not paths:
        return None
    env: dict[str, Any] = {"py_modules": [p for p in paths if Path(p).is_dir()]}
    files = [p for p in paths if not Path(p).is_dir()]
    if files:
        folder = Path(tempfile.mkdtemp(prefix="code-", dir=parent))
        for f in files:
            shutil.copy(f, folder / Path(f).name)
        env["working_dir"] = str(folder)
    return {k: v for k, v in env.items() if v}


def _token_mode() -> None:
    """Ray reads RAY_AUTH_MODE into a cached config when it is first imported: a Ray imported before dptune
    set the mode (e.g. in a notebook) must re-read it, as Ray's own local start-up does."""
    from ray._raylet import AuthenticationMode, Config, get_authentication_mode  # type: ignore[attr-defined]

    check_auth_mode()
    os.environ["RAY_AUTH_MODE"] = "token"
    if get_authentication_mode() != AuthenticationMode.TOKEN:
        Config.initialize("")


def verify_token_auth(dashboard: str | None) -> str:
    """After Ray started: token authentication must really be on, whatever the environment said — this
    process's Ray runs in token mode and (for a Ray we started) its dashboard refuses a request without the
    token. Raises ConfigError otherwise; returns what was verified, in words."""
    import urllib.error
    import urllib.request

    from ray._raylet import AuthenticationMode, get_authentication_mode  # type: ignore[attr-defined]

    mode = get_authentication_mode()
    if mode != AuthenticationMode.TOKEN:
        raise ConfigError("RAY_AUTH_MODE", f"Ray runs with authentication mode {mode!r}, not token",
                          "unset RAY_AUTH_MODE (or set it to token) on every node and start again")
    if not dashboard:
        return "token authentication is on (Ray's mode: token)"
    try:
        with urllib.request.urlopen(f"{dashboard}/api/jobs/", timeout=10) as r:
            status = r.status
    except urllib.error.HTTPError as e:
        status = e.code
    except OSError:
        return "token authentication is on (Ray's mode: token; the dashboard did not answer a check)"
    if status not in (401, 403):
        raise ConfigError("RAY_AUTH_MODE", f"Ray's dashboard answered a request without the token (HTTP {status})",
                          "unset RAY_AUTH_MODE (or set it to token) and start again")
    return f"token authentication is on: verified, the dashboard refused a request without the token (HTTP {status})"


_CLUSTER_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
_SAVED: dict[str, Any] = {}


def _loopback_node(on: bool = True) -> None:
    """A local search's Ray node on 127.0.0.1: ray.init turns an explicit 127.0.0.1 into the host's address,
    but a node whose address is loopback (Ray's single-machine mode, as on macOS) binds its dashboard's and
    autoscaler's Prometheus exporters and its agents' gRPC to loopback. Child processes read the variable,
    this process Ray's constant (read when Ray was imported)."""
    if on:
        _SAVED.setdefault("env", os.environ.get(_CLUSTER_ENV))
        _SAVED.setdefault("constant", ray_constants.ENABLE_RAY_CLUSTER)
        os.environ[_CLUSTER_ENV] = "0"
        ray_constants.ENABLE_RAY_CLUSTER = False
    elif _SAVED:  # after the session: as before it (a later search in this process may join a cluster)
        env, constant = _SAVED.pop("env"), _SAVED.pop("constant")
        if env is None:
            os.environ.pop(_CLUSTER_ENV, None)
        else:
            os.environ[_CLUSTER_ENV] = str(env)
        ray_constants.ENABLE_RAY_CLUSTER = bool(constant)


def is_loopback(address: str) -> bool:
    """127.0.0.0/8, ::1, and IPv4-mapped loopback (``::ffff:127.0.0.1``, how gRPC reports its binds)."""
    import ipaddress

    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return bool(ip.is_loopback or (mapped is not None and mapped.is_loopback))


def listening_beyond_loopback(pid: int | None = None) -> list[str]:
    """What the Ray processes this process started (its descendants) listen on beyond loopback, measured
    from the kernel's socket table after start: ``name address:port`` ('*' = every interface)."""
    try:
        import psutil  # Ray ships it (ray/thirdparty_files, on sys.path once ray is imported)
    except ImportError:  # pragma: no cover
        return ["(unknown: psutil is not installed)"]
    root = psutil.Process(pid)
    procs = {p.pid: p for p in [root, *root.children(recursive=True)]}
    out = set()
    for c in psutil.net_connections(kind="inet"):
        if c.status != psutil.CONN_LISTEN or c.pid not in procs or is_loopback(c.laddr.ip):
            continue
        try:
            name = procs[c.pid].name().removeprefix("ray::")
        except psutil.Error:
            name = "?"
        host = "*" if c.laddr.ip in ("0.0.0.0", "::") else c.laddr.ip
        out.add(f"{name} {host}:{c.laddr.port}")
    return sorted(out)


def expected_dashboard_url(opts: RayOptions) -> str:
    """Where a local search's dashboard will listen, said before Ray starts: ``--dashboard-port``, else Ray's own
    rule — the first port from 8265 on which the dashboard host binds (Ray tries 50). Ray's own URL follows once
    it answers (it differs only if another process took the port meanwhile)."""
    import socket

    host = opts.dashboard_host
    port = opts.dashboard_port
    if port is None:
        first = ray_constants.DEFAULT_DASHBOARD_PORT
        port = first
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        for candidate in range(first, first + 51):
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the dashboard's server binds
                try:
                    s.bind((host, candidate))
                except OSError:
                    continue
            port = candidate
            break
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"



# libpq's secrets in the environment: the ledger needs them in the driver only. Ray's processes (GCS, raylet, the
# dashboard and its agents, every trial worker) take the environment ray.init runs in: without these, none holds one.
_LEDGER_SECRETS = ("PGPASSWORD", "PGSSLPASSWORD")


@contextlib.contextmanager
def _without_ledger_secrets() -> Iterator[None]:
    """While Ray starts, the environment without the ledger's password (put back for the driver afterwards)."""
    saved = {k: os.environ.pop(k) for k in _LEDGER_SECRETS if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)

class RaySession:
    """``with RaySession(opts) as dashboard_url:`` a local Ray (or the cluster at ``opts.address``)."""

    def __init__(self, opts: RayOptions) -> None:
        self.opts = opts
        self.parent: Path | None = None  # ours, 0700: Ray's temp dir and a single-file module's working_dir
        self.temp_dir: str | None = None
        self.dashboard: str | None = None
        self.auth = ""  # what was verified after start, in words (printed)
        self.exposed: list[str] = []  # "process address:port" of the Ray processes listening beyond loopback

    def __enter__(self) -> str | None:
        remove_stale_ray_dirs()
        self.parent = private_ray_parent()
        try:
            return self._start()
        except BaseException:
            self.__exit__()
            raise

    def _start(self) -> str | None:
        opts = self.opts
        assert self.parent is not None
        runtime_env = _runtime_env(opts.py_modules, self.parent)
        job_config = ray.job_config.JobConfig(metadata=opts.job_metadata, runtime_env=runtime_env)
        check_token_file(create=not opts.address)
        _token_mode()
        with _without_ledger_secrets():
            ctx = self._init(opts, job_config)
        for name in ("ray.tune", "ray.train", "ray.air"):  # their warnings can count trials
            logging.getLogger(name).setLevel(logging.ERROR)
        check_token_file(create=False)  # whatever Ray wrote must be owner-only too
        url = getattr(ctx, "dashboard_url", None)
        if url and not str(url).startswith("http"):
            url = "http://" + str(url)
        self.dashboard = url
        self.auth = verify_token_auth(url if not opts.address else None)
        self.exposed = [] if opts.address else listening_beyond_loopback()
        return url

    def _init(self, opts: RayOptions, job_config: Any) -> Any:
        assert self.parent is not None
        if opts.address:
            return ray.init(address=opts.address, log_to_driver=False, job_config=job_config,
                            configure_logging=True, logging_level=logging.WARNING)
        else:
            kwargs: dict[str, Any] = {}
            if opts.dashboard_port is not None:
                kwargs["dashboard_port"] = opts.dashboard_port
            # session logs, sockets, spilled objects and trial work dirs below the owner-only parent, not in
            # world-readable /tmp/ray (Ray makes this child 0777; the parent keeps others out)
            self.temp_dir = str(self.parent / "r")
            # Ray's Prometheus exporters answer GET /metrics without the token (actor and task counts: K and
            # per-trial timing) — the dashboard's on 0.0.0.0 unless the node's address is loopback, the
            # agent's always: no metrics collection, and a node on 127.0.0.1 (its own servers bind there
            # where Ray allows; the rest is listed after start)
            os.environ["RAY_enable_metrics_collection"] = "0"  # noqa: SIM112 (Ray reads this exact name)
            _loopback_node()
            # address="local": always a new private instance, never a Ray someone else advertised here; no
            # Ray Client server is started by a local ray.init
            ctx = ray.init(address="local", num_cpus=opts.num_cpus, num_gpus=opts.num_gpus, include_dashboard=True,
                           dashboard_host=opts.dashboard_host, log_to_driver=False, job_config=job_config,
                           logging_level=logging.WARNING, _temp_dir=self.temp_dir, **kwargs)
        return ctx

    def __exit__(self, *exc: object) -> None:
        if ray.is_initialized():
            ray.shutdown()
        if not self.opts.address:
            _loopback_node(on=False)
        if self.parent is not None:
            shutil.rmtree(self.parent, ignore_errors=True)
