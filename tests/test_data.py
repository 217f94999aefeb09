"""Datasets: digits splits, CIFAR-10 python batches (read by torchvision) and ImageFolder written here in the
real formats. The other torchvision datasets and tables: tests/test_data_formats.py."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from dptune.config import ConfigError, DatasetSpec
from dptune.data import load_dataset, poisson_subsample
from dptune.data._augment import augment_views


def test_digits_default_split_is_deterministic() -> None:
    a, b = load_dataset(DatasetSpec()), load_dataset(DatasetSpec())
    assert [len(p[1]) for p in (a.train, a.val, a.test)] == [1257, 180, 360]
    assert a.input_shape == (1, 8, 8) and a.num_classes == 10
    assert a.train[0].dtype == torch.float32 and a.train[1].dtype == torch.int64
    assert torch.equal(a.train[0], b.train[0]) and torch.equal(a.val[1], b.val[1])
    assert float(a.train[0].min()) == -1.0 and float(a.train[0].max()) == 1.0  # fixed 0.5/0.5 constants
    c = load_dataset(DatasetSpec(split_seed=1))
    assert not torch.equal(c.train[1], a.train[1])
    ids = [set(map(tuple, p[0].flatten(1).tolist())) for p in (a.train, a.val, a.test)]
    assert len(ids[1] & ids[2]) <= 2  # disjoint index sets (digits has a few duplicate images)


def test_digits_held_out_too_large() -> None:
    with pytest.raises(ConfigError) as e:
        load_dataset(DatasetSpec(test_size=1000, validation_size=900))
    assert e.value.field == "dataset.test_size"


def test_poisson_subsample() -> None:
    s = load_dataset(DatasetSpec())
    sub = poisson_subsample(s, 0.25, seed=3)
    assert 200 < len(sub.train[1]) < 430
    assert sub.val is s.val and sub.test is s.test
    assert torch.equal(poisson_subsample(s, 0.25, seed=3).train[0], sub.train[0])
    assert len(poisson_subsample(s, 0.25, seed=2**100 + 3).train[1]) != len(sub.train[1]) or not torch.equal(
        poisson_subsample(s, 0.25, seed=2**100 + 3).train[0], sub.train[0])  # 128-bit seeds work
    with pytest.raises(ConfigError):
        poisson_subsample(s, 0.0, seed=3)


def _write_cifar(folder: Path, per_batch: int = 20) -> None:
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {"data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
                 "labels": [int(v) for v in rng.integers(0, 10, per_batch)], "batch_label": name}
        (folder / name).write_bytes(pickle.dumps(batch, protocol=2))  # string keys, as torchvision reads them
    meta = {"label_names": [f"c{i}" for i in range(10)], "num_vis": 3072}
    (folder / "batches.meta").write_bytes(pickle.dumps(meta, protocol=2))


@pytest.mark.parametrize("nested", [True, False])
def test_cifar10_reads_python_batches(tmp_path: Path, nested: bool) -> None:
    folder = tmp_path / "cifar-10-batches-py"
    _write_cifar(folder)
    s = load_dataset(DatasetSpec(name="cifar10", path=str(tmp_path if nested else folder), validation_size=10))
    assert (len(s.train[1]), len(s.val[1]), len(s.test[1])) == (90, 10, 20)
    assert s.input_shape == (3, 32, 32) and s.num_classes == 10
    raw = pickle.loads((folder / "test_batch").read_bytes())
    pixel = raw["data"][0, 0] / 255.0  # first red pixel of the first test image, public CIFAR constants
    assert float(s.test[0][0, 0, 0, 0]) == pytest.approx((pixel - 0.4914) / 0.2470, abs=1e-5)
    assert s.test[1].tolist() == raw["labels"]


def test_cifar10_missing_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        load_dataset(DatasetSpec(name="cifar10", path=str(tmp_path / "nowhere")))
    assert e.value.field == "dataset.path"
    (tmp_path / "cifar-10-batches-py").mkdir()
    with pytest.raises(ConfigError, match="data_batch_1") as e:
        load_dataset(DatasetSpec(name="cifar10", path=str(tmp_path)))
    assert e.value.field == "dataset.path"


def _write_pngs(folder: Path, classes: tuple[str, ...], per_class: int, size: int = 12) -> None:
    from PIL import Image

    rng = np.random.default_rng(1)
    for c in classes:
        (folder / c).mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(folder / c / f"{i}.png")


CLASSES = ["cat", "dog", "eel"]


def test_imagefolder_with_and_without_test(tmp_path: Path) -> None:
    _write_pngs(tmp_path / "train", ("cat", "dog", "eel"), per_class=8)
    s = load_dataset(DatasetSpec(name="imagefolder", path=str(tmp_path), validation_size=3, test_size=4,
                                 classes=CLASSES))
    assert (len(s.train[1]), len(s.val[1]), len(s.test[1])) == (17, 3, 4)
    assert s.input_shape == (3, 32, 32) and s.num_classes == 3
    assert float(s.train[0].min()) >= -1.0 and float(s.train[0].max()) <= 1.0
    _write_pngs(tmp_path / "test", ("cat", "dog", "eel"), per_class=2)
    s2 = load_dataset(DatasetSpec(name="imagefolder", path=str(tmp_path), validation_size=3, classes=CLASSES))
    assert (len(s2.train[1]), len(s2.val[1]), len(s2.test[1])) == (21, 3, 6)


def test_imagefolder_classes_are_declared_never_read_off_the_folders(tmp_path: Path) -> None:
    """Issue 22 item 5: the output layer is the declared class list: a space without one is refused, a class
    folder it does not list is refused (not named: a label value may be private), a declared class without
    a folder still counts (the model's shape does not depend on which classes hold records)."""
    with pytest.raises(ConfigError) as e:
        DatasetSpec(name="imagefolder", path=str(tmp_path))
    assert e.value.field == "dataset.classes" and "required" in str(e.value)
    _write_pngs(tmp_path / "train", ("cat", "dog", "secretclass"), per_class=4)
    with pytest.raises(ConfigError) as e:
        load_dataset(DatasetSpec(name="imagefolder", path=str(tmp_path), validation_size=2, test_size=2,
                                 classes=["cat", "dog"]))
    assert e.value.field == "dataset.classes" and "secretclass" not in str(e.value)
    s = load_dataset(DatasetSpec(name="imagefolder", path=str(tmp_path), validation_size=2, test_size=2,
                                 classes=["cat", "dog", "secretclass", "zebra"]))
    assert s.num_classes == 4 and int(torch.cat([s.train[1], s.val[1], s.test[1]]).max()) == 2


def test_imagefolder_missing_path(tmp_path: Path) -> None:
    for path in (None, str(tmp_path / "nope"), str(tmp_path)):
        with pytest.raises(ConfigError) as e:
            load_dataset(DatasetSpec(name="imagefolder", path=path, classes=CLASSES))
        assert e.value.field == "dataset.path"


def test_augment_views_shapes_and_no_flip_for_digits() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.arange(64.0).view(1, 1, 8, 8)
    v = augment_views(x, 16, g)
    assert v.shape == (16, 1, 8, 8)
    # a shift by at most one pixel, never a mirror image: row differences stay +1 along width
    diffs = v[:, 0, 2:6, 2:6].diff(dim=-1)
    assert bool((diffs == 1).all())
    rgb = augment_views(torch.randn(3, 3, 32, 32), 4, g)
    assert rgb.shape == (12, 3, 32, 32)
    assert augment_views(torch.randn(0, 3, 32, 32), 4, g).shape == (0, 3, 32, 32)


def test_pool_fingerprint_ignores_the_split_but_not_the_data() -> None:
    from dptune.config import DatasetSpec
    from dptune.data import load_dataset

    a = load_dataset(DatasetSpec())
    b = load_dataset(DatasetSpec(split_seed=7, validation_size=100))
    assert a.pool_fingerprint() == b.pool_fingerprint()  # re-splitting cannot open a fresh budget
    assert not torch.equal(a.train[1], b.train[1])
    assert len(a.example_digests()) == 1797 and a.example_digests() == sorted(b.example_digests())
    c = load_dataset(DatasetSpec(test_size=300))  # same pool, different split sizes
    assert c.pool_fingerprint() == a.pool_fingerprint()
