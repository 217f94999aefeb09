"""Searchers, registered once: random search, TPE and the scaled searcher (:class:`Searcher` and its hooks).

A new searcher is one module here (a :class:`Searcher` subclass) and one ``register`` line below; the schema
check, the accounting rules (rule 7), the draw, the Tune search algorithm and the CLI's ``--searcher`` choices
all ask the registry.
"""

from __future__ import annotations

from dptune.errors import ConfigError
from dptune.searchers._base import Searcher
from dptune.searchers._random import RandomSearcher
from dptune.searchers._scaled import ScaledSearcher
from dptune.searchers._tpe import TPESearcher, seed_words, tpe_startup_trials

__all__ = ["SEARCHERS", "Searcher", "register", "searcher", "seed_words", "tpe_startup_trials"]

SEARCHERS: dict[str, Searcher] = {}


def register(s: Searcher) -> Searcher:
    if s.name in SEARCHERS:
        raise ValueError(f"searcher {s.name!r} is registered twice")
    SEARCHERS[s.name] = s
    return s


def searcher(name: str) -> Searcher:
    if name not in SEARCHERS:
        raise ConfigError("search.searcher", f"unknown searcher {name!r}", f"use one of: {', '.join(SEARCHERS)}")
    return SEARCHERS[name]


register(RandomSearcher())
register(TPESearcher())
register(ScaledSearcher())
