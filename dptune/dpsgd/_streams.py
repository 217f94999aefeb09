"""The random streams of one trial, derived in one place from the trial's secret seed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["TrialStreams"]

_SCORE_STREAM = 0x5C0E  # numpy stream id of the validation-score noise, independent of training noise


@dataclass
class TrialStreams:
    """Every random stream of a trial: DP-SGD noise, Poisson sampler, augmentation, score noise, model init."""

    noise: torch.Generator
    sampler: torch.Generator
    augment: torch.Generator
    score: np.random.Generator
    init_seed: int

    @classmethod
    def from_entropy(cls, entropy: int, device: torch.device | str = "cpu") -> TrialStreams:
        return cls(noise=torch.Generator(device=device).manual_seed(entropy),
                   sampler=torch.Generator().manual_seed(entropy + 1),
                   augment=torch.Generator().manual_seed(entropy + 2),
                   score=np.random.default_rng([entropy, _SCORE_STREAM]), init_seed=entropy)

    def state(self) -> dict[str, Any]:
        """Checkpointable state: a resumed trial replays exactly the streams it would have drawn."""
        return {"noise": self.noise.get_state(), "sampler": self.sampler.get_state(),
                "augment": self.augment.get_state(), "numpy": self.score.bit_generator.state}

    def load_state(self, state: dict[str, Any]) -> None:
        self.noise.set_state(state["noise"])
        self.sampler.set_state(state["sampler"])
        self.augment.set_state(state["augment"])
        self.score.bit_generator.state = state["numpy"]
