"""Privacy ledger: per-dataset budgets and every charge (see :mod:`dptune.ledger._store`); which budgets a
dataset falls under, by its records' content and, within a dataset, their ids (:mod:`dptune.ledger._budgets`).

CLI: ``python -m dptune.cli.ledger {check,history,upgrade,show,set-budget,new-budget,adopt,setup-team,migrate} [--ledger FILE|URL]``.
"""

from dptune.ledger._backend import LedgerUnavailable
from dptune.ledger._budgets import (
    SAME_DATASET_SHARE,
    BudgetMatch,
    adopt_identity,
    adopt_records,
    budget_key,
    budget_match,
    open_budget,
    same_records_keys,
)
from dptune.ledger._check import Finding, check
from dptune.ledger._event_rules import UnreadableCharge
from dptune.ledger._history import budget_changes, history
from dptune.ledger._location import LedgerLocation, is_url, ledger_location
from dptune.ledger._migrate import migrate
from dptune.ledger._pg_schema import ADMIN_ROLE, CURATOR_ROLE, grant_roles
from dptune.ledger._postgres import setup_missing
from dptune.ledger._postgres import upgrade as upgrade_schema
from dptune.ledger._store import BudgetExceeded, Charge, Ledger, default_ledger_path, event_sha256

__all__ = ["ADMIN_ROLE", "SAME_DATASET_SHARE", "BudgetExceeded", "BudgetMatch", "CURATOR_ROLE", "Charge", "Finding", "Ledger",
           "LedgerLocation", "LedgerUnavailable", "UnreadableCharge", "adopt_identity", "adopt_records",
           "budget_changes", "budget_key", "budget_match", "check", "default_ledger_path", "event_sha256",
           "grant_roles", "history", "is_url", "ledger_location", "migrate", "open_budget", "same_records_keys",
           "setup_missing", "upgrade_schema"]
