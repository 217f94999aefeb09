"""Datasets as in-memory tensors: digits (embedded, offline), torchvision's MNIST, Fashion-MNIST, CIFAR-10,
CIFAR-100 and SVHN (offline from ``dataset.path``), ImageFolder, and tables (Parquet / CSV)."""

from __future__ import annotations

from dptune.config import ConfigError, DatasetSpec
from dptune.data._augment import augment_views
from dptune.data._loaders import load_digits, load_imagefolder
from dptune.data._splits import Splits, poisson_subsample
from dptune.data._table import load_table
from dptune.data._vision import READERS, check_planned_size, load_vision

__all__ = ["Splits", "augment_views", "check_planned_size", "load_dataset", "poisson_subsample"]


def load_dataset(spec: DatasetSpec) -> Splits:
    """Load and deterministically split ``spec`` (split seed ``spec.split_seed``)."""
    if spec.name == "digits":
        return load_digits(spec)
    if spec.name in READERS:
        return load_vision(spec)
    if spec.name == "imagefolder":
        return load_imagefolder(spec)
    if spec.name == "table":
        return load_table(spec)
    raise ConfigError("dataset.name", f"unknown dataset {spec.name!r}",
                      f"use one of: digits, {', '.join(READERS)}, imagefolder, table")
