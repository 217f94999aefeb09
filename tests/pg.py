"""A real PostgreSQL server for the tests and the contention benchmark: ``initdb`` on a temp dir, ``pg_ctl`` on a
loopback port, the socket in the temp dir, stopped at the end. The superuser ``postgres`` has a random password
(scram-sha-256 over TCP), given to clients through a ``PGPASSFILE``, as PostgreSQL users do.

Run as root (CI, the dev machine), the server runs as the ``postgres`` system user. Binaries: ``$PG_BIN``, else
Debian's ``/usr/lib/postgresql/<version>/bin``, else the PATH. Missing binaries skip the PostgreSQL tests only
outside CI (``CI`` unset); under ``CI=true`` they fail loudly."""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

__all__ = ["PgServer", "pg_bin", "pg_server"]


def pg_bin() -> Path | None:
    given = os.environ.get("PG_BIN")
    if given and (Path(given) / "pg_ctl").exists():
        return Path(given)
    for d in sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=lambda p: -int(p.parent.name) if
                    p.parent.name.isdigit() else 0):
        if (d / "pg_ctl").exists() and (d / "initdb").exists():
            return d
    found = shutil.which("pg_ctl")
    return Path(found).parent if found else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PgServer:
    def __init__(self, bindir: Path, root: Path, port: int, password: str, as_user: str | None) -> None:
        self.bindir, self.root, self.port, self.password, self.as_user = bindir, root, port, password, as_user
        self.data, self.socket_dir, self.log = root / "data", root / "sock", root / "server.log"
        self.passfile = root / "pgpass"

    def url(self, dbname: str = "postgres", user: str = "postgres", password: str | None = None) -> str:
        auth = f"{user}:{password}" if password else user
        return f"postgresql://{auth}@127.0.0.1:{self.port}/{dbname}"

    def _run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        cmd = [str(self.bindir / args[0]), *args[1:]]
        if self.as_user:
            cmd = ["runuser", "-u", self.as_user, "--", *cmd]
        return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=120)

    def start(self) -> None:
        opts = (f"-p {self.port} -k {self.socket_dir} -c listen_addresses=127.0.0.1 -c max_connections=200 "
                "-c shared_buffers=32MB")
        r = self._run("pg_ctl", "-D", str(self.data), "-o", opts, "-l", str(self.log), "-w", "-t", "60", "start",
                      check=False)
        if r.returncode != 0:
            raise RuntimeError(f"pg_ctl start failed: {r.stdout}{r.stderr}\n{self.log.read_text() if self.log.exists() else ''}")

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop", check=False)

    def restart(self) -> None:
        self.stop("immediate")  # as a crash: no shutdown checkpoint, WAL recovery at start
        self.start()

    def sql(self, statement: str, dbname: str = "postgres") -> None:
        import psycopg

        with psycopg.connect(self.url(dbname), autocommit=True) as con:
            con.execute(statement)  # type: ignore[arg-type]

    def login(self, url: str, role: str, prefix: str = "") -> str:
        """A new login member of ``role``, its password in the pgpass file (as a user keeps it): ``url`` as it."""
        name = f"{prefix or role.split('_')[-1][:3]}_{secrets.token_hex(3)}"
        password = secrets.token_hex(8)
        self.sql(f"CREATE ROLE {name} LOGIN PASSWORD '{password}' IN ROLE {role}")
        with open(os.environ["PGPASSFILE"], "a") as f:
            f.write(f"127.0.0.1:{self.port}:*:{name}:{password}\n")
        return url.replace("postgresql://postgres@", f"postgresql://{name}@")

    def new_database(self, prefix: str = "t") -> str:
        name = f"{prefix}_{secrets.token_hex(6)}"
        self.sql(f'CREATE DATABASE "{name}"')
        return name

    def drop_database(self, name: str) -> None:
        with suppress(Exception):
            self.sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextmanager
def pg_server() -> Iterator[PgServer]:
    """Start a fresh server (yields it with ``PGPASSFILE`` set in this process's environment), always stop it."""
    bindir = pg_bin()
    if bindir is None:
        raise FileNotFoundError("PostgreSQL binaries (initdb, pg_ctl) not found: install postgresql (Debian: "
                                "apt-get install postgresql) or set PG_BIN")
    as_user = None
    if os.geteuid() == 0:  # postgres refuses to run as root
        import pwd

        try:
            pwd.getpwnam("postgres")
        except KeyError:
            raise FileNotFoundError("running as root and there is no 'postgres' system user to run the server") from None
        as_user = "postgres"
    root = Path(tempfile.mkdtemp(prefix="dptune-pg-"))
    password = secrets.token_hex(16)
    server = PgServer(bindir, root, _free_port(), password, as_user)
    old = os.environ.get("PGPASSFILE")
    try:
        server.socket_dir.mkdir()
        pwfile = root / "pw"
        pwfile.write_text(password + "\n")
        if as_user:
            shutil.chown(root, as_user)
            for p in (server.socket_dir, pwfile):
                shutil.chown(p, as_user)
        os.chmod(root, 0o755)
        server._run("initdb", "-D", str(server.data), "-U", "postgres", f"--pwfile={pwfile}", "--auth-local=trust",
                    "--auth-host=scram-sha-256", "-E", "UTF8", "--no-sync")
        pwfile.unlink()
        server.passfile.write_text(f"127.0.0.1:{server.port}:*:postgres:{password}\n")
        os.chmod(server.passfile, 0o600)
        os.environ["PGPASSFILE"] = str(server.passfile)
        t0 = time.monotonic()
        server.start()
        server.started_in = time.monotonic() - t0  # type: ignore[attr-defined]
        yield server
    finally:
        server.stop("fast") if server.data.exists() else None
        if old is None:
            os.environ.pop("PGPASSFILE", None)
        else:
            os.environ["PGPASSFILE"] = old
        shutil.rmtree(root, ignore_errors=True)
