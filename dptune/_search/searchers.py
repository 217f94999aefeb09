"""Searchers: how trial configs are chosen. One record per searcher, one catalogue.

A searcher says whether it is adaptive (its configs depend on earlier private scores: Papernot–Steinke
random stopping does not cover it, rule 7), how many private score releases one trial makes (each is
charged), and builds its Ray Tune search algorithm. Random search needs none: its configs are the sealed
draw's i.i.d. samples, run as a grid over trial indices.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from dptune.config import SEARCHERS as CONFIG_SEARCHERS
from dptune.config import SearchSpace

if TYPE_CHECKING:
    from dptune._search.draw import Draw

__all__ = ["SEARCHERS", "Searcher", "searcher", "seed_words", "tpe_startup_trials"]


@dataclass(frozen=True)
class Searcher:
    name: str
    adaptive: bool
    score_releases_per_trial: int
    build: Callable[[SearchSpace, int], Any] | None  # (space, 128-bit seed) -> Tune search algorithm

    def search_alg(self, space: SearchSpace, draw: Draw) -> Any:
        """The Tune search algorithm, seeded from the draw's own ``sampler`` stream (128 bits; independent of
        the ``searcher`` stream that keys the adaptive trials' seeds)."""
        return None if self.build is None else self.build(space, draw.stream_seed("sampler"))


def seed_words(seed: int) -> list[int]:
    """A 128-bit seed as the four 32-bit words numpy's legacy ``RandomState.seed`` takes (init_by_array:
    every bit counts; an int seed there is cut to 32 bits)."""
    return [(seed >> (32 * i)) & 0xFFFFFFFF for i in range(4)]


def tpe_startup_trials(trials: float) -> int:
    """TPE's random start: a third of the (composed, fixed) trial count, at least 2. Optuna's default of 10
    would make a search of fewer than 11 trials a random search charged as an adaptive one."""
    return max(2, round(trials / 3))


def _tpe(space: SearchSpace, seed: int) -> Any:
    from optuna.samplers import TPESampler
    from ray.tune.search.optuna import OptunaSearch

    class _FinalOnlyOptunaSearch(OptunaSearch):  # type: ignore[misc]
        """Optuna sees only a trial's final (noised, charged) score: a mid-trial checkpoint report
        carries no score and must not reach the sampler (Ray would raise on the missing metric)."""

        def on_trial_result(self, trial_id: str, result: dict[str, Any]) -> None:
            return None

    import optuna

    optuna.logging.disable_default_handler()  # Optuna's INFO lines carry trial numbers, scores and times
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    # OptunaSearch(sampler=...) ignores its own seed: the sampler is seeded from the sealed draw's 128-bit
    # sampler stream, all of it (TPESampler hands the seed to RandomState.seed, which takes a word array)
    sampler = TPESampler(seed=cast(int, seed_words(seed)), n_startup_trials=tpe_startup_trials(space.privacy.mean))
    return _FinalOnlyOptunaSearch(space=dict(space.space), metric="score", mode="max", sampler=sampler)


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
