"""``python -m dptune.cli.ledger migrate --ledger FILE --to postgresql://…``: a curator's SQLite ledger moved to the team's.

Budgets (their keys, public ids, labels, keyed record ids and content signatures), charges (their events, status,
times, tokens and row ids) and the curator key move as they are: record-id digests and certificates are keyed under
that key, so the team ledger takes the SQLite ledger's key (a team ledger keyed otherwise is refused: budgets keyed
under two keys could not recognise each other's data). The SQLite file is only read (``mode=ro``). One transaction;
a second run finds every budget and charge there and copies nothing; totals (composed) are compared after.
"""

from __future__ import annotations

import hmac
import sqlite3
from dataclasses import dataclass
from typing import Any

from dptune.errors import ConfigError, python_m
from dptune.ledger._keys import read_key, write_key
from dptune.ledger._location import LedgerLocation
from dptune.ledger._store import Ledger

__all__ = ["Migrated", "migrate"]

_BUDGET_COLS = ("fingerprint", "epsilon", "delta", "label", "created", "dataset_id", "digests", "records", "ids",
                "content")
_CHARGE_COLS = ("id", "fingerprint", "name", "event", "epsilon", "status", "created", "closed", "token",
                "event_sha256", "group_id")


@dataclass(frozen=True)
class Migrated:
    budgets: int  # copied now
    charges: int
    already: int  # budgets and charges found there (a second run: all of them)
    totals: dict[str, tuple[float, float]]  # dataset id -> (ε spent in the file, ε spent in the team ledger)


def _rows(path: str, table: str, cols: tuple[str, ...]) -> list[tuple[Any, ...]]:
    from pathlib import Path

    uri = Path(path).resolve().as_uri()
    for query in ("?mode=ro", "?mode=ro&immutable=1"):  # read-only; immutable when -shm cannot be created
        try:
            con = sqlite3.connect(uri + query, uri=True)
            try:
                return con.execute(f"SELECT {', '.join(cols)} FROM {table} ORDER BY rowid").fetchall()
            finally:
                con.close()
        except sqlite3.OperationalError as e:
            last = e
            if "no such column" in str(e) or "no such table" in str(e):
                break
    raise ConfigError("--ledger", f"{path!r} cannot be read as a current dptune ledger ({last})",
                      f"open it once with this dptune (`{python_m('dptune.cli.ledger')} show --ledger {path}` upgrades "
                      "an older one), then migrate")


def migrate(source: LedgerLocation, to: LedgerLocation) -> Migrated:
    if source.is_postgres or not source.path.is_file():
        raise ConfigError("--ledger", f"{source} is not a SQLite ledger file", "give the file a search wrote")
    if not to.is_postgres:
        raise ConfigError("--to", f"{to} is not a postgresql:// URL", "give the team ledger's URL")
    budgets = _rows(str(source.path), "budgets", _BUDGET_COLS)
    charges = _rows(str(source.path), "charges", _CHARGE_COLS)
    key_file = source.path.with_name(source.path.name + ".key")
    if not key_file.exists():
        raise ConfigError("--ledger", f"its curator key {str(key_file)!r} is missing",
                          "restore it beside the ledger: its record ids and certificates are keyed under it")
    key = read_key(key_file)
    probe = Ledger(to, read_only=True)
    if not probe.key_path.exists():  # the team ledger takes this ledger's key (checked against it just below)
        write_key(probe.key_path, key)
    team = Ledger(to)
    if not hmac.compare_digest(team.key(), key):
        raise ConfigError("--to", f"the team ledger {to} is keyed under another curator key than {source}",
                          "budgets keyed under two keys cannot recognise each other's data: migrate into an empty "
                          "team ledger (or one migrated from this very file)")
    copied_b = copied_c = already = 0

    def body(con: Any) -> None:
        nonlocal copied_b, copied_c, already
        con.execute("LOCK TABLE budgets, charges IN SHARE ROW EXCLUSIVE MODE")
        for row in budgets:
            theirs = con.execute("SELECT dataset_id FROM budgets WHERE fingerprint=?", (row[0],)).fetchone()
            if theirs is not None:
                if theirs[0] != row[5]:
                    raise ConfigError("--to", f"the team ledger already holds a budget for the data of budget id "
                                      f"{row[5]} (as id {theirs[0]})", "merging two budgets of one dataset is the "
                                      "team's decision: nothing was copied")
                already += 1
                continue
            con.execute(f"INSERT INTO budgets ({', '.join(_BUDGET_COLS)}) VALUES ({', '.join('?' * len(_BUDGET_COLS))})",
                        row)
            copied_b += 1
        for row in charges:
            theirs = con.execute("SELECT id FROM charges WHERE token=?", (row[8],)).fetchone()
            if theirs is not None:
                already += 1
                continue
            if con.execute("SELECT 1 FROM charges WHERE id=?", (row[0],)).fetchone() is not None:
                raise ConfigError("--to", f"the team ledger already holds other charges under this file's row ids "
                                  f"(#{row[0]})", "migrate into an empty team ledger; nothing was copied")
            con.execute(f"INSERT INTO charges ({', '.join(_CHARGE_COLS)}) VALUES ({', '.join('?' * len(_CHARGE_COLS))})",
                        row)
            copied_c += 1
        con.execute("SELECT setval(pg_get_serial_sequence('charges', 'id'), "
                    "(SELECT GREATEST(COALESCE(MAX(id), 0), 1) FROM charges))")

    team._transact(body)
    src = Ledger(source, read_only=True)
    totals = {}
    for fp in {str(r[0]) for r in budgets} | {str(r[1]) for r in charges}:
        label = team.dataset_id(fp) if team.budget(fp) else "charges without a budget"
        totals[label] = (src.spent(fp), team.spent(fp))
    return Migrated(copied_b, copied_c, already, totals)
