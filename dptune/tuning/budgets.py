"""Which budgets a search is charged to (``python -m dptune.search``, ``dptune.search``): those whose records its
data holds, or one opened by ``--budget-epsilon`` for data that resembles no budgeted set; anything else is refused
(exit 2, nothing charged) until the curator's explicit ``python -m dptune.cli.ledger new-budget`` or ``adopt``. The test
of what a dataset is lives in :mod:`dptune.ledger._budgets`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from dptune.errors import ConfigError, python_m
from dptune.ledger import Ledger, adopt_identity, budget_match, open_budget

__all__ = ["budget_keys"]


class SearchRequest(Protocol):
    """What choosing a search's budgets reads of ``tuning.driver.SearchRequest`` (a protocol: no import cycle)."""

    @property
    def space(self) -> Any: ...

    @property
    def budget_epsilon(self) -> float | None: ...

    @property
    def budget_delta(self) -> float | None: ...


def budget_keys(req: SearchRequest, ledger: Ledger, data: Any, fingerprint: str,
                say: Callable[[str], None]) -> list[str]:
    """Every budget this dataset is charged to: those whose records it holds, by content (whatever its ids or
    format) and, within those, by record id. ``--budget-epsilon`` opens one only for data that holds no budget's
    records and shares no budget's record ids; anything else is the explicit act of ``python -m dptune.cli.ledger
    new-budget`` (or ``adopt``, for a changed copy of a budget's records)."""
    found = budget_match(ledger, data, fingerprint)
    if data.record_ids is None:
        say("  note: this table declares no dataset.id_column: the ledger knows its records by their content only "
            "(a row whose values change beyond a small edit is a new record to it). Declare the column that "
            "identifies each record.")
    for key in found.legacy:
        adopt_identity(ledger, key, data)
    for key in found.by_content:
        say(f"  this data holds the records of the budgeted {ledger.label(key)} (known by their content, whatever "
            "their ids or format): charged to its budget")
    if found.overlapped and found.covered:
        if len(found.overlapped) > 1:
            say("  this data overlaps several budgeted datasets; each is charged: "
                + "; ".join(ledger.label(k) for k in found.overlapped))
        return found.overlapped
    fix = (f"open its budget explicitly: {python_m('dptune.cli.ledger')} new-budget --ledger {ledger.path} "
           f"--space {req.space.source or 'SPACE'} --epsilon E --delta D (it lists the existing budgets)")
    if found.overlapped:
        raise ConfigError("--budget-epsilon" if req.budget_epsilon is not None else "budget",
                          "this data holds records of the budgeted "
                          + "; ".join(ledger.label(k) for k in found.overlapped)
                          + " and records in no budget: no budget is opened for it implicitly; nothing was charged",
                          fix + "; its searches are then charged to those too")
    if found.by_ids:  # its ids are a budget's, its content is not: a changed copy, or other data with alike ids
        raise _ids_alike(req, ledger, found.by_ids)
    if req.budget_epsilon is None:
        raise ConfigError("--budget-epsilon", f"this dataset has no privacy budget in {ledger.path}",
                          "pass --budget-epsilon E (and --budget-delta) once, or " + fix)
    try:
        key = open_budget(ledger, data, req.budget_epsilon, req.budget_delta or req.space.privacy.delta,
                          label=req.space.dataset.name)
    except ConfigError as e:  # the ledger's checks, under the flags that set the values
        raise e.renamed({"--epsilon": "--budget-epsilon", "--delta": "--budget-delta"}.get(e.field, e.field)) from e
    say(f"  opened a privacy budget for this dataset: {ledger.label(key)}, epsilon = {req.budget_epsilon:g}")
    return [key]


def _ids_alike(req: SearchRequest, ledger: Ledger, keys: list[str]) -> ConfigError:
    """Data that shares record ids with budgets but none's content: which it is, only the curator can say."""
    space = req.space.source or "SPACE"
    labels = "; ".join(ledger.label(k) for k in keys)
    return ConfigError(
        "--budget-epsilon" if req.budget_epsilon is not None else "budget",
        f"this data shares record ids with the budgeted {labels} but not their content (a feature column added, or "
        "values changed beyond a small edit, or other data whose ids merely look alike): no budget is opened for it "
        "implicitly and it is not charged to that one unasked; nothing was charged",
        f"if these are its records, charge them to its budget: {python_m('dptune.cli.ledger')} adopt --ledger "
        f"{ledger.path} --space {space} --dataset-id {ledger.dataset_id(keys[0])}; if it is other data, open its "
        f"own budget: {python_m('dptune.cli.ledger')} new-budget --ledger {ledger.path} --space {space} --epsilon E "
        "--delta D")
