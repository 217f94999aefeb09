"""The embedded ledger: one SQLite file (mode 0600), WAL, ``synchronous=FULL`` (a reservation survives a crash).
Writers serialize on SQLite's write lock (``BEGIN IMMEDIATE``); schema and key set-up is one ``BEGIN EXCLUSIVE``."""

from __future__ import annotations

import json
import os
import secrets
import sqlite3
import stat
import time
from contextlib import suppress
from pathlib import Path

from dptune.accounting import event_from_json
from dptune.errors import ConfigError
from dptune.ledger._backend import DbCon, LedgerUnavailable, event_sha256
from dptune.ledger._location import LedgerLocation

__all__ = ["SCHEMA", "SqliteBackend", "private_file"]

SCHEMA = """
CREATE TABLE IF NOT EXISTS budgets (fingerprint TEXT PRIMARY KEY, epsilon REAL NOT NULL, delta REAL NOT NULL,
    label TEXT, created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS charges (id INTEGER PRIMARY KEY AUTOINCREMENT, fingerprint TEXT NOT NULL,
    name TEXT NOT NULL, event TEXT NOT NULL, epsilon REAL NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('reserved', 'committed', 'aborted')), created REAL NOT NULL, closed REAL);
"""
# columns added after the first release of the schema (older ledgers are upgraded in place)
ADDED = {"budgets": (("dataset_id", "TEXT"), ("digests", "BLOB"), ("records", "INTEGER"), ("ids", "BLOB"),
                     ("content", "BLOB")),
         "charges": (("token", "TEXT"), ("event_sha256", "TEXT"), ("group_id", "INTEGER"), ("login", "TEXT"))}


def private_file(path: Path, create: bool) -> None:
    """Owner-only (0600) from the first byte; an existing file is tightened to 0600."""
    if create and not path.exists():
        with suppress(FileExistsError):  # another process created it first
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    if path.exists() and stat.S_IMODE(path.stat().st_mode) != 0o600:
        os.chmod(path, 0o600)


class SqliteBackend:
    lock = ""  # BEGIN IMMEDIATE already holds the one write lock

    def __init__(self, location: LedgerLocation) -> None:
        self.location = location
        self.path = location.path

    def prepare(self) -> None:
        if self.path.exists() and self.path.is_dir():
            raise ConfigError("--ledger", f"{str(self.path)!r} is a directory",
                              "give a file path, e.g. ~/.local/share/dptune/ledger.sqlite")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        private_file(self.path, create=True)  # SQLite gives its -wal/-shm files the database's mode

    def connect(self, read_only: bool = False, wait: float | None = None) -> DbCon:  # wait: a server's
        if read_only:  # every writer closed cleanly has checkpointed its WAL into the file
            return DbCon(sqlite3.connect(f"{self.path.resolve().as_uri()}?mode=ro&immutable=1", uri=True,
                                         isolation_level=None), pyformat=False)
        con = sqlite3.connect(self.path, timeout=60, isolation_level=None)
        deadline = time.monotonic() + 60
        while True:  # switching a new file to WAL answers "locked" at once (no busy wait) while another holds it
            try:
                con.execute("PRAGMA journal_mode=WAL")
                break
            except sqlite3.OperationalError as e:
                if "locked" not in str(e) or time.monotonic() > deadline:
                    con.close()
                    raise
                time.sleep(0.01 + 0.04 * secrets.randbelow(100) / 100)
        con.execute("PRAGMA synchronous=FULL")  # durable at COMMIT: a reservation survives a crash
        return DbCon(con, pyformat=False)

    @staticmethod
    def begin(con: DbCon, exclusive: bool) -> None:
        con.execute("BEGIN EXCLUSIVE" if exclusive else "BEGIN IMMEDIATE")

    @staticmethod
    def retryable(e: BaseException) -> bool:
        return False  # the busy timeout (60 s) already waits for the lock

    @staticmethod
    def unavailable(e: BaseException) -> LedgerUnavailable | None:
        return None

    def set_up(self) -> bool:
        """Every table and column of the current schema is there (read only)."""
        con = sqlite3.connect(self.path, timeout=60, isolation_level=None)
        try:
            for table in ("budgets", "charges"):
                have = {r[1] for r in con.execute(f"PRAGMA table_info({table})")}
                if not have or any(name not in have for name, _ in ADDED[table]):
                    return False
            return True
        finally:
            con.close()

    @staticmethod
    def create(con: DbCon) -> None:
        """The schema, and an older ledger upgraded in place (inside the caller's exclusive transaction)."""
        for statement in SCHEMA.split(";"):
            if statement.strip():
                con.execute(statement)
        for table, cols in ADDED.items():
            have = {r[1] for r in con.execute(f"PRAGMA table_info({table})")}
            for name, typ in cols:
                if name not in have:
                    con.execute(f"ALTER TABLE {table} ADD COLUMN {name} {typ}")
        for (fp,) in con.execute("SELECT fingerprint FROM budgets WHERE dataset_id IS NULL").fetchall():
            con.execute("UPDATE budgets SET dataset_id=? WHERE fingerprint=?", (secrets.token_hex(16), fp))
        for (cid, text) in con.execute("SELECT id, event FROM charges WHERE token IS NULL").fetchall():
            con.execute("UPDATE charges SET token=?, event_sha256=? WHERE id=?",
                        (secrets.token_hex(16), event_sha256(event_from_json(json.loads(text))), cid))
