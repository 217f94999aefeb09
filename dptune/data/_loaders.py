"""Digits (embedded) and ImageFolder, and the helpers every reader shares. Normalisation constants are
fixed public values, never statistics of the (private) data. torchvision's datasets: ``_vision``; tables:
``_table``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from dptune.config import ConfigError, DatasetSpec
from dptune.data._splits import Pair, Splits, make_splits, split_indices

# CIFAR-10's published per-channel statistics (public constants)
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
IMAGE_SIZE = 32


def normalise(x: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    m = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
    return (x - m) / s


def take(x: torch.Tensor, y: torch.Tensor, idx: np.ndarray) -> Pair:
    i = torch.from_numpy(idx)
    return x[i], y[i]


def load_digits(spec: DatasetSpec) -> Splits:
    """scikit-learn's bundled 8x8 digits (1797 real images, offline), pixel range 0..16."""
    from sklearn.datasets import load_digits as sk_digits

    from dptune.data._content import image_signatures

    d = sk_digits()
    x = torch.from_numpy(np.asarray(d.images, dtype=np.float32) / 16.0).unsqueeze(1)
    x = normalise(x, (0.5,), (0.5,))
    y = torch.from_numpy(np.asarray(d.target, dtype=np.int64))
    test, val, train = split_indices(len(y), (spec.test_size, spec.validation_size), spec.split_seed,
                                     "dataset.test_size")
    return make_splits(take(x, y, train), take(x, y, val), take(x, y, test), 10,
                       record_ids=tuple(f"digits/{i}" for i in range(len(y))),  # the index in scikit-learn's copy
                       signatures=image_signatures(d.images, 16))  # stored levels 0..16


def existing_dir(spec: DatasetSpec) -> Path:
    if not spec.path:
        raise ConfigError("dataset.path", f"dataset {spec.name!r} needs a path", "set dataset.path to its folder")
    p = Path(spec.path).expanduser()
    if not p.is_dir():
        raise ConfigError("dataset.path", f"{str(p)!r} is not an existing folder",
                          "point dataset.path at the dataset's folder")
    return p


def _read_folder(folder: Path, classes: list[str]) -> tuple[Pair, list[tuple[bytes, ...]]]:
    """The folder's images resized to 32x32 RGB, and each one's content signatures from its stored pixels (before
    the resize: an export of other data at its own size is recognised)."""
    from torchvision import transforms
    from torchvision.datasets import ImageFolder

    from dptune.data._content import image_signatures

    index = {c: i for i, c in enumerate(classes)}
    if any(d.is_dir() and d.name not in index for d in folder.iterdir()):  # not named: a private label value
        raise ConfigError("dataset.classes", f"{folder.name}/ holds a class folder that dataset.classes does not list",
                          "list every class folder in dataset.classes (or move that folder out)")
    resize = transforms.Compose([transforms.Resize((IMAGE_SIZE, IMAGE_SIZE)), transforms.ToTensor()])
    ds = ImageFolder(str(folder), allow_empty=True)  # its file list only: each image is read once, below
    xs, ys, stored = [], [], []
    for path, label in ds.samples:
        img = _rgb(path)
        stored.append(np.asarray(img).transpose(2, 0, 1))
        xs.append(resize(img))
        ys.append(index[ds.classes[label]])
    if not xs:
        raise ConfigError("dataset.path", f"{str(folder)!r} holds no images", "add images under <class>/ folders")
    return ((normalise(torch.stack(xs), (0.5,) * 3, (0.5,) * 3), torch.tensor(ys, dtype=torch.int64)),
            image_signatures(stored, 255))


def _rgb(path: str) -> Any:
    from PIL import Image

    with Image.open(path) as im:
        return im.convert("RGB")


def load_imagefolder(spec: DatasetSpec) -> Splits:
    """``<path>/train/<class>/*`` (+ optional ``<path>/test/<class>/*``), resized to 32x32 RGB; class i is
    ``dataset.classes[i]`` (declared: a folder it does not list is refused, a listed one may be absent)."""
    root = existing_dir(spec)
    train_dir, test_dir = root / "train", root / "test"
    if not train_dir.is_dir():
        raise ConfigError("dataset.path", f"{str(root)!r} has no train/ folder",
                          "lay the images out as <path>/train/<class>/*.png")
    # the declared classes, in order (never the folders found: a new folder would change the output layer)
    classes = [str(c) for c in spec.classes or []]
    (x, y), signatures = _read_folder(train_dir, classes)
    if test_dir.is_dir():
        test, test_signatures = _read_folder(test_dir, classes)
        signatures += test_signatures
        val, train = split_indices(len(y), (spec.validation_size,), spec.split_seed, "dataset.validation_size")
    else:
        t_idx, val, train = split_indices(len(y), (spec.test_size, spec.validation_size), spec.split_seed,
                                          "dataset.test_size")
        test = take(x, y, t_idx)
    return make_splits(take(x, y, train), take(x, y, val), test, len(classes), record_ids=_folder_ids(root),
                       signatures=signatures)


def _folder_ids(root: Path) -> tuple[str, ...]:
    """Each image's path relative to ``root`` (``train/cat/001.png``): its record id, whatever its pixels."""
    from torchvision.datasets.folder import IMG_EXTENSIONS, make_dataset

    ids: list[str] = []
    for split in ("train", "test"):
        folder = root / split
        if folder.is_dir():
            classes = sorted(d.name for d in folder.iterdir() if d.is_dir())
            samples = make_dataset(str(folder), {c: i for i, c in enumerate(classes)}, IMG_EXTENSIONS)
            ids += [Path(p).relative_to(root).as_posix() for p, _ in samples]
    return tuple(f"imagefolder/{i}" for i in ids)
