"""A team's ledger on a PostgreSQL server (psycopg 3): every curator and machine charges one budget per dataset.

Concurrency: a writer locks the budget rows it charges (``SELECT … FOR UPDATE``, in key order) and reads the
charges after the lock, at READ COMMITTED: two reservations on one budget run one after the other, each seeing the
other's committed charge, so they can neither overspend nor be lost. Serialization failures and deadlocks roll back
and are retried (``Ledger._transact``). A reservation is committed (``synchronous_commit`` is forced on) before
``reserve`` returns.

Append-only, in the database: the trigger ``dptune_charges_append_only`` refuses deleting a charge and changing one
other than closing a reserved charge (status ``reserved`` → ``committed``/``aborted``, with its ``closed`` time);
``python -m dptune.cli.ledger setup-team`` creates the tables as their owner and the roles ``dptune_curator`` and
``dptune_admin`` (:mod:`dptune.ledger._pg_schema`: what each may do, the triggers that say so, the budgets'
change log); neither may DELETE, TRUNCATE or run DDL (drop or disable a trigger).
"""

from __future__ import annotations

import getpass
import math
import os
import time
from collections.abc import Callable
from typing import Any

from dptune.errors import ConfigError, python_m
from dptune.ledger._backend import DbCon, LedgerUnavailable
from dptune.ledger._keys import key_check, read_key, team_key_path, write_key
from dptune.ledger._location import LedgerLocation, canonical_url, scrub
from dptune.ledger._pg_schema import ADMIN_ROLE, CURATOR_ROLE, SCHEMA_VERSION, grant_roles, schema_sql

__all__ = ["PostgresBackend", "commit_wait", "connect_wait", "failure_kind", "ledger_id", "open_team", "patiently",
           "schema_version", "setup_missing", "upgrade"]

CONNECT_WAIT = 10.0  # seconds a connection before a charge waits for a server that does not answer
COMMIT_WAIT = 120.0  # seconds closing a charge waits (a restart or failover): DPTUNE_LEDGER_WAIT overrides it


def commit_wait() -> float:
    """How long closing a charge waits for the server: ``DPTUNE_LEDGER_WAIT`` seconds, else :data:`COMMIT_WAIT`."""
    given = os.environ.get("DPTUNE_LEDGER_WAIT", "")
    try:
        value = float(given) if given else COMMIT_WAIT
    except ValueError:
        raise ConfigError("DPTUNE_LEDGER_WAIT", f"{given!r} is not a number of seconds", "e.g. 300") from None
    if not (math.isfinite(value) and value >= 0):
        raise ConfigError("DPTUNE_LEDGER_WAIT", f"{given!r} is not a number of seconds >= 0", "e.g. 300")
    return value


def connect_wait() -> float:
    """How long any other connection waits for a server that does not answer: before a charge, failing fast."""
    return min(CONNECT_WAIT, commit_wait())


def patiently(ledger: Any, step: Callable[[], None]) -> None:
    """``step`` (an idempotent write: closing a charge) for up to :func:`commit_wait` seconds: each connection waits
    for a server that does not answer, and a connection lost midway is tried again; a refusal is raised at once."""
    ledger._wait = commit_wait()
    deadline = time.monotonic() + ledger._wait
    try:
        while True:
            try:
                step()
                return
            except LedgerUnavailable as e:
                if not e.retry or time.monotonic() >= deadline:
                    raise
                ledger._wait = max(0.0, deadline - time.monotonic())
                time.sleep(0.5)
    finally:
        ledger._wait = None


def failure_kind(e: BaseException) -> str:
    """The class of a connection failure: ``unreachable`` (no server answered, or it is starting or stopping: worth
    waiting for), ``login`` (authentication), ``limit`` (too many connections), ``ssl``, ``database`` (no such
    database), else ``other``. From the SQLSTATE where the server sent one, else libpq's own words."""
    state = getattr(e, "sqlstate", None) or ""
    text = str(e).lower()
    if state in ("28P01", "28000") or "password authentication failed" in text or "no password supplied" in text \
            or "authentication failed" in text:
        return "login"
    if state == "53300" or "too many connections" in text or "connection slots are reserved" in text:
        return "limit"
    if state == "3D000" or ("database" in text and "does not exist" in text):
        return "database"
    if state in ("57P03", "57P01", "57P02") or any(w in text for w in (
            "connection refused", "timeout expired", "could not connect", "no such file or directory",
            "server closed the connection unexpectedly", "connection reset", "the database system is starting up",
            "the database system is shutting down")):
        return "unreachable"
    if "ssl" in text:
        return "ssl"
    return "other"

_SETUP_LOCK = 0x64707475  # pg_advisory_xact_lock: two curators opening a new ledger at once set it up once


class PostgresBackend:
    lock = " FOR UPDATE"

    def __init__(self, location: LedgerLocation) -> None:
        self.location = location

    def connect(self, read_only: bool = False, wait: float | None = None) -> DbCon:
        """A connection; only while no server answers (refused, timed out, starting up) it is tried again, for up to
        ``wait`` seconds (default :func:`connect_wait`: short before a charge); a login, connection-limit, SSL or
        database refusal is raised at once, each as its own message (one attempt: one line in the server's log)."""
        import psycopg

        deadline = time.monotonic() + (connect_wait() if wait is None else wait)
        delay = 0.2
        while True:
            try:
                raw = psycopg.connect(self.location.target, autocommit=True, connect_timeout=10,
                                      application_name="dptune")
                break
            except psycopg.OperationalError as e:
                kind = failure_kind(e)
                if kind != "unreachable" or time.monotonic() + delay > deadline:
                    raise self.refused(kind, e) from None
                time.sleep(delay)
                delay = min(2 * delay, 5.0)
        raw.execute("SET synchronous_commit = on")  # durable at COMMIT, whatever the server's default
        raw.execute("SET lock_timeout = '120s'")
        return DbCon(raw, pyformat=True)

    @staticmethod
    def begin(con: DbCon, exclusive: bool) -> None:
        con.execute("BEGIN ISOLATION LEVEL READ COMMITTED")
        if exclusive:
            con.execute("SELECT pg_advisory_xact_lock(?)", (_SETUP_LOCK,))

    @staticmethod
    def retryable(e: BaseException) -> bool:
        import psycopg.errors as pe

        return isinstance(e, pe.SerializationFailure | pe.DeadlockDetected)

    def unavailable(self, e: BaseException) -> LedgerUnavailable | None:
        """An error inside a session that is the server's, not the ledger's logic: a connection lost mid-transaction
        (whether a COMMIT landed is unknown, so the caller is told so), or a read-only server (a standby, or a login
        whose transactions default to read-only)."""
        import psycopg

        if isinstance(e, psycopg.errors.ReadOnlySqlTransaction):
            return self.refused("read-only", e)
        if isinstance(e, psycopg.OperationalError) and not self.retryable(e):
            return LedgerUnavailable(
                "--ledger", f"the connection to the PostgreSQL ledger {self.location} (server {self.location.host}) "
                f"was lost ({self._first_line(e)}); a write in flight may or may not have been stored",
                f"check the server, then `{python_m('dptune.cli.ledger')} show --ledger {self.location}` lists every "
                "charge", retry=True)
        return None

    def refused(self, kind: str, e: BaseException) -> LedgerUnavailable:
        """The message for a failure of class ``kind`` (:func:`failure_kind`): what happened, naming the server and
        the login, and its fix. It says nothing of charges: the caller knows where its charge stands."""
        where = f"the PostgreSQL ledger {self.location} (server {self.location.host})"
        line = self._first_line(e)
        user = dict(self.location.params).get("user") or os.environ.get("PGUSER") or getpass.getuser()
        problem, fix = {
            "unreachable": (f"cannot reach {where}: {line}",
                            "start or reach the server (or fix the host and port); a search waits "
                            f"{connect_wait():g} s before its charge and {commit_wait():g} s to close it "
                            "(DPTUNE_LEDGER_WAIT sets the latter)"),
            "login": (f"{where} refused the login {user!r}: {line}",
                      "give libpq the right password for that login: a line in ~/.pgpass (0600) or the file "
                      "PGPASSFILE names, PGPASSWORD, or a service; or ask the ledger's administrator for a login"),
            "limit": (f"{where} is at its connection limit: {line}",
                      "try again when other sessions have ended, or raise the server's max_connections (or this "
                      "role's CONNECTION LIMIT)"),
            "ssl": (f"{where} refused the connection's SSL mode: {line}",
                    "set sslmode in the URL to one the server offers (sslmode=require for a server with SSL, "
                    "sslmode=disable for one without; sslrootcert= names the CA for verify-full)"),
            "database": (f"{where}: {line}",
                         f"fix the database name, or create it and run `{python_m('dptune.cli.ledger')} setup-team`"),
            "read-only": (f"{where} accepts no writes: {line}",
                          "point --ledger at the primary (add target_session_attrs=read-write to the URL, or name "
                          "the primary's host)"),
        }.get(kind, (f"cannot use {where}: {line}", "check the server and the URL"))
        return LedgerUnavailable("--ledger", problem, fix, retry=kind == "unreachable")

    def _first_line(self, e: BaseException) -> str:
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        return scrub(" ".join(lines[:2])[:300], self.location.target) or type(e).__name__

    # --- schema ----------------------------------------------------------------------------------------

    @staticmethod
    def set_up(con: DbCon) -> bool:
        (tables,) = con.execute("SELECT to_regclass('charges') IS NOT NULL AND to_regclass('budgets') IS NOT NULL "
                                "AND to_regclass('dptune_meta') IS NOT NULL").fetchone()
        return bool(tables)

    def create(self, con: DbCon) -> None:
        """Tables, index and trigger (inside the caller's transaction, under the set-up lock)."""
        import psycopg

        try:
            con.execute(schema_sql(con))
            con.execute("INSERT INTO dptune_meta (name, value) VALUES ('schema_version', ?) ON CONFLICT (name) DO "
                        "UPDATE SET value = EXCLUDED.value", (str(SCHEMA_VERSION),))
        except psycopg.errors.InsufficientPrivilege:
            raise ConfigError("--ledger", f"the team ledger {self.location} is not set up, and this login may not "
                              "create its tables",
                              f"ask its administrator to run `{python_m('dptune.cli.ledger')} setup-team --ledger "
                              f"{self.location}` (as the database's owner)") from None

    @staticmethod
    def meta(con: DbCon, name: str) -> str | None:
        row = con.execute("SELECT value FROM dptune_meta WHERE name=?", (name,)).fetchone()
        return None if row is None else str(row[0])

    @staticmethod
    def set_meta(con: DbCon, name: str, value: str) -> None:
        con.execute("INSERT INTO dptune_meta (name, value) VALUES (?, ?) ON CONFLICT (name) DO NOTHING", (name, value))


def setup_missing(location: LedgerLocation, role: str = CURATOR_ROLE) -> list[str]:
    """What the login ``location`` connects as lacks to set a team ledger up (tables in the current schema, the
    curator and admin roles, their grants), as the statements an administrator would run: ``setup-team``'s (and
    ``upgrade``'s) first step, before anything is created."""
    con = PostgresBackend(location).connect()
    try:
        (login, schema, can_create, super_, createrole, tables_owner) = con.execute(
            "SELECT session_user, current_schema(), has_schema_privilege(current_schema(), 'CREATE'), "
            "r.rolsuper, r.rolcreaterole, "
            "(SELECT tableowner FROM pg_tables WHERE tablename = 'charges' AND schemaname = current_schema()) "
            "FROM pg_roles r WHERE r.rolname = session_user").fetchone()
        absent = [r for r in (role, ADMIN_ROLE)
                  if not con.execute("SELECT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = ?)", (r,)).fetchone()[0]]
    finally:
        con.close()
    missing = []
    if tables_owner is None and not can_create:
        missing.append(f"GRANT CREATE ON SCHEMA {schema} TO {login};")
    if tables_owner is not None and tables_owner != login and not super_:
        missing.append(f"run setup-team as {tables_owner}, the owner of the ledger's tables")
    if absent and not (super_ or createrole):
        missing.append(" ".join(f"CREATE ROLE {r} NOLOGIN;" for r in absent) + f"  (or ALTER ROLE {login} CREATEROLE;)")
    return missing


def resolved(location: LedgerLocation, con: DbCon) -> LedgerLocation:
    """``location`` as shown once libpq has applied its defaults (``PGHOST``, ``PGPORT``, ``PGUSER``, ``PGDATABASE``,
    the socket directory, the login name): the server it reached, not ``postgresql:///``. A service stays a service
    (it may carry sslmode and more); what connects stays what was given."""
    given = dict(location.params)
    if "service" in given or all(given.get(k) for k in ("host", "port", "user", "dbname")):
        return location
    info = con.raw.info
    found = {"host": str(info.host), "port": str(info.port), "user": str(info.user), "dbname": str(info.dbname)}
    params = {**{k: v for k, v in found.items() if v}, **{k: v for k, v in given.items() if v}}
    return LedgerLocation("postgresql", canonical_url(params), location.target, tuple(sorted(params.items())))


def schema_version(con: DbCon) -> int:
    """The ledger's schema version (1: written before the version row existed)."""
    value = PostgresBackend.meta(con, "schema_version")
    return int(value) if value else 1


def upgrade(ledger: Any) -> tuple[int, int]:
    """The team ledger's schema brought to :data:`SCHEMA_VERSION` in one transaction, as its owner (``ledger
    upgrade``): (version before, version after). Charges made before keep a NULL login (history says so). The roles
    that curate it (those granted INSERT on charges) get this version's grants, and the admin role beside them:
    a curator keeps searching (opening budgets, charging, closing its own charges) but no longer changes a budget."""
    backend: PostgresBackend = ledger._backend
    con = backend.connect()
    try:
        before = schema_version(con)
        curators = _curator_roles(con)
        missing = setup_missing(backend.location, curators[0]) if curators else []
        if missing:
            raise ConfigError("--ledger", f"this login may not upgrade the team ledger {backend.location}: nothing "
                              "was changed", "ask the database's administrator to run: " + " ".join(missing))
        def grants() -> None:
            for role in curators:
                grant_roles(con, role)

        _create(backend, con, grants)
        return before, schema_version(con)
    finally:
        con.close()


def _curator_roles(con: DbCon) -> list[str]:
    """The roles granted INSERT on ``charges`` (``setup-team``'s curator role), but its owner."""
    rows = con.execute("SELECT DISTINCT g.rolname FROM pg_class c CROSS JOIN LATERAL aclexplode(c.relacl) a "
                       "JOIN pg_roles g ON g.oid = a.grantee WHERE c.oid = to_regclass('charges') AND "
                       "a.privilege_type = 'INSERT' AND a.grantee <> c.relowner AND g.rolname <> ? ORDER BY 1",
                       (ADMIN_ROLE,)).fetchall()
    return [str(r[0]) for r in rows]


def _create(backend: PostgresBackend, con: DbCon, then: Callable[[], None] | None = None) -> None:
    """The schema (tables, triggers, version), and ``then``, in one transaction under the set-up lock: all of it
    or none."""
    backend.begin(con, exclusive=True)
    try:
        backend.create(con)
        if then is not None:
            then()
    except BaseException:
        con.execute("ROLLBACK")
        raise
    con.execute("COMMIT")


def ledger_id(con: DbCon) -> str | None:
    """The team ledger's identity: a random id the database holds (``dptune_meta``), written once by its first
    opener (or ``setup-team``); it travels with ``pg_dump``/``pg_restore``, so a restored ledger is the same one."""
    return PostgresBackend.meta(con, "ledger_id")


def open_team(ledger: Any) -> None:
    """A team ledger's tables (created by their first opener if this login may), its id (``ledger.ledger_id``, and
    the key file named by it), then its key's check value: a new ledger takes its first curator's key
    (``setup-team`` writes one first)."""
    import secrets

    backend: PostgresBackend = ledger._backend
    con = backend.connect()
    try:
        if not backend.set_up(con):
            if ledger.read_only:
                return  # nothing to read, and a reader creates nothing
            _create(backend, con)
        if ledger_id(con) is None and not ledger.read_only:
            backend.set_meta(con, "ledger_id", secrets.token_hex(16))  # 128 bits; the first writer's stays
        ledger.ledger_id = ledger_id(con)
        ledger.key_path = team_key_path(ledger.location, ledger.ledger_id)
        ledger.location = backend.location = resolved(ledger.location, con)
        if ledger.read_only:
            return
        if backend.meta(con, "key_check") is None:
            ledger._no_charges_yet(con)
            key = read_key(ledger.key_path) if ledger.key_path.exists() else write_key(ledger.key_path)
            backend.set_meta(con, "key_check", key_check(key))
    finally:
        con.close()
