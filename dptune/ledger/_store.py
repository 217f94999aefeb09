"""Privacy ledger: per-dataset budgets and every charge, durable before any trial touches data.

One ledger, two backends (:mod:`dptune.ledger._backend`): a SQLite file (mode 0600) with a curator key beside it
(``<ledger>.key``, 0600), the per-user default; or a team's PostgreSQL database (``--ledger postgresql://…``,
:mod:`dptune.ledger._postgres`) with the key a file each curator holds (:mod:`dptune.ledger._keys`). A charge is
stored as a serialized DpEvent; totals compose the events with the charged accountant (never add ε). ``reserve``
commits before it returns; ``commit``/``abort`` close a reservation; an unclosed reservation still counts (a crashed
search has spent its budget). A writer holds the lock of every budget it charges (SQLite's one write lock; a row lock
per budget on PostgreSQL): concurrent reservations can neither be lost nor overspend. What is public and what is not:

* a budget's key, a dataset's **fingerprint** (a hash of every example), its keyed **content signatures** and
  **record-id digests** (:mod:`dptune.ledger._budgets`; older budgets: **per-example digests**) stay here: whoever knows all records but one
  could test candidates for the last one against an exact hash. Certificates, ``ledger show`` and every
  message name a budget by its label and random ``dataset_id`` (128 bits of OS entropy, drawn when it is set);
* a charge's row id counts the charges before it: certificates carry its random ``token`` instead;
* the key authenticates certificates (HMAC-SHA256): a certificate is bound to the ledger charges it
  claims, so an edited or borrowed one is refused by final training.
"""

from __future__ import annotations

import getpass
import hashlib
import hmac
import math
import secrets
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

from dp_accounting import dp_event as de

from dptune.accounting import epsilon as composed_epsilon  # `epsilon` is a budget parameter here
from dptune.errors import ConfigError, check_delta, check_positive, python_m
from dptune.ledger._backend import DbCon, event_sha256
from dptune.ledger._event_rules import event_text, read_event
from dptune.ledger._keys import (
    key_fits,
    missing_team_key,
    read_key,
    team_key_path,
    write_key,
    wrong_team_key,
)
from dptune.ledger._location import LedgerLocation, default_ledger_path, ledger_location
from dptune.ledger._pg_schema import ADMIN_ROLE, admin_only, close_refused
from dptune.ledger._postgres import PostgresBackend, open_team, patiently
from dptune.ledger._sqlite import SqliteBackend, private_file

__all__ = ["BudgetExceeded", "Charge", "Ledger", "default_ledger_path", "event_sha256"]

T = TypeVar("T")


class BudgetExceeded(ConfigError):
    """A reservation would exceed the dataset's budget (nothing was stored)."""


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


class Ledger:
    def __init__(self, path: str | Path | LedgerLocation | None = None, *, read_only: bool = False) -> None:
        """``path``: a SQLite file or a ``postgresql://`` URL (:func:`dptune.ledger.ledger_location`; None: the
        default). ``read_only``: only read (e.g. ``ledger show`` of a ledger in a read-only folder or on a
        read-only mount): nothing is created, tightened or upgraded; SQLite opens the file immutable."""
        # absolute from here on: what state.json records, what every charge prints, what a resume compares
        self.location = ledger_location(path)
        self.read_only = read_only
        self._wait: float | None = None  # how long a connection waits for a server that does not answer
        self._backend: Any = cast(Any, PostgresBackend if self.location.is_postgres else SqliteBackend)(self.location)
        self._key: bytes | None = None
        self.ledger_id: str | None = None  # a team ledger's identity, from its database (None: a SQLite file)
        if self.location.is_postgres:
            self.key_path = team_key_path(self.location)
            open_team(self)  # tables (if this login may create them), its id and key file, the key's check value
            return
        self.key_path = self.location.path.with_name(self.location.path.name + ".key")
        if read_only:
            if self.location.path.is_dir():
                self._backend.prepare()  # its message
            return
        self._backend.prepare()
        # schema, upgrades and the key under one exclusive lock: two processes opening a new ledger at once
        # would otherwise both add the same column (or both write a key); a set-up ledger is only read
        if self.key_path.exists() and self._backend.set_up():
            private_file(self.key_path, create=False)
            return
        with self._write(exclusive=True) as con:
            self._backend.create(con)
            if not self.key_path.exists():
                self._no_charges_yet(con)
                write_key(self.key_path)
        private_file(self.key_path, create=False)

    def same_ledger(self, recorded: str, recorded_id: str | None) -> bool:
        """Whether this is the ledger a run recorded: a team ledger by its id (however it was reached), where the
        run recorded one; else by its shown address."""
        if self.ledger_id is not None and recorded_id is not None:
            return self.ledger_id == recorded_id
        return ledger_location(recorded).same(self.location)

    @property
    def path(self) -> Path | LedgerLocation:
        """What messages name: the file, or the team ledger's URL without its password."""
        return self.location if self.location.is_postgres else self.location.path

    def _no_charges_yet(self, con: DbCon) -> None:
        """A fresh key only for a ledger without charges: a new key would orphan every certificate."""
        (n,) = con.execute("SELECT COUNT(*) FROM charges").fetchone()
        if n:
            raise ConfigError("--ledger", f"the curator key {str(self.key_path)!r} is missing, but the ledger holds "
                              f"{n} charges whose certificates it authenticates",
                              f"restore {self.key_path.name} from your backup beside the ledger (a new key would "
                              "invalidate every certificate); nothing was changed")

    def key(self) -> bytes:
        """The curator key (a team ledger's: checked against the database's check value on first use)."""
        if self._key is None:
            if self.location.is_postgres:
                check = self._read("SELECT value FROM dptune_meta WHERE name='key_check'")
                if not self.key_path.exists():
                    raise missing_team_key(self.location, self.key_path)
                key = read_key(self.key_path)
                if not key_fits(check[0][0] if check else None, key):
                    raise wrong_team_key(self.location, self.key_path)
            else:
                key = read_key(self.key_path)
            self._key = key
        return self._key

    def _connect(self) -> DbCon:
        return cast(DbCon, self._backend.connect(read_only=self.read_only, wait=self._wait))

    @contextmanager
    def _session(self) -> Iterator[DbCon]:
        """A connection, closed after use; an error that means the database is gone is raised as the backend's
        clear message."""
        con = self._connect()
        try:
            yield con
        except Exception as e:
            lost = self._backend.unavailable(e)
            if lost is not None:
                raise lost from None
            raise
        finally:
            with suppress(Exception):
                con.close()

    @contextmanager
    def _write(self, exclusive: bool = False) -> Iterator[DbCon]:
        with self._session() as con:
            self._backend.begin(con, exclusive)
            try:
                yield con
            except BaseException:
                with suppress(Exception):  # a lost connection has rolled back already
                    con.execute("ROLLBACK")
                raise
            con.execute("COMMIT")

    def _transact(self, body: Callable[[DbCon], T]) -> T:
        """``body`` in one write transaction, retried from the start on a serialization failure or deadlock
        (PostgreSQL: each try rolled back whole)."""
        for attempt in range(50):
            try:
                with self._write() as con:
                    return body(con)
            except Exception as e:
                if not self._backend.retryable(e) or attempt == 49:
                    raise
                time.sleep(min(0.5, 0.005 * 2 ** min(attempt, 7)) * (0.5 + secrets.randbelow(1000) / 1000))
        raise AssertionError("unreachable")

    def _read(self, query: str, args: tuple = ()) -> list[tuple]:
        with self._session() as con:
            return list(con.execute(query, args).fetchall())

    # --- certificate authentication ------------------------------------------------------------------

    def mac(self, message: bytes) -> str:
        """HMAC-SHA256 of ``message`` under the curator key (the key never leaves this object)."""
        return hmac.new(self.key(), message, hashlib.sha256).hexdigest()

    def verify_mac(self, message: bytes, mac: str) -> bool:
        return hmac.compare_digest(self.mac(message), str(mac))

    # --- budgets -------------------------------------------------------------------------------------

    def set_budget(self, fingerprint: str, epsilon: float, delta: float, label: str = "",
                   digests: Sequence[bytes] | None = None, n: int | None = None,
                   ids: Sequence[bytes] | None = None, content: bytes | None = None) -> None:
        """Open or change the budget keyed ``fingerprint``; ``n`` records (default: of ``digests``): δ < 1/n.
        ``ids``, ``content``: its keyed record ids and content signatures (``dptune.ledger._budgets``); ``digests``:
        exact example digests, as budgets opened before content signatures stored them. On a team ledger opening one
        is a curator's, changing one ``dptune_admin``'s (a refusal names the role and the command)."""
        n = n if n is not None else (len(digests) if digests is not None else None)
        blob = b"".join(sorted(digests)) if digests is not None else None
        id_blob = b"".join(sorted(ids)) if ids is not None else None
        def body(con: DbCon) -> None:
            row = con.execute("SELECT records, dataset_id FROM budgets WHERE fingerprint=?" + self._backend.lock,
                              (fingerprint,)).fetchone()
            check_positive("--epsilon", epsilon, "choose a total budget, e.g. 8")
            check_delta("--delta", delta, n if n is not None else (row[0] if row else None))  # δ < 1/n, n known
            eps_spent = composed_epsilon(self._spent(con, fingerprint), delta)
            if eps_spent > epsilon:
                raise BudgetExceeded("--epsilon", f"{eps_spent:.4g} has already been spent on this dataset",
                                     f"choose a budget >= {eps_spent:.4g}")
            # a new budget is an INSERT (a curator's right); changing one an UPDATE (on a team ledger: the admin's)
            if row is None and con.execute(
                    "INSERT INTO budgets (fingerprint, epsilon, delta, label, created, dataset_id, digests, records, "
                    "ids, content) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (fingerprint) DO NOTHING",
                    (fingerprint, float(epsilon), float(delta), label or None, time.time(), secrets.token_hex(16),
                     blob, n, id_blob, content)).rowcount == 1:
                return
            with admin_only(self, row[1] if row else "ID", f"set-budget --epsilon {epsilon:g} --delta {delta:g}"):
                con.execute("UPDATE budgets SET epsilon=?, delta=?, label=COALESCE(?, label), digests=COALESCE(?, "
                            "digests), records=COALESCE(?, records), ids=COALESCE(?, ids), content=COALESCE(?, "
                            "content) WHERE fingerprint=?", (float(epsilon), float(delta), label or None, blob, n,
                                                             id_blob, content, fingerprint))

        self._transact(body)

    def budget_key(self, dataset_id: str) -> str:
        """The key of the budget with this public ``dataset_id``; ConfigError if none (no phantom budget)."""
        rows = self._read("SELECT fingerprint FROM budgets WHERE dataset_id=? OR fingerprint=?",
                          (str(dataset_id), str(dataset_id)))
        if not rows:
            raise ConfigError("--dataset-id", f"no budget in {self.path} has the id {str(dataset_id)[:40]!r}",
                              f"give a dataset id that `{python_m('dptune.cli.ledger')} show --ledger {self.path}` lists "
                              f"(a new dataset's budget is opened with `{python_m('dptune.cli.ledger')} new-budget`)")
        return str(rows[0][0])

    def label(self, fingerprint: str, with_id: bool = True) -> str:
        """What a budget is called on the terminal: its label and public random id, never its key."""
        rows = self._read("SELECT label, dataset_id FROM budgets WHERE fingerprint=?", (fingerprint,))
        if not rows:
            return "a dataset without a budget"
        return f"{rows[0][0] or 'dataset'}" + (f" (id {rows[0][1]})" if with_id else "")

    def budget(self, fingerprint: str) -> tuple[float, float] | None:
        rows = self._read("SELECT epsilon, delta FROM budgets WHERE fingerprint=?", (fingerprint,))
        return (float(rows[0][0]), float(rows[0][1])) if rows else None

    def dataset_id(self, fingerprint: str) -> str:
        """The dataset's public id: random, not a function of the data."""
        rows = self._read("SELECT dataset_id FROM budgets WHERE fingerprint=?", (fingerprint,))
        if not rows:
            raise ConfigError("budget", f"this dataset has no privacy budget in {self.path}",
                              f"open one with --budget-epsilon or {python_m('dptune.cli.ledger')} new-budget")
        return str(rows[0][0])

    def fingerprint_of(self, dataset_id: str) -> str | None:
        rows = self._read("SELECT fingerprint FROM budgets WHERE dataset_id=?", (dataset_id,))
        return str(rows[0][0]) if rows else None

    # --- charges -------------------------------------------------------------------------------------

    def _spent(self, con: DbCon, fingerprint: str) -> list[de.DpEvent]:
        """Every charge that counts (reserved or committed), as events; totals compose them. An unreadable one is
        an ``UnreadableCharge`` naming it (nothing is charged to its budget), never the accountant's TypeError."""
        rows = con.execute("SELECT id, event FROM charges WHERE fingerprint=? AND status != 'aborted' ORDER BY id",
                           (fingerprint,)).fetchall()
        return [read_event(cid, text, where=str(self.path)) for (cid, text) in rows]

    def reserve(self, fingerprint: str | Sequence[str], name: str, event: de.DpEvent, n: int | None = None) -> int:
        """Store the charge durably (committed) and return its id; refuse if over budget (stores nothing).
        ``fingerprint``: the budget's key, or the keys of every budget the data overlaps: each is charged the
        event, all or none, in one transaction; the first's charge is returned (what a certificate binds),
        and closing it closes the others. ``n``: the number of examples the charged run protects (each
        budget's δ must be below 1/n)."""
        keys = [fingerprint] if isinstance(fingerprint, str) else list(dict.fromkeys(fingerprint))
        if not keys:
            raise ValueError("reserve needs at least one budget")
        text = event_text(event)  # refuses an event dptune cannot store or its ledger would refuse, before the lock
        def body(con: DbCon) -> int:
            for key in sorted(keys):  # each budget's row locked, in one order (no deadlock between two reservations)
                con.execute("SELECT 1 FROM budgets WHERE fingerprint=?" + self._backend.lock, (key,)).fetchall()
            first: int | None = None
            for key in keys:
                row_id = self._reserve_one(con, key, name, event, text, n, group=first)
                first = row_id if first is None else first
            assert first is not None
            return first

        return self._transact(body)

    def _reserve_one(self, con: DbCon, fingerprint: str, name: str, event: de.DpEvent, text: str,
                     n: int | None, group: int | None) -> int:
        """One budget's checks and charge row, inside the caller's transaction."""
        row = con.execute("SELECT epsilon, delta, label, dataset_id, records FROM budgets WHERE fingerprint=?",
                          (fingerprint,)).fetchone()
        if row is None:
            raise ConfigError("budget", f"this dataset has no privacy budget in {self.path}",
                              f"open one: {python_m('dptune.cli.ledger')} new-budget --ledger {self.path} --space SPACE "
                              "--epsilon E --delta D (or pass --budget-epsilon)")
        budget_eps, budget_delta = float(row[0]), float(row[1])
        name_of = f"{row[2] or 'dataset'} (id {row[3]})"
        smallest_n = min(x for x in (n, row[4], math.inf) if x is not None)
        if math.isfinite(smallest_n) and budget_delta >= 1.0 / smallest_n:
            raise BudgetExceeded(
                "budget.delta", f"the budget of {name_of} has δ = {budget_delta:g}, not below 1/n = "
                f"{1.0 / smallest_n:.3g}: a mechanism that publishes a random example in the clear meets it",
                f"lower it: {python_m('dptune.cli.ledger')} set-budget --ledger {self.path} --dataset-id {row[3]} "
                f"--epsilon {budget_eps:g} --delta {10 ** math.floor(math.log10(0.1 / smallest_n)):g}")
        spent = self._spent(con, fingerprint)
        total_eps = composed_epsilon([*spent, event], budget_delta)
        if total_eps > budget_eps:
            spent_eps = composed_epsilon(spent, budget_delta)
            raise BudgetExceeded(
                "budget",
                f"this charge would bring {name_of} to ε = {total_eps:.4g} (δ = {budget_delta:g}, RDP "
                f"composition), over its budget ε = {budget_eps:g} (already spent ε = {spent_eps:.4g})",
                "lower the search's cost (larger noise_multiplier lower bound, fewer mean trials, more score "
                + (f"noise); a team's budget is its owner's to raise (a member of {ADMIN_ROLE}), if the team decides to"
                   if self.location.is_postgres else
                   f"noise) or raise the budget with `{python_m('dptune.cli.ledger')} set-budget`"),
            )
        eps_alone = composed_epsilon([event], budget_delta)
        # who: a team ledger's database writes the login itself (a trigger); a file ledger, this machine's user
        login = "" if self.location.is_postgres else ", login"
        return con.insert_id(
            f"INSERT INTO charges (fingerprint, name, event, epsilon, status, created, token, event_sha256, "
            f"group_id{login}) VALUES (?, ?, ?, ?, 'reserved', ?, ?, ?, ?{', ?' if login else ''})",
            (fingerprint, name, text, eps_alone, time.time(), secrets.token_hex(16), event_sha256(event), group,
             *(() if self.location.is_postgres else (getpass.getuser(),))))

    def _close(self, charge_id: int, status: str) -> None:
        def body(con: DbCon) -> None:
            row = con.execute("SELECT status FROM charges WHERE id=?" + self._backend.lock, (charge_id,)).fetchone()
            if row is None:
                raise KeyError(f"no charge {charge_id}")
            if row[0] != "reserved":
                if row[0] == status:
                    return  # idempotent (a resumed search commits once)
                raise ValueError(f"charge {charge_id} is already {row[0]}")
            # the charges the same reservation made on the other budgets the data overlaps close with it
            con.execute("UPDATE charges SET status=?, closed=? WHERE (id=? OR group_id=?) AND status='reserved'",
                        (status, time.time(), charge_id, charge_id))

        if self.location.is_postgres:  # a finished search's release survives a server restart or failover
            with close_refused(self, charge_id, status):
                patiently(self, lambda: self._transact(body))
        else:
            self._transact(body)

    def commit(self, charge_id: int) -> None:
        self._close(charge_id, "committed")

    def abort(self, charge_id: int) -> None:
        """Only for a charge whose search provably never touched data (e.g. failed before any trial)."""
        self._close(charge_id, "aborted")

    _CHARGE_COLUMNS = "id, fingerprint, name, event, epsilon, status, created, token"

    def _charge(self, r: tuple) -> Charge:
        return Charge(r[0], r[1], r[2], read_event(r[0], r[3], where=str(self.path)), r[4], r[5], r[6], r[7])

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
        with self._session() as con:
            return composed_epsilon(self._spent(con, fingerprint), delta)

    def fingerprints(self) -> list[str]:
        rows = self._read("SELECT fingerprint FROM budgets UNION SELECT fingerprint FROM charges")
        return sorted(r[0] for r in rows)

