"""The built-in CNNs in NCHW beside their channels-last build (``bench/step_overhead.py --layouts``,
``bench/layout_accuracy.py``), and the real MNIST test split the benches time the tanh CNN on (``trial_walltime``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

__all__ = ["MNIST", "mnist_t10k", "nchw", "nchw_factory"]

MNIST = Path(__file__).resolve().parents[3] / "shared" / "data" / "mnist-t10k"  # absent in a user's clone


def mnist_t10k() -> Any:
    """The MNIST spaces' dataset: the official test split as the pool, 1,000 validation and 1,000 test images."""
    # imported here, not at the top: trial_walltime's parent process times another revision's dptune in children
    from dptune.config import DatasetSpec

    return DatasetSpec(name="mnist", path=str(MNIST), split="test", validation_size=1000, test_size=1000)


def nchw(model: torch.nn.Module) -> torch.nn.Module:
    """The same CNN (its weights) in NCHW: contiguous weights, and a forward without the input's layout change."""
    model.to(memory_format=torch.contiguous_format)
    model.forward = lambda x: model.classifier(torch.flatten(model.features(x), 1))  # type: ignore[method-assign]
    return model


def nchw_factory(num_classes: int, input_shape: tuple[int, int, int], groups: int, name: str) -> torch.nn.Module:
    """The built-in ``name`` in NCHW as a ``model.factory`` (``harness.layouts:nchw_factory``, ``model_kwargs``
    ``{"name": ...}``): the same init as the built-in, the seed's RNG drawn the same way."""
    from dptune.config import TrialConfig
    from dptune.models import build_model

    return nchw(build_model(TrialConfig(model=name, groups=groups), num_classes, input_shape))
