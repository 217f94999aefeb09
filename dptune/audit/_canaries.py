"""The canaries of a one-run audit and the training split they are mixed into.

Two kinds, each canary included independently with probability 1/2 (Steinke, Nasr & Jagielski 2023, Alg. 1):

* **gradient ("Dirac") canaries**, white-box: canary i's per-example gradient is G·e_{j_i}, a distinct
  coordinate j_i of the flattened parameters (``dptune.dpsgd.AuditHooks``). In the training split it is a
  row like any other (an all-zero image whose gradient the trainer replaces), Poisson-sampled at rate q;
* **input canaries**, black-box: random images (pixels uniform in the normalised input range) with random
  labels, ordinary training rows whose only trace is the released model's loss on them.

The sampling rate is fixed on a data-independent basis, n + (m_gradient + m_input) / 2 (the expected size),
never on the realised number of included canaries, so q and T are the same for every coin flip.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dptune.data import Splits

__all__ = ["Canaries", "audit_basis", "audit_splits", "draw_canaries"]


@dataclass(frozen=True, eq=False)
class Canaries:
    """``coordinates``/``gradient_in``: the gradient canaries (flat parameter coordinate, included?);
    ``x``/``y``/``input_in``: the input canaries (image, label, included?)."""

    coordinates: np.ndarray  # int64 [m_g], distinct
    gradient_in: np.ndarray  # bool [m_g]
    x: torch.Tensor  # float32 [m_i, C, H, W]
    y: torch.Tensor  # int64 [m_i]
    input_in: np.ndarray  # bool [m_i]

    @property
    def m_gradient(self) -> int:
        return len(self.coordinates)

    @property
    def m_input(self) -> int:
        return len(self.y)


def draw_canaries(rng: np.random.Generator, *, gradient: int, inputs: int, parameters: int,
                  input_shape: tuple[int, int, int], num_classes: int,
                  input_range: tuple[float, float] = (-1.0, 1.0)) -> Canaries:
    """``gradient`` Dirac canaries on distinct coordinates of ``parameters`` and ``inputs`` random-image
    canaries; every inclusion bit a fair coin from ``rng`` (a bench: a seeded or OS-entropy generator)."""
    if not 0 <= gradient <= parameters:
        raise ValueError(f"need 0 <= gradient canaries <= {parameters} parameters, got {gradient}")
    coords = np.sort(rng.choice(parameters, size=gradient, replace=False)).astype(np.int64)
    lo, hi = input_range
    x = torch.from_numpy(rng.uniform(lo, hi, size=(inputs, *input_shape)).astype(np.float32))
    y = torch.from_numpy(rng.integers(num_classes, size=inputs).astype(np.int64))
    return Canaries(coordinates=coords, gradient_in=rng.random(gradient) < 0.5, x=x, y=y,
                    input_in=rng.random(inputs) < 0.5)


def audit_basis(n_train: int, canaries: Canaries) -> int:
    """The data-independent size q is defined on: n + ⌊(m_gradient + m_input) / 2⌋."""
    return n_train + (canaries.m_gradient + canaries.m_input) // 2


def audit_splits(data: Splits, canaries: Canaries) -> tuple[Splits, torch.Tensor]:
    """``data`` with the included canaries appended to its training split, and for every training row the
    coordinate of its Dirac gradient (−1: an ordinary row, real or input canary)."""
    x, y = data.train
    inc_x = canaries.x[torch.from_numpy(canaries.input_in)]
    inc_y = canaries.y[torch.from_numpy(canaries.input_in)]
    coords = torch.from_numpy(canaries.coordinates[canaries.gradient_in])
    dirac_x = x.new_zeros((len(coords), *x.shape[1:]))  # never forwarded: the trainer replaces the gradient
    dirac_y = y.new_zeros(len(coords))
    train = (torch.cat([x, inc_x, dirac_x]), torch.cat([y, inc_y, dirac_y]))
    coordinate = torch.cat([torch.full((len(y) + len(inc_y),), -1, dtype=torch.int64), coords])
    return Splits(train, data.val, data.test, data.num_classes, data.input_shape), coordinate
