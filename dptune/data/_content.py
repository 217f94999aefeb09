"""What identifies a dataset for its budget: a canonical content signature of each example, as the model sees it.

A record's canonical vector is its feature values before any resize or normalisation, whatever the format it came
in: an image's stored levels scaled to [0, 1] (8-bit images: level/255, scikit-learn's digits: level/16), colour
channels averaged, flattened row by row; a table row's declared feature columns scaled by their declared bounds
(unclipped), in declared order. Never an id column, never the label (a relabelled or re-keyed copy is the same
records). So digits built in and digits exported to CSV, MNIST's IDX files and MNIST exported to PNG folders
canonicalise alike.

Each record gets ``SIGNATURES`` signatures, so that a small edit (±1/255 per pixel, a CSV round trip, jitter in a
table's values) leaves at least one intact:

* ``d >= SIMHASH_MIN_DIM`` features (images; wide tables): the vector is centred on its own mean (a brightness
  shift or a change of declared bounds cancels), then each signature is 48 sign bits of random projections
  (SimHash; Charikar 2002), one independent band of projections per signature. A ±1/255 edit of MNIST moves the
  direction by about 1 %, so a bit flips with probability ≈ 0.003 and a band survives with ≈ 0.87: one of eight
  survives all but never. Two different images share a band only when nearly parallel.
* fewer features (narrow tables): the scaled values on a grid of ``levels`` steps per unit (finer for fewer
  features: about 40 bits a record), at ``SIGNATURES`` grid offsets; jitter far below a step leaves every offset's
  cell unchanged, and one near a cell edge leaves the other offsets'.

A signature is a 16-byte sha256 of (scheme, dimension, band, quantised values): no raw value. The ledger keeps
only HMACs of signatures under the curator key (``dptune.ledger``). How many of a dataset's records share a
signature with a budget's decides whether it holds that budget's records (``dptune.ledger.SAME_DATASET_SHARE``,
set from the shares measured in ``tests/test_content_identity.py``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

import numpy as np

__all__ = ["SIGNATURES", "SIG_BYTES", "image_signatures", "row_signatures"]

SIGNATURES = 8  # per record: one a band (SimHash) or a grid offset (narrow tables)
SIG_BYTES = 16
SIMHASH_MIN_DIM = 16
BITS = 48  # per SimHash band
MAX_PIXELS = 64 * 64  # larger images are area-averaged to at most 64 x 64 first (deterministic, from the stored pixels)
_TAG = b"dptune-content/1\0"


def image_signatures(images: Iterable[np.ndarray], levels: float) -> list[tuple[bytes, ...]]:
    """Signatures of images given channels first, (C, H, W) or (H, W), as stored levels 0..``levels``."""
    rows: list[np.ndarray] = []
    for im in images:
        a = np.asarray(im, dtype=np.float64) / float(levels)
        rows.append(_area_limit(a.mean(axis=0) if a.ndim == 3 else a).reshape(-1))
    return signatures(rows)


def row_signatures(values: np.ndarray) -> list[tuple[bytes, ...]]:
    """Signatures of table rows (N, d), each feature already scaled by its declared bounds."""
    return signatures(list(np.asarray(values, dtype=np.float64)))


def signatures(vectors: Sequence[np.ndarray]) -> list[tuple[bytes, ...]]:
    """``SIGNATURES`` signatures of each canonical vector (vectors of one length are hashed in one batch)."""
    out: list[tuple[bytes, ...]] = [()] * len(vectors)
    by_dim: dict[int, list[int]] = {}
    for i, v in enumerate(vectors):
        by_dim.setdefault(int(v.shape[0]), []).append(i)
    for d, idx in by_dim.items():
        batch = np.stack([vectors[i] for i in idx]) if idx else np.zeros((0, d))
        sigs = _simhash(batch) if d >= SIMHASH_MIN_DIM else _grid(batch)
        for i, s in zip(idx, sigs, strict=True):
            out[i] = s
    return out


def _simhash(x: np.ndarray) -> list[tuple[bytes, ...]]:
    n, d = x.shape
    z = x - x.mean(axis=1, keepdims=True)
    flat = np.abs(z).max(axis=1) < 1e-9  # a constant image: its mean level instead of a direction
    # fixed projections per dimension: the same for every dataset and ledger (not a secret; the HMAC is)
    proj = np.random.default_rng([0x5EED, d]).standard_normal((d, SIGNATURES * BITS)).astype(np.float32)
    bits = np.empty((n, SIGNATURES * BITS), dtype=bool)
    for start in range(0, n, 4096):
        bits[start:start + 4096] = (z[start:start + 4096].astype(np.float32) @ proj) > 0
    packed = np.packbits(bits.reshape(n, SIGNATURES, BITS), axis=2)
    head = _TAG + b"simhash\0" + d.to_bytes(4, "big")
    out: list[tuple[bytes, ...]] = []
    for i in range(n):
        if flat[i]:
            level = int(round(float(x[i, 0]) * 64))
            out.append((_digest(head + b"flat" + level.to_bytes(4, "big", signed=True)),))
            continue
        out.append(tuple(_digest(head + bytes([b]) + packed[i, b].tobytes()) for b in range(SIGNATURES)))
    return out


def _grid(x: np.ndarray) -> list[tuple[bytes, ...]]:
    n, d = x.shape
    levels = float(min(2 ** 12, max(4, round(2 ** (32 / max(d, 1))))))  # about 32 bits a record
    head = _TAG + b"grid\0" + d.to_bytes(4, "big")
    cells = [np.floor(x * levels + k / SIGNATURES).astype(np.int64) for k in range(SIGNATURES)]
    return [tuple(_digest(head + bytes([k]) + cells[k][i].tobytes()) for k in range(SIGNATURES)) for i in range(n)]


def _area_limit(a: np.ndarray) -> np.ndarray:
    """An image over ``MAX_PIXELS`` averaged over equal blocks down to at most 64 x 64 (no interpolation)."""
    h, w = a.shape
    if h * w <= MAX_PIXELS:
        return a
    fh, fw = -(-h // 64), -(-w // 64)
    a = a[: h - h % fh, : w - w % fw]
    return a.reshape(a.shape[0] // fh, fh, a.shape[1] // fw, fw).mean(axis=(1, 3))


def _digest(message: bytes) -> bytes:
    return hashlib.sha256(message).digest()[:SIG_BYTES]
