"""The Tune search algorithm of a space's searcher (``dptune.config.searchers``, the registry): random search and
the scaled searcher need none (their configs are the sealed draw's, run as a grid over trial indices); a
searcher that chooses while running gives an Optuna sampler, wrapped here for Ray Tune."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dptune.config import SearchSpace
from dptune.config.searchers import searcher

if TYPE_CHECKING:
    from dptune.tuning.draw import Draw

__all__ = ["search_alg"]


def search_alg(space: SearchSpace, draw: Draw) -> Any:
    """The Tune search algorithm, its sampler seeded from the draw's own ``sampler`` stream (128 bits;
    independent of the ``searcher`` stream that keys the adaptive trials' seeds); None for a fixed draw."""
    sampler = searcher(space.searcher).sampler(space, draw.stream_seed("sampler"))
    if sampler is None:
        return None
    from ray.tune.search.optuna import OptunaSearch

    class _FinalOnlyOptunaSearch(OptunaSearch):  # type: ignore[misc]
        """Optuna sees only a trial's final (noised, charged) score: a mid-trial checkpoint report
        carries no score and must not reach the sampler (Ray would raise on the missing metric)."""

        def on_trial_result(self, trial_id: str, result: dict[str, Any]) -> None:
            return None

    # OptunaSearch(sampler=...) ignores its own seed: the sampler carries the draw's
    return _FinalOnlyOptunaSearch(space=dict(space.space), metric="score", mode="max", sampler=sampler)
