"""``dptune ledger history``: every charge as an operator audits it — when (UTC, ISO 8601), who (the database login
that made it: a team ledger's trigger writes it; a file ledger's, the machine's user), what (the search's name, its
ε alone, the budget), and where it stands, closed by whom. ``--budgets``: every change of a budget row instead, from
a team ledger's change log (``budget_changes``, written by a trigger: who, when, old → new). Read-only."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

from dptune.errors import ConfigError

__all__ = ["budget_changes", "history", "iso", "parse_since"]


def iso(t: float | None) -> str | None:
    """A ledger time (seconds since the epoch) as ISO 8601 in UTC, to the second."""
    return None if t is None else dt.datetime.fromtimestamp(t, dt.UTC).isoformat(timespec="seconds")


def parse_since(text: str | None) -> float | None:
    """``--since`` (an ISO date or date-time; UTC unless it says otherwise) as seconds since the epoch."""
    if not text:
        return None
    try:
        when = dt.datetime.fromisoformat(text)
    except ValueError:
        raise ConfigError("--since", f"{text!r} is not an ISO date or time",
                          "e.g. 2026-12-01 or 2026-12-01T09:30") from None
    return (when if when.tzinfo else when.replace(tzinfo=dt.UTC)).timestamp()


def history(ledger: Any, *, dataset_id: str | None = None, since: str | None = None,
            login: str | None = None) -> list[dict[str, Any]]:
    """The ledger's charges, oldest first, filtered by budget (``dataset_id``, as ``show`` prints it), time
    (``since``) and ``login``; each a dict: id, created, closed, status, login (None: made before schema 2 recorded
    it), closed_by (the login that closed it: schema 3; None before), name, epsilon (alone), budget (its label and
    id)."""
    after = parse_since(since)
    key = ledger.budget_key(dataset_id) if dataset_id else None
    with ledger._session() as con:
        has_login = _has_column(con, ledger.location.is_postgres, "login")
        closer = "c.closed_by" if _has_column(con, ledger.location.is_postgres, "closed_by") else "NULL"
        rows = con.execute(
            f"SELECT c.id, c.created, c.closed, c.status, {'c.login' if has_login else 'NULL'}, {closer}, c.name, "
            "c.epsilon, "
            "b.label, b.dataset_id FROM charges c LEFT JOIN budgets b ON b.fingerprint = c.fingerprint "
            "ORDER BY c.id").fetchall()
    out = []
    for cid, created, closed, status, who, closed_by, name, eps, label, budget in rows:
        if (key is not None and budget != ledger.dataset_id(key)) or (after is not None and created < after) \
                or (login is not None and who != login):
            continue
        out.append({"id": int(cid), "created": iso(created), "closed": iso(closed), "status": status, "login": who,
                    "closed_by": closed_by, "name": name, "epsilon": float(eps), "budget": label, "dataset_id": budget})
    return out


def budget_changes(ledger: Any, *, dataset_id: str | None = None, since: str | None = None,
                   login: str | None = None) -> list[dict[str, Any]]:
    """A team ledger's budget change log, oldest first, filtered as :func:`history`; each a dict: id, at, login, op
    (insert, update, delete), budget (label), dataset_id and changes ({column: [old, new]}; a signature blob as its
    SHA-256 and length). A file ledger, or a team ledger before schema 3, keeps none: []."""
    after = parse_since(since)
    key = ledger.budget_key(dataset_id) if dataset_id else None
    if not ledger.location.is_postgres:
        return []
    with ledger._session() as con:
        (present,) = con.execute("SELECT to_regclass('budget_changes') IS NOT NULL").fetchone()
        rows = con.execute(
            "SELECT l.id, l.at, l.login, l.op, l.fingerprint, l.changes, b.label, b.dataset_id FROM budget_changes l "
            "LEFT JOIN budgets b ON b.fingerprint = l.fingerprint ORDER BY l.id").fetchall() if present else []
    out = []
    for lid, at, who, op, fp, changes, label, budget in rows:
        if (key is not None and fp != key) or (after is not None and at < after) or (login is not None and who != login):
            continue
        changes = json.loads(changes) if isinstance(changes, str) else changes  # a budget's key stays inside
        out.append({"id": int(lid), "at": iso(at), "login": who, "op": op, "budget": label, "dataset_id": budget,
                    "changes": {k: (["(a key)", "(another key)"] if op == "update" else v) if k == "fingerprint"
                                else v for k, v in changes.items() if k != "fingerprint" or op == "update"}})
    return out


def _has_column(con: Any, postgres: bool, column: str) -> bool:
    if postgres:
        (n,) = con.execute("SELECT COUNT(*) FROM information_schema.columns WHERE table_name = 'charges' AND "
                           "column_name = ? AND table_schema = current_schema()", (column,)).fetchone()
        return bool(n)
    return any(r[1] == column for r in con.execute("PRAGMA table_info(charges)").fetchall())
