"""Which budgets a dataset falls under: budgets are keyed on the privacy unit, the record.

Every record has an id: a table's declared ``dataset.id_column``, a built-in's index in its official split
(``mnist/train/17``, ``digits/5``), an imagefolder image's path relative to the dataset folder. The ledger
keeps only keyed digests of ids (HMAC-SHA256 under the curator key, 128 bits): an id is often a guessable
name. A careless copy (pixels +1/255, a column jittered, a column added or renamed, a pandas index saved)
keeps its ids, so it falls under the budget of the data it copies; a union of budgeted datasets falls
under each of them, and each is charged (``Ledger.reserve`` with several keys: all or none).

A table without ``dataset.id_column`` can only be known by its rows' content (each row's digest is its id):
a copy with any value changed is then new data to the ledger (the search says so). Content near-matches
(``SAME_DATASET_SHARE`` of the examples' digests) stay an advisory: data that shares no id with a budget but
resembles it never gets a budget implicitly (``--budget-epsilon``): ``python -m dptune.ledger new-budget``,
which lists the existing budgets, is the explicit act.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from dptune.ledger._store import Ledger

__all__ = ["BudgetMatch", "adopt_ids", "budget_key", "budget_match", "match", "open_budget", "record_id_digests", "record_ids"]

SAME_DATASET_SHARE = 0.9  # content: sharing >= 90 % of the examples' digests with a budgeted dataset
ID_BYTES = 16  # a record id's keyed digest: HMAC-SHA256 under the curator key, truncated to 128 bits


class Records(Protocol):
    """What the ledger needs of a dataset (``dptune.data.Splits`` is one)."""

    @property
    def record_ids(self) -> tuple[str, ...] | None: ...

    def example_digests(self) -> list[bytes]: ...


@dataclass(frozen=True)
class BudgetMatch:
    """The budgets a dataset falls under. Keys are curator-side (``Ledger.label`` names them)."""

    overlapped: list[str]  # budgets sharing at least one record, most shared first: each is charged
    covered: bool  # every record of the dataset is in one of them
    near: list[str]  # budgets sharing no record whose content nearly matches (advisory)
    legacy: list[str]  # overlapped budgets opened before record ids (matched by content; they adopt the ids)


def record_ids(data: Records) -> list[str]:
    """The dataset's record ids; a table without an id column: each row's content digest."""
    if data.record_ids is not None:
        return list(data.record_ids)
    return ["content/" + d.hex() for d in data.example_digests()]


def record_id_digests(ledger: Ledger, ids: Iterable[str]) -> list[bytes]:
    """Keyed digests of record ids as budgets store them (sorted, distinct)."""
    key = bytes.fromhex(ledger.key_path.read_text().strip())
    return sorted({hmac.new(key, b"dptune-record-id/1\0" + str(i).encode(), hashlib.sha256).digest()[:ID_BYTES]
                   for i in ids})


def match(ledger: Ledger, fingerprint: str, id_digests: Sequence[bytes], digests: Sequence[bytes]) -> BudgetMatch:
    """Overlap is by record ids: a dataset sharing even one record with a budgeted one is charged to that
    budget too. A budget opened before record ids existed (no ids stored) matches as it did then: the same
    fingerprint, or ``SAME_DATASET_SHARE`` of the examples' content shared."""
    mine, content = set(id_digests), set(digests)
    found: list[tuple[int, str]] = []
    near: list[str] = []
    union: set[bytes] = set()
    legacy: list[str] = []
    for key, id_blob, blob in ledger._read("SELECT fingerprint, ids, digests FROM budgets ORDER BY created"):
        theirs = _chunks(blob, 32) if blob is not None else set()
        share = len(content & theirs) / max(1, min(len(content), len(theirs)))
        if id_blob is not None:
            shared = mine & _chunks(id_blob, ID_BYTES)
            if shared:
                found.append((len(shared), str(key)))
                union |= shared
            elif share >= SAME_DATASET_SHARE:
                near.append(str(key))
        elif key == fingerprint or (theirs and share >= SAME_DATASET_SHARE):
            found.append((len(mine), str(key)))
            legacy.append(str(key))
    found.sort(key=lambda t: -t[0])  # stable: equal overlaps keep the older budget first
    return BudgetMatch([k for _, k in found], bool(legacy) or (bool(mine) and mine <= union), near, legacy)


def adopt_ids(ledger: Ledger, key: str, data: Records) -> None:
    """A budget opened before record ids, matched by content, takes ``data``'s record ids: from then on its
    careless copies are caught by id as well."""
    with ledger._write() as con:
        con.execute("UPDATE budgets SET ids=? WHERE fingerprint=? AND ids IS NULL",
                    (b"".join(record_id_digests(ledger, record_ids(data))), key))


def budget_match(ledger: Ledger, data: Records, fingerprint: str) -> BudgetMatch:
    return match(ledger, fingerprint, record_id_digests(ledger, record_ids(data)), data.example_digests())


def budget_key(ledger: Ledger, data: Records) -> str:
    """The curator-side key of the budget opened for exactly ``data``'s records: a digest of its keyed record
    ids (not of its content: the same pixels under other ids are other records)."""
    return "ids:" + hashlib.sha256(b"".join(record_id_digests(ledger, record_ids(data)))).hexdigest()


def open_budget(ledger: Ledger, data: Records, epsilon: float, delta: float, label: str) -> str:
    """Open the budget of ``data``, storing its keyed record ids and content digests; returns its key."""
    digests = data.example_digests()
    key = budget_key(ledger, data)
    ledger.set_budget(key, epsilon, delta, label=label, digests=digests, n=len(digests),
                      ids=record_id_digests(ledger, record_ids(data)))
    return key


def _chunks(blob: bytes, size: int) -> set[bytes]:
    return {bytes(blob[i:i + size]) for i in range(0, len(blob), size)}
