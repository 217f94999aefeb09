"""Synthetic data in the real on-disk formats, for smoke runs and throughput benches (no download): a CIFAR-10
python-batches folder (``bench/cifar10.py --smoke``, ``bench/gpu_pack.py``, ``bench/gpu_search.py``) and the ResNet-9
space reading it."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import yaml

__all__ = ["synthetic_cifar_space", "write_synthetic_cifar"]

SPACES = Path(__file__).resolve().parents[2] / "search_spaces"


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


def synthetic_cifar_space(folder: Path, per_batch: int, smoke: bool) -> dict[str, Any]:
    """``search_spaces/cifar10_resnet9.yaml`` reading the synthetic ``folder`` (``write_synthetic_cifar``)."""
    space: dict[str, Any] = yaml.safe_load((SPACES / "cifar10_resnet9.yaml").read_text())
    space["dataset"]["path"] = str(folder.resolve())
    if per_batch != 10000:  # not CIFAR-10's 50,000 training images: declared, as the planner requires
        space["dataset"]["pool_size"] = 5 * per_batch
    if smoke:  # 5 x 64 images: a validation split and a batch that fit
        space["dataset"]["validation_size"] = 64
        space["fixed"].update(batch_size=32, physical_batch_size=16)
    return space
