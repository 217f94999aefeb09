"""torchvision's readers, offline: MNIST, Fashion-MNIST (IDX), CIFAR-10/100 (python pickles), SVHN (.mat).

Files are read from ``dataset.path``; nothing is downloaded unless ``dataset.download: true``.

* MNIST / Fashion-MNIST: torchvision's own layout ``<path>/MNIST/raw/{train,t10k}-*-ubyte`` (both splits,
  uncompressed, as ``torchvision.datasets.MNIST`` leaves them) is read by the torchvision class; otherwise the
  IDX files of a split (``.gz`` or not) are looked up in ``<path>/<Class>/raw`` and ``<path>`` itself and read
  with torchvision's IDX reader (``read_image_file`` / ``read_label_file``), a ``.gz`` decompressed into a
  private temporary folder first. So a folder holding only ``t10k-*-ubyte.gz`` (MNIST's test split as
  distributed) works with ``dataset.split: test``.
* CIFAR-10/100: ``<path>/cifar-10-batches-py`` (or that folder itself) through ``torchvision.datasets.CIFAR10``
  / ``CIFAR100``; SVHN: ``<path>/{train,test}_32x32.mat`` through ``torchvision.datasets.SVHN``. Their files
  are checked for presence, not against torchvision's MD5s (dptune identifies a dataset by its examples; a
  subset or re-export loads too); a download is still checked against the archive's MD5.

Normalisation: fixed constants, never statistics of the data. CIFAR-10 keeps its published per-channel
constants (the values earlier dptune versions used: the same images give the same ledger digests); the other
datasets map [0, 1] to [-1, 1] (mean 0.5, std 0.5), as digits does.
"""

from __future__ import annotations

import gzip
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dptune.config import ConfigError, DatasetSpec, nominal_train_size, official_pool
from dptune.data._loaders import CIFAR10_MEAN, CIFAR10_STD, existing_dir, normalise, take
from dptune.data._splits import Splits, make_splits, split_indices

# each dataset's declared number of classes (public, fixed: never counted from the files)
CLASS_COUNTS = {"mnist": 10, "fashion_mnist": 10, "cifar10": 10, "cifar100": 100, "svhn": 10}
# (uint8 images N x C x H x W, int64 labels, number of classes), or None when the split's files are absent
Raw = tuple[torch.Tensor, torch.Tensor, int]
Reader = Callable[[Path, str, bool], Raw | None]


def load_vision(spec: DatasetSpec) -> Splits:
    """``official``: train + validation from the official train split, test = the official test split;
    ``train`` / ``test``: that official split alone is the pool, split by ``split_seed``."""
    root = Path(spec.path or "").expanduser()
    if spec.download:
        root.mkdir(parents=True, exist_ok=True)
    root = existing_dir(spec)
    reader = READERS[spec.name]
    if spec.split == "official":
        train = _read(reader, root, "train", spec)
        test = _read(reader, root, "test", spec)
        x, y = _to_float(spec.name, train[0]), train[1]
        val, tr = split_indices(len(y), (spec.validation_size,), spec.split_seed, "dataset.validation_size")
        ids = (*_ids(spec.name, "train", len(y)), *_ids(spec.name, "test", len(test[1])))
        return make_splits(take(x, y, tr), take(x, y, val), (_to_float(spec.name, test[0]), test[1]), train[2],
                           record_ids=ids, signatures=_signatures(train[0]) + _signatures(test[0]))
    pool = _read(reader, root, spec.split, spec)
    x, y = _to_float(spec.name, pool[0]), pool[1]
    te, val, tr = split_indices(len(y), (spec.test_size, spec.validation_size), spec.split_seed, "dataset.test_size")
    return make_splits(take(x, y, tr), take(x, y, val), take(x, y, te), pool[2],
                       record_ids=_ids(spec.name, spec.split, len(y)), signatures=_signatures(pool[0]))


def _signatures(images: torch.Tensor) -> list[tuple[bytes, ...]]:
    """Each image's content signatures from its stored 8-bit levels (what identifies it for its budget)."""
    from dptune.data._content import image_signatures

    return image_signatures(images.numpy(), 255)


def check_planned_size(spec: DatasetSpec, data: Splits) -> None:
    """Refuse a torchvision dataset whose folder holds another number of images than the plan assumes (the
    official split's, or the declared ``dataset.pool_size``): ``dptune plan`` reads no data, so a search on a
    4,443-image subset of a 10,000-image split would train on a third of the examples its plan and its batch sizes
    and epochs were written for. Checked before anything is charged. The counts it names are public anyway: the
    charged sampling rate q = B/n is in the certificate."""
    official = official_pool(spec)
    planned = nominal_train_size(spec)
    held = len(data.val[1]) + (0 if spec.split == "official" else len(data.test[1]))
    pool = len(data.train[1]) + held
    if official is None or planned is None or pool - held == planned:
        return
    split, size = official
    if spec.pool_size is not None:
        raise ConfigError("dataset.pool_size", f"declares {spec.pool_size:,} images of {spec.name}'s {split} split, "
                          f"but {str(spec.path)!r} holds {pool:,} images",
                          f"set dataset.pool_size: {pool} (the plan then trains on {pool - held:,} examples), or put "
                          "the declared images there")
    raise ConfigError("dataset.path", f"{str(spec.path)!r} holds {pool:,} images of {spec.name}'s {split} split, not "
                      f"the official {size:,}: the search would train on {pool - held:,} examples where `dptune "
                      f"plan` and the space's batch sizes and epochs assume {planned:,}",
                      f"put the whole {split} split there, or declare the subset: dataset.pool_size: {pool} (plan and "
                      "search then both use it)")


def _ids(name: str, split: str, n: int) -> tuple[str, ...]:
    """A record's id: its index in the official split file (a copy with edited pixels is the same record)."""
    return tuple(f"{name}/{split}/{i}" for i in range(n))


def _read(reader: Reader, root: Path, split: str, spec: DatasetSpec) -> Raw:
    raw = reader(root, split, spec.download)
    if raw is not None:
        k = CLASS_COUNTS[spec.name]
        if len(raw[1]) and (int(raw[1].min()) < 0 or int(raw[1].max()) >= k):  # no count, no value: private
            raise ConfigError("dataset.path", f"the {split} split holds labels outside {spec.name}'s {k} classes",
                              f"use the dataset's original files (labels 0..{k - 1})")
        return raw[0], raw[1], k
    other = "test" if split == "train" else "train"
    if spec.split == "official" and reader(root, other, False) is not None:
        raise ConfigError("dataset.split", f"{str(root)!r} holds only the {other} split of {spec.name}",
                          f"set dataset.split: {other} to use that split as the pool dptune splits into "
                          "train / validation / test")
    raise ConfigError("dataset.path", f"{str(root)!r} lacks the {split} split of {spec.name} ({LAYOUTS[spec.name]})",
                      "put the files there, or set dataset.download: true to fetch them")


def _to_float(name: str, x: torch.Tensor) -> torch.Tensor:
    mean, std = (CIFAR10_MEAN, CIFAR10_STD) if name == "cifar10" else ((0.5,) * x.shape[1], (0.5,) * x.shape[1])
    return normalise(x.float().div_(255.0), mean, std)


# --------------------------------------------------------------------------------------------------
# MNIST, Fashion-MNIST: IDX files


def _idx_reader(cls_name: str) -> Reader:
    def read(root: Path, split: str, download: bool) -> Raw | None:
        from torchvision import datasets

        cls = getattr(datasets, cls_name)
        train = split == "train"
        if download:
            cls(str(root), train=train, download=True)
        raw = root / cls_name / "raw"
        names = [f"{p}-{k}" for p in ("train", "t10k") for k in ("images-idx3-ubyte", "labels-idx1-ubyte")]
        if all((raw / n).is_file() for n in names):  # torchvision's own layout: its class reads it
            ds = cls(str(root), train=train, download=False)
            return ds.data.unsqueeze(1), ds.targets.long(), 10
        prefix = "train" if train else "t10k"
        images = _find([raw, root], f"{prefix}-images-idx3-ubyte")
        labels = _find([raw, root], f"{prefix}-labels-idx1-ubyte")
        if images is None or labels is None:
            return None
        return _read_idx(images, labels)

    return read


def _find(folders: list[Path], name: str) -> Path | None:
    for folder in folders:
        for candidate in (folder / name, folder / f"{name}.gz"):
            if candidate.is_file():
                return candidate
    return None


def _read_idx(images: Path, labels: Path) -> Raw:
    from torchvision.datasets.mnist import read_image_file, read_label_file

    with tempfile.TemporaryDirectory(prefix="dptune-idx-") as tmp:  # 0700: the decompressed data stays private
        try:
            x = read_image_file(str(_plain(images, Path(tmp))))
            y = read_label_file(str(_plain(labels, Path(tmp))))
        except (AssertionError, TypeError, ValueError, OSError, EOFError, RuntimeError) as e:
            raise ConfigError("dataset.path", f"{images.name} / {labels.name} are not IDX image / label files "
                              f"({type(e).__name__}: {e})", "use the dataset's original IDX files") from e
    if len(x) != len(y):
        raise ConfigError("dataset.path", f"{images.name} and {labels.name} hold different numbers of examples",
                          "use matching image and label files")
    return x.unsqueeze(1), y.long(), 10


def _plain(path: Path, tmp: Path) -> Path:
    if path.suffix != ".gz":
        return path
    out = tmp / path.stem
    with gzip.open(path, "rb") as src, out.open("wb") as dst:
        shutil.copyfileobj(src, dst)
    return out


# --------------------------------------------------------------------------------------------------
# CIFAR-10/100 (python pickles), SVHN (.mat)


def _cifar_reader(cls_name: str) -> Reader:
    def read(root: Path, split: str, download: bool) -> Raw | None:
        from torchvision import datasets

        base: Any = getattr(datasets, cls_name)
        # torchvision's reader, with its files checked for presence (md5 None) rather than against its MD5s
        cls = type(f"_{cls_name}", (base,), {
            "train_list": [[f, None] for f, _ in base.train_list], "test_list": [[f, None] for f, _ in base.test_list],
            "meta": {**base.meta, "md5": None}})
        top = root.parent if root.name == base.base_folder and not (root / base.base_folder).is_dir() else root
        folder = top / base.base_folder
        needed = [f for f, _ in base.train_list + base.test_list] + [base.meta["filename"]]
        missing = [f for f in needed if not (folder / f).is_file()]
        if missing and not download:
            if len(missing) < len(needed):  # a partial folder: say what is missing
                raise ConfigError("dataset.path", f"{str(folder)!r} lacks {', '.join(missing)}",
                                  f"extract {base.filename} there (folder {base.base_folder})")
            return None
        try:
            ds = cls(str(top), train=split == "train", download=download)
        except (OSError, EOFError, KeyError, ValueError, TypeError, RuntimeError) as e:
            raise ConfigError("dataset.path", f"{str(folder)!r} is not a readable {cls_name} python version "
                              f"({type(e).__name__}: {e})", f"extract {base.filename} there, unmodified") from e
        x = torch.from_numpy(np.ascontiguousarray(ds.data.transpose(0, 3, 1, 2)))
        return x, torch.as_tensor(ds.targets, dtype=torch.int64), len(ds.classes)

    return read


def _svhn(root: Path, split: str, download: bool) -> Raw | None:
    from torchvision.datasets import SVHN

    class _SVHN(SVHN):
        def _check_integrity(self) -> bool:  # presence, not torchvision's MD5 (see the module docstring)
            return (Path(self.root) / self.filename).is_file()

    if not download and not (root / SVHN.split_list[split][1]).is_file():
        return None
    try:
        ds = _SVHN(str(root), split=split, download=download)
    except (OSError, KeyError, ValueError, TypeError, NotImplementedError) as e:
        raise ConfigError("dataset.path", f"{SVHN.split_list[split][1]} is not an SVHN .mat file "
                          f"({type(e).__name__}: {e})", "use the original train_32x32.mat / test_32x32.mat") from e
    return torch.from_numpy(np.ascontiguousarray(ds.data)), torch.from_numpy(ds.labels.astype(np.int64)), 10


READERS: dict[str, Reader] = {"mnist": _idx_reader("MNIST"), "fashion_mnist": _idx_reader("FashionMNIST"),
                              "cifar10": _cifar_reader("CIFAR10"), "cifar100": _cifar_reader("CIFAR100"),
                              "svhn": _svhn}
LAYOUTS = {
    "mnist": "expected <path>/MNIST/raw/ or <path>/ with {train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]",
    "fashion_mnist": "expected <path>/FashionMNIST/raw/ or <path>/ with "
                     "{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]",
    "cifar10": "expected <path>/cifar-10-batches-py/ with data_batch_1..5, test_batch, batches.meta",
    "cifar100": "expected <path>/cifar-100-python/ with train, test, meta",
    "svhn": "expected <path>/train_32x32.mat and <path>/test_32x32.mat",
}
