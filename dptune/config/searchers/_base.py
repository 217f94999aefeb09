"""The searcher interface: how a search chooses its trials, and what it needs of its space and its charge."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

if TYPE_CHECKING:  # the config layer hands its spaces in; types only
    from dptune.config.schema import SearchSpace

__all__ = ["Searcher"]


class Searcher(abc.ABC):
    """One way of choosing trials (the shape of Optuna's ``BaseSampler``, with the privacy facts the validators
    ask). A subclass sets its class attributes and overrides the hooks it needs, and is registered once
    (``dptune.config.searchers.register``); every list of searcher names (schema check, CLI ``choices``) comes from the
    registry.

    Every searcher's trials run the noise-scaled transfer when the space plans its final run
    (``privacy.search_share``: ``accounting.TransferPlan``); a searcher does not see it.
    """

    name: ClassVar[str]
    # its configs depend on earlier private scores: Papernot-Steinke random stopping does not cover it (rule 7)
    adaptive: ClassVar[bool] = False
    # the accounting modes valid for it (search.accounting)
    accounting: ClassVar[tuple[str, ...]] = ("random_stopping", "composed", "filter")
    # its trials are fixed before any runs (``candidates``), each run once: a noisy max may pick among them
    fixed_candidates: ClassVar[bool] = False
    # it plans the final run by construction: privacy.search_share (and target_epsilon) required
    needs_final_plan: ClassVar[bool] = False
    summary: ClassVar[str] = ""  # one line for docs and verdicts

    def check(self, space: SearchSpace) -> None:
        """This searcher's own rules on a space (ConfigError naming the field and the fix); run by
        ``config.check_space`` after the rules every space obeys. None by default."""
        return None

    def candidates(self, space: SearchSpace) -> tuple[dict[str, Any], ...]:
        """The fixed trials (final-run params), in order; only for ``fixed_candidates`` searchers."""
        return ()

    def sample(self, space: SearchSpace, rng: np.random.Generator) -> dict[str, Any]:
        """One trial's params, drawn into the sealed draw before anything runs ({}: the searcher chooses while
        running, from the sampler below)."""
        return {}

    def sampler(self, space: SearchSpace, seed: int) -> Any:
        """An Optuna sampler that chooses trials while the search runs, seeded from the draw's 128-bit ``sampler``
        stream; None when the draw fixes every trial."""
        return None
