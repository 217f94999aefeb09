"""Privacy ledger: per-dataset budgets and every charge, durable before any trial touches data.

One SQLite file. A charge is stored as a serialized DpEvent; totals compose the events in RDP (never add
ε). ``reserve`` commits before it returns; ``commit``/``abort`` close a reservation; an unclosed
reservation still counts (a crashed search has spent its budget). Writers serialize on SQLite's write lock
(BEGIN IMMEDIATE), so concurrent reservations can neither be lost nor overspend.

CLI: ``python -m dptune.ledger {show,set-budget} --ledger FILE``.
"""

from __future__ import annotations

import argparse
import json
import math
import sqlite3
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dp_accounting import dp_event as de

from dptune.accounting import epsilon as composed_epsilon  # `epsilon` is a budget parameter here
from dptune.accounting import event_from_json, event_to_json
from dptune.config import ConfigError

__all__ = ["BudgetExceeded", "Charge", "Ledger"]

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


class BudgetExceeded(ConfigError):
    """A reservation would exceed the dataset's budget (nothing was stored)."""


@dataclass(frozen=True)
class Charge:
    id: int
    fingerprint: str
    name: str
    event: de.DpEvent
    epsilon: float  # ε of this charge alone at the budget's δ (for display; totals compose events)
    status: str
    created: float


class Ledger:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if self.path.exists() and self.path.is_dir():
            raise ConfigError("--ledger", f"{str(self.path)!r} is a directory", "give a file path, e.g. runs/ledger.sqlite")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._connect() as con:
            con.executescript(_SCHEMA)

    def _connect(self) -> sqlite3.Connection:
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

    # --- budgets -------------------------------------------------------------------------------------

    def set_budget(self, fingerprint: str, epsilon: float, delta: float, label: str = "") -> None:
        _check_budget(epsilon, delta)
        with self._write() as con:
            eps_spent = composed_epsilon(self._spent(con, fingerprint), delta)
            if eps_spent > epsilon:
                raise BudgetExceeded("--epsilon", f"{eps_spent:.4g} has already been spent on this dataset",
                                     f"choose a budget >= {eps_spent:.4g}")
            con.execute("INSERT INTO budgets VALUES (?, ?, ?, ?, ?) ON CONFLICT(fingerprint) DO UPDATE SET "
                        "epsilon=excluded.epsilon, delta=excluded.delta, label=excluded.label",
                        (fingerprint, float(epsilon), float(delta), label, time.time()))

    def budget(self, fingerprint: str) -> tuple[float, float] | None:
        con = self._connect()
        try:
            row = con.execute("SELECT epsilon, delta FROM budgets WHERE fingerprint=?", (fingerprint,)).fetchone()
        finally:
            con.close()
        return (float(row[0]), float(row[1])) if row else None

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
                "INSERT INTO charges (fingerprint, name, event, epsilon, status, created) VALUES (?, ?, ?, ?, 'reserved', ?)",
                (fingerprint, name, text, eps_alone, time.time()))
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

    def charges(self, fingerprint: str | None = None) -> list[Charge]:
        con = self._connect()
        try:
            q = "SELECT id, fingerprint, name, event, epsilon, status, created FROM charges"
            rows = con.execute(q + (" WHERE fingerprint=?" if fingerprint else "") + " ORDER BY id",
                               (fingerprint,) if fingerprint else ()).fetchall()
        finally:
            con.close()
        return [Charge(r[0], r[1], r[2], event_from_json(json.loads(r[3])), r[4], r[5], r[6]) for r in rows]

    def charge(self, charge_id: int) -> Charge:
        for c in self.charges():
            if c.id == charge_id:
                return c
        raise KeyError(f"no charge {charge_id}")

    def spent(self, fingerprint: str, delta: float | None = None) -> float:
        """ε spent on a dataset at ``delta`` (default: the budget's δ), composing every open or closed charge."""
        if delta is None:
            b = self.budget(fingerprint)
            delta = b[1] if b else 1e-5
        con = self._connect()
        try:
            spent = self._spent(con, fingerprint)
        finally:
            con.close()
        return composed_epsilon(spent, delta)

    def fingerprints(self) -> list[str]:
        con = self._connect()
        try:
            rows = con.execute("SELECT fingerprint FROM budgets UNION SELECT fingerprint FROM charges").fetchall()
        finally:
            con.close()
        return sorted(r[0] for r in rows)


def _check_budget(epsilon: float, delta: float) -> None:
    if not (isinstance(epsilon, int | float) and math.isfinite(epsilon) and epsilon > 0):
        raise ConfigError("--epsilon", f"{epsilon!r} must be > 0", "choose a total budget, e.g. 8")
    if not (isinstance(delta, int | float) and 0 < delta < 1):
        raise ConfigError("--delta", f"{delta!r} is not in (0, 1)", "choose e.g. 1e-5 (below 1/n)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dptune.ledger", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    show = sub.add_parser("show", help="budgets and charges")
    show.add_argument("--ledger", required=True)
    show.add_argument("--json", action="store_true")
    sb = sub.add_parser("set-budget", help="set a dataset's (ε, δ) budget")
    sb.add_argument("--ledger", required=True)
    sb.add_argument("--fingerprint", required=True)
    sb.add_argument("--epsilon", type=float, required=True)
    sb.add_argument("--delta", type=float, required=True)
    sb.add_argument("--label", default="")
    args = parser.parse_args(argv)
    try:
        if args.command == "show" and not Path(args.ledger).is_file():
            raise ConfigError("--ledger", f"{args.ledger!r} does not exist", "give the ledger file a search wrote")
        ledger = Ledger(args.ledger)
        if args.command == "set-budget":
            ledger.set_budget(args.fingerprint, args.epsilon, args.delta, args.label)
            print(f"budget for {args.fingerprint[:12]}: ε = {args.epsilon:g}, δ = {args.delta:g}")
            return 0
        out: list[dict[str, Any]] = []
        for fp in ledger.fingerprints():
            b = ledger.budget(fp)
            out.append({"fingerprint": fp, "budget_epsilon": b[0] if b else None, "budget_delta": b[1] if b else None,
                        "spent_epsilon": ledger.spent(fp),
                        "charges": [{"id": c.id, "name": c.name, "epsilon": c.epsilon, "status": c.status,
                                     "created": c.created} for c in ledger.charges(fp)]})
        if args.json:
            print(json.dumps(out, indent=2))
        else:
            for d in out:
                print(f"dataset {d['fingerprint'][:12]}: budget ε = {d['budget_epsilon']}, δ = {d['budget_delta']}; "
                      f"spent ε = {d['spent_epsilon']:.4g} (RDP composition)")
                for c in d["charges"]:
                    print(f"  #{c['id']:<4} {c['status']:<9} ε = {c['epsilon']:.4g}  {c['name']}")
        return 0
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
