"""Privacy ledger: per-dataset budgets and every charge, durable before any trial touches data.

One SQLite file (mode 0600) and a curator key beside it (``<ledger>.key``, 0600). A charge is stored as a
serialized DpEvent; totals compose the events in RDP (never add ε). ``reserve`` commits before it returns;
``commit``/``abort`` close a reservation; an unclosed reservation still counts (a crashed search has spent
its budget). Writers serialize on SQLite's write lock (BEGIN IMMEDIATE), so concurrent reservations can
neither be lost nor overspend.

What is public and what is not:

* a dataset's **fingerprint** (a hash of every example) and its **per-example digests** stay here: whoever
  knows all records but one could test candidates for the last one against an exact hash. Certificates
  carry the dataset's random ``dataset_id`` (128 bits of OS entropy, drawn when its budget is set);
* a charge's row id counts the charges before it: certificates carry its random ``token`` instead;
* the key authenticates certificates (HMAC-SHA256): a certificate is bound to the ledger charges it
  claims, so an edited or borrowed one is refused by final training.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import sqlite3
import stat
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from dp_accounting import dp_event as de

from dptune.accounting import epsilon as composed_epsilon  # `epsilon` is a budget parameter here
from dptune.accounting import event_from_json, event_to_json
from dptune.errors import ConfigError, check_delta, check_positive

__all__ = ["BudgetExceeded", "Charge", "Ledger", "event_sha256"]

SAME_DATASET_SHARE = 0.9  # a dataset sharing >= 90 % of its examples with a budgeted one is that dataset

_SCHEMA = """
CREATE TABLE IF NOT EXISTS budgets (
    fingerprint TEXT PRIMARY KEY,
    epsilon REAL NOT NULL,
    delta REAL NOT NULL,
    label TEXT,
    created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS charges (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    fingerprint TEXT NOT NULL,
    name TEXT NOT NULL,
    event TEXT NOT NULL,
    epsilon REAL NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('reserved', 'committed', 'aborted')),
    created REAL NOT NULL,
    closed REAL
);
"""
# columns added after the first release of the schema (older ledgers are upgraded in place)
_ADDED = {"budgets": (("dataset_id", "TEXT"), ("digests", "BLOB")),
          "charges": (("token", "TEXT"), ("event_sha256", "TEXT"))}


class BudgetExceeded(ConfigError):
    """A reservation would exceed the dataset's budget (nothing was stored)."""


def event_sha256(event: de.DpEvent) -> str:
    """Hash of an event's canonical JSON (what a certificate binds to a ledger charge)."""
    text = json.dumps(event_to_json(event), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class Charge:
    id: int  # curator-side row id (it counts earlier charges: never published)
    fingerprint: str
    name: str
    event: de.DpEvent
    epsilon: float  # ε of this charge alone at the budget's δ (for display; totals compose events)
    status: str
    created: float
    token: str  # public, random: what certificates name


def _private_file(path: Path, create: bool) -> None:
    """Owner-only (0600) from the first byte; an existing file is tightened to 0600."""
    if create and not path.exists():
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    if path.exists() and stat.S_IMODE(path.stat().st_mode) != 0o600:
        os.chmod(path, 0o600)


class Ledger:
    def __init__(self, path: str | Path, *, read_only: bool = False) -> None:
        """``read_only``: only read (e.g. ``ledger show`` of a ledger in a read-only folder or on a read-only
        mount): nothing is created, tightened or upgraded; SQLite opens the file immutable (no -wal/-shm)."""
        self.path = Path(path)
        self.read_only = read_only
        if self.path.exists() and self.path.is_dir():
            raise ConfigError("--ledger", f"{str(self.path)!r} is a directory", "give a file path, e.g. runs/ledger.sqlite")
        self.key_path = self.path.with_name(self.path.name + ".key")
        if read_only:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _private_file(self.path, create=True)  # SQLite gives its -wal/-shm files the database's mode
        if not self.key_path.exists():
            fd = os.open(self.key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))  # 256-bit curator key for certificate MACs
        _private_file(self.key_path, create=False)
        con = self._connect()
        try:
            con.executescript(_SCHEMA)
            self._upgrade(con)
        finally:
            con.close()

    @staticmethod
    def _upgrade(con: sqlite3.Connection) -> None:
        for table, cols in _ADDED.items():
            have = {r[1] for r in con.execute(f"PRAGMA table_info({table})")}
            for name, typ in cols:
                if name not in have:
                    con.execute(f"ALTER TABLE {table} ADD COLUMN {name} {typ}")
        for (fp,) in con.execute("SELECT fingerprint FROM budgets WHERE dataset_id IS NULL").fetchall():
            con.execute("UPDATE budgets SET dataset_id=? WHERE fingerprint=?", (secrets.token_hex(16), fp))
        for (cid, text) in con.execute("SELECT id, event FROM charges WHERE token IS NULL").fetchall():
            con.execute("UPDATE charges SET token=?, event_sha256=? WHERE id=?",
                        (secrets.token_hex(16), event_sha256(event_from_json(json.loads(text))), cid))

    def _connect(self) -> sqlite3.Connection:
        if self.read_only:  # every writer closed cleanly has checkpointed its WAL into the file
            return sqlite3.connect(f"{self.path.resolve().as_uri()}?mode=ro&immutable=1", uri=True,
                                   isolation_level=None)
        con = sqlite3.connect(self.path, timeout=60, isolation_level=None)
        con.execute("PRAGMA journal_mode=WAL")
        con.execute("PRAGMA synchronous=FULL")  # durable at COMMIT: a reservation survives a crash
        return con

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        con = self._connect()
        try:
            con.execute("BEGIN IMMEDIATE")
            try:
                yield con
            except BaseException:
                con.execute("ROLLBACK")
                raise
            con.execute("COMMIT")
        finally:
            con.close()

    def _read(self, query: str, args: tuple = ()) -> list[tuple]:
        con = self._connect()
        try:
            return con.execute(query, args).fetchall()
        finally:
            con.close()

    # --- certificate authentication ------------------------------------------------------------------

    def mac(self, message: bytes) -> str:
        """HMAC-SHA256 of ``message`` under the curator key (the key never leaves this object)."""
        return hmac.new(bytes.fromhex(self.key_path.read_text().strip()), message, hashlib.sha256).hexdigest()

    def verify_mac(self, message: bytes, mac: str) -> bool:
        return hmac.compare_digest(self.mac(message), str(mac))

    # --- budgets -------------------------------------------------------------------------------------

    def set_budget(self, fingerprint: str, epsilon: float, delta: float, label: str = "",
                   digests: Sequence[bytes] | None = None) -> None:
        _check_budget(epsilon, delta)
        blob = b"".join(sorted(digests)) if digests is not None else None
        with self._write() as con:
            eps_spent = composed_epsilon(self._spent(con, fingerprint), delta)
            if eps_spent > epsilon:
                raise BudgetExceeded("--epsilon", f"{eps_spent:.4g} has already been spent on this dataset",
                                     f"choose a budget >= {eps_spent:.4g}")
            con.execute("INSERT INTO budgets (fingerprint, epsilon, delta, label, created, dataset_id, digests) "
                        "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT(fingerprint) DO UPDATE SET "
                        "epsilon=excluded.epsilon, delta=excluded.delta, label=excluded.label, "
                        "digests=COALESCE(excluded.digests, budgets.digests)",
                        (fingerprint, float(epsilon), float(delta), label, time.time(), secrets.token_hex(16), blob))

    def budget(self, fingerprint: str) -> tuple[float, float] | None:
        rows = self._read("SELECT epsilon, delta FROM budgets WHERE fingerprint=?", (fingerprint,))
        return (float(rows[0][0]), float(rows[0][1])) if rows else None

    def dataset_id(self, fingerprint: str) -> str:
        """The dataset's public id: random, not a function of the data."""
        rows = self._read("SELECT dataset_id FROM budgets WHERE fingerprint=?", (fingerprint,))
        if not rows:
            raise ConfigError("budget", f"no privacy budget is set for dataset {fingerprint[:12]}",
                              "set one with --budget-epsilon or python -m dptune.ledger set-budget")
        return str(rows[0][0])

    def fingerprint_of(self, dataset_id: str) -> str | None:
        rows = self._read("SELECT fingerprint FROM budgets WHERE dataset_id=?", (dataset_id,))
        return str(rows[0][0]) if rows else None

    def same_dataset(self, fingerprint: str, digests: Sequence[bytes]) -> tuple[str, float] | None:
        """A budgeted dataset that is (nearly) this one: the same fingerprint, or one sharing at least
        ``SAME_DATASET_SHARE`` of either dataset's examples (a near-copy must not open a fresh budget).
        Returns (its fingerprint, the shared share)."""
        if self.budget(fingerprint) is not None:
            return fingerprint, 1.0
        mine = set(digests)
        best: tuple[str, float] | None = None
        for fp, blob in self._read("SELECT fingerprint, digests FROM budgets WHERE digests IS NOT NULL"):
            theirs = {bytes(blob[i:i + 32]) for i in range(0, len(blob), 32)}
            shared = len(mine & theirs) / max(1, min(len(mine), len(theirs)))
            if shared >= SAME_DATASET_SHARE and (best is None or shared > best[1]):
                best = (str(fp), shared)
        return best

    # --- charges -------------------------------------------------------------------------------------

    @staticmethod
    def _spent(con: sqlite3.Connection, fingerprint: str) -> list[de.DpEvent]:
        """Every charge that counts (reserved or committed), as events; totals compose them."""
        rows = con.execute("SELECT event FROM charges WHERE fingerprint=? AND status != 'aborted'",
                           (fingerprint,)).fetchall()
        return [event_from_json(json.loads(text)) for (text,) in rows]

    def reserve(self, fingerprint: str, name: str, event: de.DpEvent) -> int:
        """Store the charge durably (committed) and return its id; refuse if over budget (stores nothing)."""
        text = json.dumps(event_to_json(event))  # refuses an event dptune cannot store, before the lock
        with self._write() as con:
            row = con.execute("SELECT epsilon, delta FROM budgets WHERE fingerprint=?", (fingerprint,)).fetchone()
            if row is None:
                raise ConfigError("budget", f"no privacy budget is set for dataset {fingerprint[:12]}",
                                  f"set one: python -m dptune.ledger set-budget --ledger {self.path} "
                                  f"--fingerprint {fingerprint} --epsilon E --delta D (or pass --budget-epsilon)")
            budget_eps, budget_delta = float(row[0]), float(row[1])
            spent = self._spent(con, fingerprint)
            total_eps = composed_epsilon([*spent, event], budget_delta)
            if total_eps > budget_eps:
                spent_eps = composed_epsilon(spent, budget_delta)
                raise BudgetExceeded(
                    "budget",
                    f"this charge would bring dataset {fingerprint[:12]} to ε = {total_eps:.4g} (δ = {budget_delta:g}), "
                    f"over its budget ε = {budget_eps:g} (already spent ε = {spent_eps:.4g})",
                    "lower the search's cost (larger noise_multiplier lower bound, fewer mean trials, more score "
                    "noise) or raise the budget with `python -m dptune.ledger set-budget`",
                )
            eps_alone = composed_epsilon([event], budget_delta)
            cur = con.execute(
                "INSERT INTO charges (fingerprint, name, event, epsilon, status, created, token, event_sha256) "
                "VALUES (?, ?, ?, ?, 'reserved', ?, ?, ?)",
                (fingerprint, name, text, eps_alone, time.time(), secrets.token_hex(16), event_sha256(event)))
            assert cur.lastrowid is not None
            return int(cur.lastrowid)

    def _close(self, charge_id: int, status: str) -> None:
        with self._write() as con:
            row = con.execute("SELECT status FROM charges WHERE id=?", (charge_id,)).fetchone()
            if row is None:
                raise KeyError(f"no charge {charge_id}")
            if row[0] != "reserved":
                if row[0] == status:
                    return  # idempotent (a resumed search commits once)
                raise ValueError(f"charge {charge_id} is already {row[0]}")
            con.execute("UPDATE charges SET status=?, closed=? WHERE id=?", (status, time.time(), charge_id))

    def commit(self, charge_id: int) -> None:
        self._close(charge_id, "committed")

    def abort(self, charge_id: int) -> None:
        """Only for a charge whose search provably never touched data (e.g. failed before any trial)."""
        self._close(charge_id, "aborted")

    _CHARGE_COLUMNS = "id, fingerprint, name, event, epsilon, status, created, token"

    @staticmethod
    def _charge(r: tuple) -> Charge:
        return Charge(r[0], r[1], r[2], event_from_json(json.loads(r[3])), r[4], r[5], r[6], r[7])

    def charges(self, fingerprint: str | None = None) -> list[Charge]:
        q = f"SELECT {self._CHARGE_COLUMNS} FROM charges"
        rows = self._read(q + (" WHERE fingerprint=?" if fingerprint else "") + " ORDER BY id",
                          (fingerprint,) if fingerprint else ())
        return [self._charge(r) for r in rows]

    def charge(self, charge_id: int) -> Charge:
        rows = self._read(f"SELECT {self._CHARGE_COLUMNS} FROM charges WHERE id=?", (charge_id,))
        if not rows:
            raise KeyError(f"no charge {charge_id}")
        return self._charge(rows[0])

    def charge_by_token(self, token: str) -> Charge | None:
        rows = self._read(f"SELECT {self._CHARGE_COLUMNS} FROM charges WHERE token=?", (str(token),))
        return self._charge(rows[0]) if rows else None

    def spent(self, fingerprint: str, delta: float | None = None) -> float:
        """ε spent on a dataset at ``delta`` (default: the budget's δ), composing every open or closed charge."""
        if delta is None:
            b = self.budget(fingerprint)
            delta = b[1] if b else 1e-5
        con = self._connect()
        try:
            return composed_epsilon(self._spent(con, fingerprint), delta)
        finally:
            con.close()

    def fingerprints(self) -> list[str]:
        rows = self._read("SELECT fingerprint FROM budgets UNION SELECT fingerprint FROM charges")
        return sorted(r[0] for r in rows)


def _check_budget(epsilon: float, delta: float) -> None:
    check_positive("--epsilon", epsilon, "choose a total budget, e.g. 8")
    check_delta("--delta", delta)
