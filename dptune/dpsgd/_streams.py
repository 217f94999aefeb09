"""The random streams of one trial, all derived in one place from the trial's secret entropy.

Why the width matters: the streams are a deterministic function of ``config.seed``, so the seed is the
secret behind every noise draw of the trial. A released score noised with a 31-bit seed was attacked by
enumerating all 2^31 seeds, regenerating each candidate's score noise and stripping it off the release.
The seed is therefore ≥ 128 bits of OS entropy, and each stream gets its own child of
``numpy.random.SeedSequence(entropy)`` — not seed, seed+1, seed+2 of one generator family, which makes
trial s+1's noise equal to trial s's sampler stream. torch generators take at most 64-bit seeds: each gets
an independent 64-bit value drawn from its own child (the trial's 128+ bits are not truncated to one 64-bit
seed shared by all), numpy streams use their child directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dptune.config import ConfigError

__all__ = ["STREAMS", "TrialStreams"]

# Spawn order of the SeedSequence children: append new streams at the end, never reorder (a reorder
# would silently give old checkpoints' trials other streams).
STREAMS = ("noise", "sampler", "augment", "score", "init")


def _seed64(child: np.random.SeedSequence) -> int:
    return int(child.generate_state(1, dtype=np.uint64)[0])  # torch's limit: 0 <= seed < 2^64


@dataclass
class TrialStreams:
    """Every random stream of a trial, each from its own SeedSequence child of the trial's entropy."""

    noise: torch.Generator  # DP-SGD Gaussian noise (on the training device)
    sampler: torch.Generator  # Poisson batch membership
    augment: torch.Generator  # augmentation multiplicity's crops and flips
    score: np.random.Generator  # Gaussian noise on the released validation count
    init_seed: int  # 64-bit seed of the model initialisation

    @classmethod
    def from_entropy(cls, entropy: int, device: torch.device | str = "cpu") -> TrialStreams:
        if isinstance(entropy, bool) or not isinstance(entropy, int) or entropy < 0:
            raise ConfigError("seed", f"{entropy!r} is not a non-negative integer",
                              "draw the trial's entropy with secrets.randbits(128)")
        children = dict(zip(STREAMS, np.random.SeedSequence(entropy).spawn(len(STREAMS)), strict=True))
        return cls(noise=torch.Generator(device=device).manual_seed(_seed64(children["noise"])),
                   sampler=torch.Generator().manual_seed(_seed64(children["sampler"])),
                   augment=torch.Generator().manual_seed(_seed64(children["augment"])),
                   score=np.random.default_rng(children["score"]), init_seed=_seed64(children["init"]))

    def state(self) -> dict[str, Any]:
        """Checkpointable state: a resumed trial replays exactly the streams it would have drawn."""
        return {"noise": self.noise.get_state(), "sampler": self.sampler.get_state(),
                "augment": self.augment.get_state(), "score": self.score.bit_generator.state}

    def load_state(self, state: dict[str, Any]) -> None:
        self.noise.set_state(state["noise"])
        self.sampler.set_state(state["sampler"])
        self.augment.set_state(state["augment"])
        self.score.bit_generator.state = state["score"]
