"""``dptune ledger check``: whether this machine and login can charge a ledger, answered in about a second, before a
search reads any data. Each check is one line: what was found, and the fix where it fails."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from dptune.errors import ConfigError, python_m
from dptune.ledger._backend import LedgerUnavailable
from dptune.ledger._keys import key_fits, read_key
from dptune.ledger._location import LedgerLocation, ledger_location
from dptune.ledger._pg_schema import CURATOR_ROLE
from dptune.ledger._postgres import PostgresBackend, ledger_id

__all__ = ["Finding", "check"]


@dataclass(frozen=True)
class Finding:
    """One check: its name (reachable, login, role, ledger, key, writable), whether it passed, what was found."""

    name: str
    ok: bool
    said: str


def check(given: str | LedgerLocation | None) -> list[Finding]:
    """Every check of the ledger ``given`` (a path, a URL, None: the default), each a :class:`Finding`; nothing is
    written to the ledger or this machine (a missing key is reported, not made)."""
    where = ledger_location(given)
    return _team(where) if where.is_postgres else _file(where)


def _file(where: LedgerLocation) -> list[Finding]:
    path = where.path
    key = path.with_name(path.name + ".key")
    if not path.is_file():
        return [Finding("ledger", False, f"{path} does not exist (the first search creates it, with its key)")]
    writable = os.access(path, os.W_OK) and os.access(path.parent, os.W_OK)
    return [Finding("ledger", True, f"SQLite file {path}"),
            Finding("key", key.is_file(), f"{key}" if key.is_file() else f"{key} is missing: restore it from a backup"),
            Finding("writable", writable, "yes" if writable else f"{path} or its folder cannot be written by this user")]


def _team(where: LedgerLocation) -> list[Finding]:
    from dptune.ledger._keys import team_key_path

    backend = PostgresBackend(where)
    t0 = time.monotonic()
    try:
        con = backend.connect(wait=0.0)
    except LedgerUnavailable as e:
        return [Finding("reachable", False, f"{e.problem}; {e.fix}")]
    try:
        found = [Finding("reachable", True, f"server {where.host} answered in {time.monotonic() - t0:.2f} s")]
        login, version = con.execute("SELECT session_user, current_setting('server_version')").fetchone()
        found.append(Finding("login", True, f"{login} (PostgreSQL {version})"))
        if not backend.set_up(con):
            found.append(Finding("ledger", False, f"no dptune ledger in this database: `{python_m('dptune.cli.ledger')} "
                                                  f"setup-team --ledger {where}` (as its owner)"))
            return found
        (member, owner) = con.execute(
            "SELECT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = ?) AND pg_has_role(session_user, ?, 'MEMBER'), "
            "(SELECT tableowner FROM pg_tables WHERE tablename = 'charges' AND schemaname = current_schema()) "
            "= session_user", (CURATOR_ROLE, CURATOR_ROLE)).fetchone()
        role = "the tables' owner" if owner else (f"in {CURATOR_ROLE}" if member else f"not in {CURATOR_ROLE}")
        found.append(Finding("role", bool(owner or member), role if (owner or member) else
                             f"{role}: ask the ledger's owner to GRANT {CURATOR_ROLE} TO {login}"))
        if not (owner or member):
            return found  # this login may not read the ledger: nothing more to find
        lid = ledger_id(con)
        found.append(Finding("ledger", True, f"ledger id {lid or '(none yet: the next opener writes it)'}"))
        key_path = team_key_path(where, lid)
        check_value = backend.meta(con, "key_check")
        if not key_path.is_file():
            found.append(Finding("key", False, f"this machine has no key at {key_path}: get the team's key file from "
                                               "the curator who set the ledger up (or point DPTUNE_LEDGER_KEY at it)"))
        else:
            try:
                good = key_fits(check_value, read_key(key_path))
            except ConfigError:
                good = False
            found.append(Finding("key", good, f"{key_path}" if good else f"{key_path} is not this ledger's key"))
        (recovery, read_only) = con.execute("SELECT pg_is_in_recovery(), current_setting('default_transaction_read_only')"
                                            " = 'on'").fetchone()
        (insert,) = con.execute("SELECT has_table_privilege('charges', 'INSERT')").fetchone()
        writable = not recovery and not read_only and insert
        why = ("a standby (in recovery): point --ledger at the primary (target_session_attrs=read-write)" if recovery
               else "this login's transactions are read-only (default_transaction_read_only)" if read_only
               else f"no INSERT on charges: GRANT {CURATOR_ROLE} TO {login}" if not insert else "yes")
        found.append(Finding("writable", bool(writable), why))
        return found
    finally:
        con.close()
