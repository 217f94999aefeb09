"""Random search: i.i.d. draws from the space's distributions, fixed in the sealed draw before anything runs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from dptune.config.distributions import sample_params
from dptune.config.searchers._base import Searcher

if TYPE_CHECKING:
    from dptune.config.schema import SearchSpace

__all__ = ["RandomSearcher"]


class RandomSearcher(Searcher):
    name: ClassVar[str] = "random"
    summary: ClassVar[str] = ("i.i.d. configs from the space, fixed before any trial runs: covered by random stopping "
                              "(K secret) or composed accounting")

    def sample(self, space: SearchSpace, rng: np.random.Generator) -> dict[str, Any]:
        return sample_params(dict(space.space), rng)
