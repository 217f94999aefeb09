"""The one release of a trial: its validation score, through a named Gaussian mechanism."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["ScoreRelease"]


@dataclass(frozen=True)
class ScoreRelease:
    """Gaussian mechanism on the validation correct-count, charged by ``dptune.accounting.score_event``.

    Sensitivity 1: adding, removing or replacing one validation example changes the number of correctly
    classified examples by at most 1, so noise of std ``score_noise`` on the count is the Gaussian mechanism
    with noise multiplier ``score_noise``. The released score is the noised count / n_val (n_val public).
    ``score_noise`` None: the validation split was declared public and the raw accuracy is released.
    A diverged trial releases −∞ (decided from its noised parameters only: post-processing)."""

    score_noise: float | None

    def release(self, correct: int, n_val: int, rng: np.random.Generator, diverged: bool) -> tuple[float, float | None]:
        """The released score, and the std of the Gaussian actually drawn for it (None: no draw)."""
        if diverged:
            return -math.inf, None
        if self.score_noise is None:
            return correct / n_val, None
        noise = float(rng.normal(0.0, self.score_noise))
        return (correct + noise) / n_val, self.score_noise
