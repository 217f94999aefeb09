"""Datasets as in-memory tensors: digits (embedded, offline), CIFAR-10 python batches, ImageFolder."""

from __future__ import annotations

from dptune.config import ConfigError, DatasetSpec
from dptune.data._augment import augment_views
from dptune.data._loaders import load_cifar10, load_digits, load_imagefolder
from dptune.data._splits import Splits, poisson_subsample

__all__ = ["Splits", "augment_views", "load_dataset", "poisson_subsample"]


def load_dataset(spec: DatasetSpec) -> Splits:
    """Load and deterministically split ``spec`` (split seed ``spec.split_seed``)."""
    if spec.name == "digits":
        return load_digits(spec)
    if spec.name == "cifar10":
        return load_cifar10(spec)
    if spec.name == "imagefolder":
        return load_imagefolder(spec)
    raise ConfigError("dataset.name", f"unknown dataset {spec.name!r}", "use one of: digits, cifar10, imagefolder")
