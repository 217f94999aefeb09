"""Datasets as in-memory tensors: digits (embedded, offline), torchvision's MNIST, Fashion-MNIST, CIFAR-10,
CIFAR-100 and SVHN (offline from ``dataset.path``), ImageFolder, and tables (Parquet / CSV)."""

from __future__ import annotations

from dptune.config import ConfigError, DatasetSpec
from dptune.data._augment import augment_views
from dptune.data._content import column_levels, image_signatures, row_signatures
from dptune.data._loaders import load_digits, load_imagefolder
from dptune.data._splits import Splits, poisson_subsample
from dptune.data._table import load_table
from dptune.data._vision import READERS, check_planned_size, load_vision

__all__ = ["Splits", "augment_views", "check_planned_size", "column_levels", "image_signatures", "load_dataset",
           "poisson_subsample", "row_signatures", "train_size"]


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


def train_size(spec: DatasetSpec) -> int:
    """The training split's size: published (digits, torchvision's readers) or counted (a table's rows, a folder's
    images; the count only, which the search uses anyway)."""
    from dptune.config import nominal_train_size

    n = nominal_train_size(spec)
    return int(n) if n is not None else int(len(load_dataset(spec).train[1]))
