"""Searchers, registered once: random search, TPE and the scaled searcher (:class:`Searcher` and its hooks).

A new searcher is one module here (a :class:`Searcher` subclass) and one ``register`` line below; the schema
check, the accounting rules (rule 7), the draw, the Tune search algorithm and the CLI's ``--searcher`` choices
all ask the registry.
"""

from __future__ import annotations

from dptune.config.searchers._base import Searcher
from dptune.config.searchers._random import RandomSearcher
from dptune.config.searchers._scaled import ScaledSearcher
from dptune.config.searchers._tpe import TPESearcher, seed_words, tpe_startup_trials
from dptune.errors import ConfigError

__all__ = ["SEARCHERS", "Searcher", "register", "searcher", "seed_words", "tpe_startup_trials"]

SEARCHERS: dict[str, Searcher] = {}


def register(s: Searcher) -> Searcher:
    """Add a searcher. Rule 7 reads its class attributes, so they are checked against what its hooks do: one that
    chooses while running (an Optuna ``sampler``) sees earlier private scores and must be adaptive; one with fixed
    candidates runs exactly them, so its K is fixed: composed accounting only."""
    if s.name in SEARCHERS:
        raise ValueError(f"searcher {s.name!r} is registered twice")
    if type(s).sampler is not Searcher.sampler and not s.adaptive:
        raise ValueError(f"searcher {s.name!r} chooses while running (it overrides sampler), so its trials depend on "
                         "earlier private scores: set adaptive = True (rule 7: composed accounting only)")
    if (s.adaptive or s.fixed_candidates) and "random_stopping" in s.accounting:
        raise ValueError(f"searcher {s.name!r} is {'adaptive' if s.adaptive else 'a fixed-candidates searcher'}: "
                         "random stopping does not cover it; set accounting = ('composed',)")
    SEARCHERS[s.name] = s
    return s


def searcher(name: str) -> Searcher:
    if name not in SEARCHERS:
        raise ConfigError("search.searcher", f"unknown searcher {name!r}", f"use one of: {', '.join(SEARCHERS)}")
    return SEARCHERS[name]


register(RandomSearcher())
register(TPESearcher())
register(ScaledSearcher())
