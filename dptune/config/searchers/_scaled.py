"""The scaled searcher: every combination of the space's categorical candidates, each run once at the final run's
update noise (Panda et al., ICML 2024), one selection among them; composed accounting."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any, ClassVar

import optuna.distributions as od

from dptune.config.searchers._base import Searcher
from dptune.errors import ConfigError

if TYPE_CHECKING:
    from dptune.config.schema import SearchSpace

__all__ = ["ScaledSearcher"]


class ScaledSearcher(Searcher):
    name: ClassVar[str] = "scaled"
    accounting: ClassVar[tuple[str, ...]] = ("composed",)  # its choice depends on the trials' private scores
    fixed_candidates: ClassVar[bool] = True
    needs_final_plan: ClassVar[bool] = True
    summary: ClassVar[str] = ("every combination of the space's candidates once, at the final run's update noise; "
                              "a noisy max or the best noised score picks; composed accounting")

    def check(self, space: SearchSpace) -> None:
        if not space.space:
            raise ConfigError("space", "the scaled searcher needs candidates", "write e.g. space.learning_rate: "
                              "{type: categorical, choices: [0.2, 0.4, 0.8, 1.6, 3.2]}")
        for key, dist in sorted(space.space.items()):
            if not isinstance(dist, od.CategoricalDistribution):
                raise ConfigError(f"space.{key}", "the scaled searcher tries every combination of its candidates "
                                  "once", f"write space.{key} as categorical choices")
        size = len(self.candidates(space))
        if space.privacy.mean != size:
            raise ConfigError("privacy.mean", f"{space.privacy.mean:g} trials, but the scaled searcher runs each of "
                              f"its {size} candidates (every combination of the space's choices) once",
                              f"set privacy.mean: {size}")

    def candidates(self, space: SearchSpace) -> tuple[dict[str, Any], ...]:
        """Keys in sorted order, each key's choices in the file's order."""
        keys = sorted(space.space)
        choices = [list(space.space[k].choices) for k in keys]  # type: ignore[attr-defined]
        return tuple(dict(zip(keys, combo, strict=True)) for combo in itertools.product(*choices))
