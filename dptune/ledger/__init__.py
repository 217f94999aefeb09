"""Privacy ledger: per-dataset budgets and every charge (see :mod:`dptune.ledger._store`).

CLI: ``python -m dptune.ledger {show,set-budget} --ledger FILE``.
"""

from dptune.ledger._store import BudgetExceeded, Charge, Ledger, default_ledger_path, event_sha256

__all__ = ["BudgetExceeded", "Charge", "Ledger", "default_ledger_path", "event_sha256"]
