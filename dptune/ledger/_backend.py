"""The one interface the ledger talks to: a connection that takes ``?`` placeholders, explicit transactions, a lock
per budget row, and which errors are worth retrying. Two backends: :mod:`dptune.ledger._sqlite` (the embedded
default) and :mod:`dptune.ledger._postgres` (a team's server)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any, Protocol

from dp_accounting import dp_event as de

from dptune.accounting import event_to_json
from dptune.errors import ConfigError
from dptune.ledger._location import LedgerLocation

__all__ = ["Backend", "DbCon", "LedgerUnavailable", "event_sha256"]


def event_sha256(event: de.DpEvent) -> str:
    """Hash of an event's canonical JSON (what a certificate binds to a ledger charge)."""
    text = json.dumps(event_to_json(event), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


class LedgerUnavailable(ConfigError):
    """The ledger's server could not be reached, refused this login, or its answer was lost (exit 2; the message
    names the host and the failure's class, never a password). ``retry``: whether waiting can help (no server
    answered, or the connection was lost), as opposed to a refusal (login, connection limit, SSL, read-only)."""

    def __init__(self, field: str, problem: str, fix: str, *, retry: bool = False) -> None:
        super().__init__(field, problem, fix)
        self.retry = retry


class DbCon:
    """A connection in the ledger's dialect: ``?`` placeholders, ``insert_id`` for a new row's id."""

    def __init__(self, raw: Any, *, pyformat: bool) -> None:
        self.raw = raw
        self._pyformat = pyformat

    def execute(self, sql: str, args: Sequence[Any] = ()) -> Any:
        if not self._pyformat:
            return self.raw.execute(sql, tuple(args))
        # psycopg: %s placeholders (no statement of the ledger holds a literal ?); without arguments, none parsed
        return self.raw.execute(sql.replace("?", "%s"), tuple(args)) if args else self.raw.execute(sql)

    def insert_id(self, sql: str, args: Sequence[Any]) -> int:
        if self._pyformat:
            (row_id,) = self.execute(sql + " RETURNING id", args).fetchone()
            return int(row_id)
        cur = self.execute(sql, args)
        assert cur.lastrowid is not None
        return int(cur.lastrowid)

    def close(self) -> None:
        self.raw.close()


class Backend(Protocol):
    location: LedgerLocation
    lock: str  # appended to a SELECT of the budget rows a transaction writes under (" FOR UPDATE"; SQLite: "")

    def connect(self, read_only: bool = False, wait: float | None = None) -> DbCon: ...

    def begin(self, con: DbCon, exclusive: bool) -> None: ...

    def retryable(self, e: BaseException) -> bool: ...

    def unavailable(self, e: BaseException) -> LedgerUnavailable | None: ...

