"""Empirical privacy audits of dptune: a developer tool (``bench/audit.py``, ``tests/test_audit.py``); no search,
release or CLI uses it.

Modules: ``_bound`` (guesses → ε lower bound, pure math).
"""

from dptune.audit._bound import (
    Audit,
    Guesses,
    audit_epsilon,
    epsilon_lower_bound,
    guess_grid,
    guesses,
    p_value,
)

__all__ = ["Audit", "Guesses", "audit_epsilon", "epsilon_lower_bound", "guess_grid", "guesses", "p_value"]
