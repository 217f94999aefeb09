"""TPE (Optuna's ``TPESampler``): adaptive, so charged by composition only (rule 7)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, cast

from dptune.config.searchers._base import Searcher

if TYPE_CHECKING:
    from dptune.config.schema import SearchSpace

__all__ = ["TPESearcher", "seed_words", "tpe_startup_trials"]


def seed_words(seed: int) -> list[int]:
    """A 128-bit seed as the four 32-bit words numpy's legacy ``RandomState.seed`` takes (init_by_array:
    every bit counts; an int seed there is cut to 32 bits)."""
    return [(seed >> (32 * i)) & 0xFFFFFFFF for i in range(4)]


def tpe_startup_trials(trials: float) -> int:
    """TPE's random start: a third of the (composed, fixed) trial count, at least 2. Optuna's default of 10
    would make a search of fewer than 11 trials a random search charged as an adaptive one."""
    return max(2, round(trials / 3))


class TPESearcher(Searcher):
    name: ClassVar[str] = "tpe"
    adaptive: ClassVar[bool] = True
    accounting: ClassVar[tuple[str, ...]] = ("composed",)
    summary: ClassVar[str] = "Optuna's TPE: each trial chosen from the earlier (noised) scores; composed accounting"

    def sampler(self, space: SearchSpace, seed: int) -> Any:
        import optuna
        from optuna.samplers import TPESampler

        optuna.logging.disable_default_handler()  # Optuna's INFO lines carry trial numbers, scores and times
        optuna.logging.set_verbosity(optuna.logging.ERROR)
        # seeded from the sealed draw's 128-bit sampler stream, all of it (TPESampler hands the seed to
        # RandomState.seed, which takes a word array)
        return TPESampler(seed=cast(int, seed_words(seed)), n_startup_trials=tpe_startup_trials(space.privacy.mean))
