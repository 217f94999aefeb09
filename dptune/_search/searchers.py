"""Searchers: how trial configs are chosen. One record per searcher, one catalogue.

A searcher says whether it is adaptive (its configs depend on earlier private scores: Papernot–Steinke
random stopping does not cover it, rule 7), how many private score releases one trial makes (each is
charged), and builds its Ray Tune search algorithm. Random search needs none: its configs are the sealed
draw's i.i.d. samples, run as a grid over trial indices.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dptune.config import SEARCHERS as CONFIG_SEARCHERS
from dptune.config import SearchSpace

__all__ = ["SEARCHERS", "Searcher", "searcher"]


@dataclass(frozen=True)
class Searcher:
    name: str
    adaptive: bool
    score_releases_per_trial: int
    build: Callable[[SearchSpace, int], Any] | None  # (space, 63-bit seed) -> Tune search algorithm

    def search_alg(self, space: SearchSpace, seed: int) -> Any:
        return None if self.build is None else self.build(space, seed)


def _tpe(space: SearchSpace, seed: int) -> Any:
    from optuna.samplers import TPESampler
    from ray.tune.search.optuna import OptunaSearch

    class _FinalOnlyOptunaSearch(OptunaSearch):  # type: ignore[misc]
        """Optuna sees only a trial's final (noised, charged) score: a mid-trial checkpoint report
        carries no score and must not reach the sampler (Ray would raise on the missing metric)."""

        def on_trial_result(self, trial_id: str, result: dict[str, Any]) -> None:
            return None

    # OptunaSearch(sampler=...) ignores its own seed: the sampler is seeded (from the sealed draw)
    return _FinalOnlyOptunaSearch(space=dict(space.space), metric="score", mode="max",
                                  sampler=TPESampler(seed=seed % (2**32)))


SEARCHERS: dict[str, Searcher] = {
    "random": Searcher("random", adaptive=False, score_releases_per_trial=1, build=None),
    "tpe": Searcher("tpe", adaptive=True, score_releases_per_trial=1, build=_tpe),
    # the scaled searcher's trials are fixed before any runs (one per learning-rate candidate, in the sealed
    # draw, run as a grid like random search); only its choice depends on their scores: composed accounting
    "scaled": Searcher("scaled", adaptive=False, score_releases_per_trial=1, build=None),
}
assert set(SEARCHERS) == set(CONFIG_SEARCHERS), "config.SEARCHERS and the catalogue must agree"


def searcher(name: str) -> Searcher:
    return SEARCHERS[name]
