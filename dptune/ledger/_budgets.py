"""Which budgets a dataset falls under: a budget follows its records, whatever their ids or format.

What identifies a dataset is what the model sees: each record's content signatures (``dptune.data._content``:
its features before any resize or normalisation, never an id column or a label, several signatures a record so
that ±1/255 a pixel or jitter in a table leaves one intact). A dataset holds a budget's records when at least
``SAME_DATASET_SHARE`` of the smaller of the two share a signature; it is then charged to that budget, whatever its
ids, format or file layout: the same table re-keyed or without its id column, digits exported to CSV, MNIST
exported to PNG folders or placed as another split with edited pixels.

Record ids (a table's ``dataset.id_column``, a built-in's ``<name>/<split>/<index>``, an imagefolder's relative
path) name records *within* a dataset: they are namespaced by the dataset's identity, i.e. compared only with the
budgets whose records the data holds by content. So an unrelated table with ids 0..568, or other images in MNIST's
file format, shares no record with a budget whose ids look alike; inside a matched budget, a record whose values
changed beyond a small edit still counts as that budget's by its id.

Ids alone cannot tell a copy whose content changed beyond the signatures (a feature column added to a table, values
jittered far beyond a small edit) from unrelated data whose ids look alike (row numbers 0..568). So data that matches
no budget by content but shares ``SAME_DATASET_SHARE`` of the smaller's record ids with one (``BudgetMatch.by_ids``)
is neither opened a budget implicitly nor charged to that one silently: it is refused until the curator says which
it is, with ``python -m dptune.cli.ledger adopt`` (the same records: the budget takes the data's signatures, so its
searches are charged to it) or ``python -m dptune.cli.ledger new-budget`` (other data: its own budget, which its content
then matches; the id-alike budget is not charged).

A dataset is charged to every budget whose records it holds (``Ledger.reserve`` with several keys: all or none);
it must be covered (``COVERED_SHARE`` of its records in those budgets, by content or id) or it is refused until its
budget is opened explicitly (``python -m dptune.cli.ledger new-budget``). A new budget is never opened implicitly
(``--budget-epsilon``) for data that holds a budget's records.

The ledger keeps only keyed digests (HMAC-SHA256 under the curator key, 128 bits) of ids and signatures: an id is
often a guessable name, a signature a function of private values. Budgets opened by an older dptune (no content
signatures stored) match as they did then (record ids in any namespace, else the exact examples) and adopt the
data's signatures and ids when they match.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from dptune.ledger._pg_schema import admin_only
from dptune.ledger._store import Ledger

__all__ = ["BudgetMatch", "adopt_identity", "adopt_records", "budget_key", "budget_match", "keyed_signatures", "match",
           "open_budget", "record_id_digests", "record_ids", "same_records_keys"]

# Shares of records matched by content (tests/test_content_identity.py measures them): copies (re-keyed, CSV and PNG
# exports, ±1/255 a pixel, small jitter in a table) 0.91-1.0; unrelated data (MNIST's test split against a disjoint
# part of it, digits against digits, other tables, digits against MNIST) at most 0.06. Between, with margin both ways:
SAME_DATASET_SHARE = 0.25
# a dataset in the budgets it matches when this share of its records is theirs (by content or id); else it also
# holds records in no budget and is refused until new-budget opens one for it
COVERED_SHARE = 0.9
ID_BYTES = 16  # a keyed digest (id or signature): HMAC-SHA256 under the curator key, truncated to 128 bits


class Records(Protocol):
    """What the ledger needs of a dataset (``dptune.data.Splits`` is one)."""

    @property
    def record_ids(self) -> tuple[str, ...] | None: ...

    def content_signatures(self) -> list[tuple[bytes, ...]]: ...

    def example_digests(self) -> list[bytes]: ...


@dataclass(frozen=True)
class BudgetMatch:
    """The budgets a dataset falls under. Keys are curator-side (``Ledger.label`` names them)."""

    overlapped: list[str]  # budgets whose records it holds, most shared first: each is charged
    covered: bool  # (nearly) every record of the dataset is in one of them
    by_content: list[str]  # those of them it shares no record id with (known by content alone)
    legacy: list[str]  # overlapped budgets opened before content signatures (they adopt them)
    by_ids: list[str] = dataclasses.field(default_factory=list)  # budgets it shares record ids with but not content


def record_ids(data: Records) -> list[str]:
    """The dataset's record ids; a table without an id column: each row's content digest."""
    if data.record_ids is not None:
        return list(data.record_ids)
    source = getattr(data, "record_digests", None)  # a table's rows in file order (aligned with the signatures)
    return ["content/" + d.hex() for d in (source if source is not None else data.example_digests())]


def _key(ledger: Ledger) -> bytes:
    return ledger.key()


def record_id_digests(ledger: Ledger, ids: Iterable[str]) -> list[bytes]:
    """Keyed digests of record ids as budgets store them (sorted, distinct)."""
    return sorted(set(_id_digests(_key(ledger), ids)))


def _id_digests(key: bytes, ids: Iterable[str]) -> list[bytes]:
    return [hmac.new(key, b"dptune-record-id/1\0" + str(i).encode(), hashlib.sha256).digest()[:ID_BYTES] for i in ids]


def keyed_signatures(ledger: Ledger, signatures: Sequence[tuple[bytes, ...]]) -> list[tuple[bytes, ...]]:
    """Each record's content signatures keyed under the curator key, as budgets store them."""
    key = _key(ledger)
    return [tuple(hmac.new(key, b"dptune-content/1\0" + s, hashlib.sha256).digest()[:ID_BYTES] for s in sigs)
            for sigs in signatures]


def match(ledger: Ledger, data: Records, fingerprint: str) -> BudgetMatch:
    """The budgets whose records ``data`` holds: by content (``SAME_DATASET_SHARE``), then by record id inside those
    (ids are namespaced by the dataset's identity). Budgets opened before content signatures match as they did."""
    key = _key(ledger)
    ids = record_ids(data)
    sigs = keyed_signatures(ledger, data.content_signatures())
    id_digests = _id_digests(key, ids) if len(ids) == len(sigs) else []  # aligned record by record
    n = max(1, len(sigs))
    found: list[tuple[int, str]] = []
    by_content: list[str] = []
    legacy: list[str] = []
    matched: set[int] = set()
    id_alike: list[tuple[int, str]] = []
    rows = ledger._read("SELECT fingerprint, ids, content, records, digests FROM budgets ORDER BY created")
    for budget, id_blob, content_blob, records, digest_blob in rows:
        theirs_ids = _chunks(id_blob, ID_BYTES) if id_blob is not None else set()
        by_id = {i for i, d in enumerate(id_digests) if d in theirs_ids}
        if content_blob is not None:
            theirs = _chunks(content_blob, ID_BYTES)
            hits = {i for i, s in enumerate(sigs) if any(x in theirs for x in s)}
            size = int(records) if records else len(theirs)
            if len(hits) < SAME_DATASET_SHARE * min(n, size):  # other records, or these changed beyond the signatures
                if len(by_id) >= SAME_DATASET_SHARE * min(n, size):
                    id_alike.append((len(by_id), str(budget)))
                continue
            if not by_id:
                by_content.append(str(budget))
        else:  # opened before content signatures: record ids in any namespace, else the exact examples
            hits = set()
            if not by_id and not _legacy_content(budget, fingerprint, digest_blob, id_blob, data):
                continue
            legacy.append(str(budget))
            if not by_id:
                by_id = set(range(n))
        found.append((len(hits | by_id), str(budget)))
        matched |= hits | by_id
    found.sort(key=lambda t: -t[0])  # stable: equal overlaps keep the older budget first
    covered = bool(found) and len(matched) >= COVERED_SHARE * n
    id_alike.sort(key=lambda t: -t[0])
    return BudgetMatch([k for _, k in found], covered, by_content, legacy, [k for _, k in id_alike])


def _legacy_content(budget: str, fingerprint: str, digest_blob: bytes | None, id_blob: bytes | None,
                    data: Records) -> bool:
    """A budget opened before record ids (no ids stored): the same fingerprint, or 90 % of the exact examples."""
    if id_blob is not None:
        return False
    if budget == fingerprint:
        return True
    if digest_blob is None:
        return False
    mine, theirs = set(data.example_digests()), _chunks(digest_blob, 32)
    return len(mine & theirs) >= 0.9 * max(1, min(len(mine), len(theirs)))


def adopt_identity(ledger: Ledger, key: str, data: Records) -> None:
    """A budget opened by an older dptune, matched as it was then, takes ``data``'s content signatures and record
    ids: from then on its copies are known by content, and its ids namespaced by it."""
    args = (_content_blob(ledger, data), b"".join(record_id_digests(ledger, record_ids(data))),
            len(data.content_signatures()), key)
    ledger._transact(lambda con: con.execute("UPDATE budgets SET content=COALESCE(content, ?), ids=COALESCE(ids, ?), "
                                             "records=COALESCE(records, ?) WHERE fingerprint=?", args))


def adopt_records(ledger: Ledger, key: str, data: Records, command: str = "adopt --space SPACE") -> None:
    """The curator's word that ``data`` holds the records of budget ``key`` (``python -m dptune.cli.ledger adopt``): the
    budget takes the data's content signatures and record ids besides its own (its record count is unchanged), so
    the data, and copies of it, are charged to it from then on. On a team ledger, adding to signatures a budget
    already has is for ``dptune_admin`` (a curator may only fill empty ones): a refusal names ``command``."""
    theirs_content = _chunks(_content_blob(ledger, data), ID_BYTES)
    theirs_ids = set(record_id_digests(ledger, record_ids(data)))

    def body(con: Any) -> None:
        row = con.execute("SELECT content, ids FROM budgets WHERE fingerprint=?" + ledger._backend.lock,
                          (key,)).fetchone()
        content = (_chunks(row[0], ID_BYTES) if row[0] is not None else set()) | theirs_content
        ids = (_chunks(row[1], ID_BYTES) if row[1] is not None else set()) | theirs_ids
        con.execute("UPDATE budgets SET content=?, ids=?, records=COALESCE(records, ?) WHERE fingerprint=?",
                    (b"".join(sorted(content)), b"".join(sorted(ids)), len(data.content_signatures()), key))

    with admin_only(ledger, ledger.dataset_id(key), command):
        ledger._transact(body)


def budget_match(ledger: Ledger, data: Records, fingerprint: str) -> BudgetMatch:
    return match(ledger, data, fingerprint)


def budget_key(ledger: Ledger, data: Records) -> str:
    """The curator-side key of the budget opened for exactly ``data``'s records: a digest of its keyed record
    ids and content signatures."""
    h = hashlib.sha256(b"".join(record_id_digests(ledger, record_ids(data))))
    h.update(_content_blob(ledger, data))
    return "ids:" + h.hexdigest()


def same_records_keys(ledger: Ledger, data: Records) -> list[str]:
    """The keys a budget opened for exactly ``data``'s records has: today's, and an older dptune's (ids only)."""
    legacy = "ids:" + hashlib.sha256(b"".join(record_id_digests(ledger, record_ids(data)))).hexdigest()
    return [budget_key(ledger, data), legacy]


def open_budget(ledger: Ledger, data: Records, epsilon: float, delta: float, label: str) -> str:
    """Open the budget of ``data``, storing its keyed record ids and content signatures; returns its key."""
    key = budget_key(ledger, data)
    ledger.set_budget(key, epsilon, delta, label=label, n=len(data.content_signatures()),
                      ids=record_id_digests(ledger, record_ids(data)), content=_content_blob(ledger, data))
    return key


def _content_blob(ledger: Ledger, data: Records) -> bytes:
    return b"".join(sorted({s for sigs in keyed_signatures(ledger, data.content_signatures()) for s in sigs}))


def _chunks(blob: bytes, size: int) -> set[bytes]:
    return {bytes(blob[i:i + size]) for i in range(0, len(blob), size)}
