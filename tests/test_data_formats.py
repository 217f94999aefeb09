"""torchvision's datasets from files written here in each real on-disk format: MNIST / Fashion-MNIST IDX
(numpy + gzip), CIFAR-100 python pickles, SVHN .mat (scipy.io.savemat); and MNIST's real test split from
../shared/data/mnist-t10k when present (a user's clone has no ../shared/: skipped there)."""

from __future__ import annotations

import gzip
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from dptune.config import ConfigError, DatasetSpec, load_space, nominal_train_size
from dptune.data import load_dataset

ROOT = Path(__file__).resolve().parent.parent
SHARED_MNIST = ROOT.parent / "shared" / "data" / "mnist-t10k"


def _write_idx(path: Path, array: np.ndarray, gz: bool) -> None:
    """IDX: big-endian magic (0, 0, type 0x08 = uint8, ndim), big-endian dims, then the bytes."""
    payload = struct.pack(">I", 0x0800 | array.ndim) + b"".join(struct.pack(">I", d) for d in array.shape)
    payload += np.ascontiguousarray(array, dtype=np.uint8).tobytes()
    if gz:
        with gzip.open(path.with_name(path.name + ".gz"), "wb") as f:
            f.write(payload)
    else:
        path.write_bytes(payload)


def _write_mnist(folder: Path, prefix: str, n: int, gz: bool, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
    labels = (np.arange(n) % 10).astype(np.uint8)
    folder.mkdir(parents=True, exist_ok=True)
    _write_idx(folder / f"{prefix}-images-idx3-ubyte", images, gz)
    _write_idx(folder / f"{prefix}-labels-idx1-ubyte", labels, gz)
    return images, labels


def _all(s: object) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.cat([p[0] for p in (s.train, s.val, s.test)])  # type: ignore[attr-defined]
    y = torch.cat([p[1] for p in (s.train, s.val, s.test)])  # type: ignore[attr-defined]
    return x, y


def test_mnist_test_split_alone_is_the_pool(tmp_path: Path) -> None:
    images, labels = _write_mnist(tmp_path, "t10k", 40, gz=True)  # MNIST's test split as distributed
    spec = DatasetSpec(name="mnist", path=str(tmp_path), split="test", validation_size=6, test_size=4)
    s = load_dataset(spec)
    assert (len(s.train[1]), len(s.val[1]), len(s.test[1])) == (30, 6, 4) == (nominal_train_size(spec) - 9960, 6, 4)
    assert s.input_shape == (1, 28, 28) and s.num_classes == 10
    x, y = _all(s)
    expected = torch.from_numpy(images).float().div(255).sub(0.5).div(0.5)  # fixed 0.5/0.5, never data stats
    got = sorted(zip(y.tolist(), map(tuple, x.flatten(1).tolist()), strict=True))
    assert got == sorted(zip(labels.tolist(), map(tuple, expected.flatten(1).tolist()), strict=True))
    assert not list(tmp_path.glob("*-ubyte"))  # decompressed into a private temp folder, not next to the data
    with pytest.raises(ConfigError) as e:  # official splits: the train split is not there
        load_dataset(DatasetSpec(name="mnist", path=str(tmp_path)))
    assert e.value.field == "dataset.split" and "split: test" in e.value.fix


def test_mnist_torchvision_layout_and_plain_idx_read_alike(tmp_path: Path) -> None:
    tv, flat = tmp_path / "tv", tmp_path / "flat"
    for prefix, n in (("train", 30), ("t10k", 12)):
        _write_mnist(tv / "MNIST" / "raw", prefix, n, gz=False, seed=n)  # torchvision.datasets.MNIST reads it
        _write_mnist(flat, prefix, n, gz=True, seed=n)  # raw .gz files in the folder: torchvision's IDX reader
    a = load_dataset(DatasetSpec(name="mnist", path=str(tv), validation_size=5))
    b = load_dataset(DatasetSpec(name="mnist", path=str(flat), validation_size=5))
    assert (len(a.train[1]), len(a.val[1]), len(a.test[1])) == (25, 5, 12)  # official test split kept as is
    for p, q in zip((a.train, a.val, a.test), (b.train, b.val, b.test), strict=True):
        assert torch.equal(p[0], q[0]) and torch.equal(p[1], q[1])
    assert a.pool_fingerprint() == b.pool_fingerprint()
    assert a.test[1].tolist() == [i % 10 for i in range(12)]


def test_fashion_mnist_idx(tmp_path: Path) -> None:
    for prefix, n in (("train", 24), ("t10k", 8)):
        _write_mnist(tmp_path / "FashionMNIST" / "raw", prefix, n, gz=True, seed=n)
    s = load_dataset(DatasetSpec(name="fashion_mnist", path=str(tmp_path), validation_size=4))
    assert (len(s.train[1]), len(s.val[1]), len(s.test[1])) == (20, 4, 8) and s.num_classes == 10
    assert float(s.train[0].min()) >= -1.0 and float(s.train[0].max()) <= 1.0


def test_idx_garbage_names_the_path(tmp_path: Path) -> None:
    (tmp_path / "t10k-images-idx3-ubyte").write_bytes(b"not an idx file at all")
    _write_idx(tmp_path / "t10k-labels-idx1-ubyte", np.zeros(3, dtype=np.uint8), gz=False)
    with pytest.raises(ConfigError) as e:
        load_dataset(DatasetSpec(name="mnist", path=str(tmp_path), split="test", validation_size=1, test_size=1))
    assert e.value.field == "dataset.path" and "IDX" in e.value.problem


@pytest.mark.skipif(not SHARED_MNIST.is_dir(), reason="../shared/data/mnist-t10k is not here (a user's clone)")
def test_real_mnist_test_split_through_the_space(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # the space's path is relative to the repository root
    space = load_space(ROOT / "search_spaces" / "mnist.yaml")
    s = load_dataset(space.dataset)
    assert len(s.train[1]) == nominal_train_size(space.dataset) == 8000
    assert (len(s.val[1]), len(s.test[1])) == (1000, 1000) and s.input_shape == (1, 28, 28)
    _, y = _all(s)
    # the README's per-class counts of the official test split
    assert torch.bincount(y).tolist() == [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
    assert float(s.train[0].min()) == -1.0 and float(s.train[0].max()) == 1.0
    from dptune.dpsgd import run_trial, validate_model

    for groups in (4, 8):  # what the search checks before it reserves
        validate_model(space.fixed.replace(groups=groups), s.num_classes, s.input_shape)
    one_step = space.fixed.batch_size / 8000
    result = run_trial(space.fixed.replace(epochs=one_step, seed=2**90 + 1), s)  # one real DP-SGD step
    assert result.steps == result.noise_additions == 1 and result.applied_score_noise == 20.0


def _write_cifar100(folder: Path, n_train: int, n_test: int) -> dict[str, dict[str, object]]:
    folder.mkdir(parents=True)
    rng = np.random.default_rng(3)
    out = {}
    for name, n in (("train", n_train), ("test", n_test)):
        batch = {"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), "filenames": [f"{i}.png" for i in range(n)],
                 "fine_labels": [int(v) for v in rng.integers(0, 100, n)],
                 "coarse_labels": [int(v) for v in rng.integers(0, 20, n)], "batch_label": name}
        (folder / name).write_bytes(pickle.dumps(batch, protocol=2))
        out[name] = batch
    meta = {"fine_label_names": [f"f{i}" for i in range(100)], "coarse_label_names": [f"c{i}" for i in range(20)]}
    (folder / "meta").write_bytes(pickle.dumps(meta, protocol=2))
    return out


def test_cifar100_python_pickles(tmp_path: Path) -> None:
    raw = _write_cifar100(tmp_path / "cifar-100-python", 30, 10)
    s = load_dataset(DatasetSpec(name="cifar100", path=str(tmp_path), validation_size=6))
    assert (len(s.train[1]), len(s.val[1]), len(s.test[1])) == (24, 6, 10)
    assert s.num_classes == 100 and s.input_shape == (3, 32, 32)
    assert s.test[1].tolist() == raw["test"]["fine_labels"]  # fine labels, official test split in order
    pixel = np.asarray(raw["test"]["data"])[0, 1024] / 255.0  # first green pixel of the first test image
    assert float(s.test[0][0, 1, 0, 0]) == pytest.approx((pixel - 0.5) / 0.5, abs=1e-6)


def test_cifar10_official_train_split_as_pool(tmp_path: Path) -> None:
    from tests.test_data import _write_cifar

    _write_cifar(tmp_path / "cifar-10-batches-py", per_batch=10)
    s = load_dataset(DatasetSpec(name="cifar10", path=str(tmp_path), split="train", validation_size=5, test_size=7))
    assert (len(s.train[1]), len(s.val[1]), len(s.test[1])) == (38, 5, 7)  # 50 training images split three ways


def test_svhn_mat(tmp_path: Path) -> None:
    from scipy.io import savemat

    rng = np.random.default_rng(4)
    mats = {}
    for split, n in (("train", 20), ("test", 6)):
        x = rng.integers(0, 256, (32, 32, 3, n), dtype=np.uint8)
        y = (np.arange(n) % 10 + 1).astype(np.uint8).reshape(n, 1)  # SVHN labels digit 0 as 10
        savemat(tmp_path / f"{split}_32x32.mat", {"X": x, "y": y})
        mats[split] = (x, y)
    s = load_dataset(DatasetSpec(name="svhn", path=str(tmp_path), validation_size=4))
    assert (len(s.train[1]), len(s.val[1]), len(s.test[1])) == (16, 4, 6) and s.num_classes == 10
    x, y = mats["test"]
    assert s.test[1].tolist() == [int(v) % 10 for v in y[:, 0]]  # 10 -> 0
    expected = torch.from_numpy(x[..., 2].transpose(2, 0, 1).astype(np.float32) / 255.0).sub(0.5).div(0.5)
    assert torch.allclose(s.test[0][2], expected)


@pytest.mark.parametrize(("name", "hint"), [("mnist", "MNIST/raw"), ("fashion_mnist", "FashionMNIST/raw"),
                                            ("cifar10", "cifar-10-batches-py"), ("cifar100", "cifar-100-python"),
                                            ("svhn", "train_32x32.mat")])
def test_missing_files_name_the_path_and_layout(tmp_path: Path, name: str, hint: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_dataset(DatasetSpec(name=name, path=str(tmp_path)))
    assert e.value.field == "dataset.path" and hint in e.value.problem and "download" in e.value.fix
    with pytest.raises(ConfigError) as e:
        load_dataset(DatasetSpec(name=name, path=str(tmp_path / "absent")))
    assert e.value.field == "dataset.path"


@pytest.mark.parametrize(("spec", "n"), [
    (DatasetSpec(), 1797 - 360 - 180),
    (DatasetSpec(name="cifar10", path="x", validation_size=5000), 45000),
    (DatasetSpec(name="mnist", path="x", split="test", validation_size=1000, test_size=1000), 8000),
    (DatasetSpec(name="fashion_mnist", path="x", split="train", validation_size=1000, test_size=1000), 58000),
    (DatasetSpec(name="cifar100", path="x", validation_size=1000), 49000),
    (DatasetSpec(name="svhn", path="x", validation_size=3257), 70000),
    (DatasetSpec(name="imagefolder", path="x", classes=["a", "b"]), None),
])
def test_nominal_train_size_without_reading_data(spec: DatasetSpec, n: int | None) -> None:
    assert nominal_train_size(spec) == n


def test_split_applies_to_torchvision_datasets_only() -> None:
    with pytest.raises(ConfigError) as e:
        DatasetSpec(name="digits", split="test")
    assert e.value.field == "dataset.split"
    with pytest.raises(ConfigError) as e:
        DatasetSpec(name="mnist", path="x", split="extra")
    assert e.value.field == "dataset.split"
    with pytest.raises(ConfigError) as e:
        DatasetSpec(name="imagefolder", path="x", download=True, classes=["a", "b"])
    assert e.value.field == "dataset.download"


def _fashion_space(folder: Path, **dataset: object) -> dict[str, object]:
    return {"name": "fm", "dataset": {"name": "fashion_mnist", "path": str(folder), "split": "test",
                                      "validation_size": 10, "test_size": 10, **dataset},
            "model": {"name": "tanh_cnn"},
            "fixed": {"epochs": 1, "batch_size": 16, "max_grad_norm": 1.0, "optimizer": "sgd", "momentum": 0.0,
                      "noise_multiplier": 3.0},
            "space": {"learning_rate": {"type": "float", "low": 0.1, "high": 1.0, "log": True}},
            "default": {"learning_rate": 0.5},
            "privacy": {"delta": 1e-5, "stopping": "poisson", "mean": 2, "score_noise": 6.0}}


def test_a_folder_smaller_than_the_official_split_is_refused_before_the_charge(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 40, item 10: a folder in a built-in's format with fewer images than the official split (Fashion-MNIST's
    test split, 44 of 10,000 here) was planned on the official size (`dptune plan`: q = B/9,980) while 24 images
    trained. The search refuses it with the counts and the fix, exit 2, nothing charged; a declared
    ``dataset.pool_size`` is what `dptune plan` and the search then both use, and is checked against the folder."""
    import yaml

    from dptune import api
    from dptune.cli.search import main
    from dptune.config import parse_space
    from dptune.ledger import Ledger

    _write_mnist(tmp_path / "fm", "t10k", 44, gz=True)
    ledger = tmp_path / "ledger.sqlite"

    def search(space: dict[str, object]) -> tuple[int, str]:
        path = tmp_path / "space.yaml"
        path.write_text(yaml.safe_dump(space))
        rc = main(["--space", str(path), "--runs-dir", str(tmp_path / "runs"), "--ledger", str(ledger),
                   "--budget-epsilon", "1000"])
        return rc, capsys.readouterr().err

    rc, err = search(_fashion_space(tmp_path / "fm"))
    assert rc == 2, err
    assert "44 images" in err and "10,000" in err and "pool_size: 44" in err, err
    assert not ledger.exists() or Ledger(ledger).charges() == []
    rc, err = search(_fashion_space(tmp_path / "fm", pool_size=50))  # a declared size the folder does not hold
    assert rc == 2 and "dataset.pool_size" in err and "44 images" in err, err
    assert not ledger.exists() or Ledger(ledger).charges() == []
    # declared: the plan (which reads no data) is the one the search would charge
    declared = _fashion_space(tmp_path / "fm", pool_size=44)
    assert api.plan(declared).n_train == 24 == len(load_dataset(parse_space(declared, source=None).dataset).train[1])
    assert api.plan(_fashion_space(tmp_path / "fm")).n_train == 9980
    for bad in (0, 10_001, 20, True):  # not a subset of the split, or no training example left
        with pytest.raises(ConfigError) as e:
            DatasetSpec(name="fashion_mnist", path="x", split="test", validation_size=10, test_size=10, pool_size=bad)
        assert e.value.field == "dataset.pool_size"
    with pytest.raises(ConfigError) as e:
        DatasetSpec(name="digits", pool_size=100)
    assert e.value.field == "dataset.pool_size"
