"""Synthetic data in the real on-disk formats, for smoke runs and throughput benches (no download): a CIFAR-10
python-batches folder (``bench/cifar10.py --smoke``, ``bench/gpu_pack.py``)."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["write_synthetic_cifar"]


def write_synthetic_cifar(folder: Path, per_batch: int = 64, n_test: int = 64, seed: int = 0) -> Path:
    """A CIFAR-10 python-batches folder (same pickle layout as cifar-10-python.tar.gz) of random images
    whose labels are learnable (class-dependent mean colour), so a short run can beat chance."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    palette = rng.integers(40, 216, (10, 3))

    def batch(n: int, name: str) -> dict[str, Any]:
        labels = rng.integers(0, 10, n)
        base = np.repeat(palette[labels], 1024, axis=1)  # (n, 3*1024): R plane, G plane, B plane
        data = np.clip(base + rng.normal(0, 40, base.shape), 0, 255).astype(np.uint8)
        return {"batch_label": name, "labels": [int(v) for v in labels], "data": data,
                "filenames": [f"{name}_{i}.png" for i in range(n)]}

    # string keys, as torchvision reads the original Python 2 pickles (encoding="latin1")
    for i in range(1, 6):
        (folder / f"data_batch_{i}").write_bytes(pickle.dumps(batch(per_batch, f"data_batch_{i}"), protocol=2))
    (folder / "test_batch").write_bytes(pickle.dumps(batch(n_test, "test_batch"), protocol=2))
    meta = {"label_names": [f"class{i}" for i in range(10)], "num_cases_per_batch": per_batch, "num_vis": 3072}
    (folder / "batches.meta").write_bytes(pickle.dumps(meta, protocol=2))
    return folder
