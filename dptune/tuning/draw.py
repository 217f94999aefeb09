"""The sealed draw: K and the K i.i.d. trial configs, sampled before any trial touches data.

Randomness comes from the OS (``secrets``): K, the trial configs and every trial's seed (which drives
DP-SGD's and the score's noise) must be unpredictable to anyone but the curator, or the random-stopping
and Gaussian-noise guarantees do not hold. Every secret is 128 bits wide: a 31-bit trial seed could be
enumerated (≈ 5 core-hours) to recover the noise of a released score and so the exact validation count.
``--seed`` makes a run reproducible and is labelled NOT PRIVATE. ``DPTUNE_TEST_DRAW_SEED`` (a test hook,
not a user option) fixes the draw seed, and is labelled NOT PRIVATE the same way.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dptune.accounting import StoppingRule
from dptune.config import SearchSpace
from dptune.config.searchers import searcher
from dptune.rundir import write_private

__all__ = ["Draw", "make_draw"]

TEST_HOOK = "DPTUNE_TEST_DRAW_SEED"
SECRET_BITS = 128
# "searcher" keys the adaptive searchers' trial seeds; "sampler" seeds the adaptive sampler (TPE) itself: two
# independent 128-bit streams (a sampler seeded from a slice of the trial-seed key would share its bits)
_STREAMS = {"k": 0, "params": 1, "subsample": 2, "trial_seed": 3, "searcher": 4, "selection": 5, "sampler": 6}


def _derived(draw_seed: int, *key: int) -> int:
    """A 128-bit value derived from the draw seed (independent per key: numpy SeedSequence)."""
    words = np.random.SeedSequence([draw_seed, *key]).generate_state(SECRET_BITS // 32, np.uint32)
    return int.from_bytes(words.astype("<u4").tobytes(), "little")


@dataclass(frozen=True)
class Draw:
    """Everything random about a search, fixed before it starts. Sealed: never released."""

    k: int
    draw_seed: int
    trials: list[dict[str, Any]]  # per trial: {"index", "params", "seed"}
    stopping: dict[str, Any]
    reproducible: bool

    def stream_seed(self, name: str) -> int:
        """128-bit seed of one of the draw's secret streams (``subsample``, ``searcher`` (adaptive trials'
        seeds), ``sampler`` (the adaptive sampler's own randomness), ``selection``)."""
        return _derived(self.draw_seed, _STREAMS[name])

    def save(self, path: Path) -> None:
        write_private(path, json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: Path) -> Draw:
        return cls(**json.loads(path.read_text()))


def make_draw(space: SearchSpace, rule: StoppingRule, seed: int | None = None) -> Draw:
    """Draw K once from ``rule`` and each trial's config from the space's searcher (``Searcher.sample``: i.i.d.
    for random search; none for an adaptive one, which chooses while running). A searcher with fixed
    candidates (the scaled searcher) runs each once: K = their number, which its composed rule fixes too."""
    sr = searcher(space.searcher)
    grid = [dict(c) for c in sr.candidates(space)] if sr.fixed_candidates else None
    hook = os.environ.get(TEST_HOOK)
    if hook is not None:
        draw_seed, reproducible = int(hook), True
    elif seed is not None:
        draw_seed, reproducible = int(seed), True
    else:
        draw_seed, reproducible = secrets.randbits(SECRET_BITS), False
    k = rule.draw_k(np.random.default_rng([draw_seed, _STREAMS["k"]]))
    if grid is not None and len(grid) != k:
        raise ValueError(f"{len(grid)} fixed trials, but the stopping rule runs {k}")
    trials = []
    for i in range(k):
        rng = np.random.default_rng([draw_seed, _STREAMS["params"], i])
        params = dict(grid[i]) if grid is not None else sr.sample(space, rng)
        # each trial's entropy: fresh from the OS (private runs), or derived (reproducible runs only)
        entropy = _derived(draw_seed, _STREAMS["trial_seed"], i) if reproducible else secrets.randbits(SECRET_BITS)
        trials.append({"index": i, "params": params, "seed": entropy})
    return Draw(k=k, draw_seed=draw_seed, trials=trials, stopping=rule.describe(), reproducible=reproducible)
