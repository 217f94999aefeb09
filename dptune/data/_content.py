"""What identifies a dataset for its budget: content signatures of each example, as the model sees it.

A record's canonical vector is its feature values before any resize or normalisation, whatever the format it came
in: an image's stored levels scaled to [0, 1] (8-bit images: level/255, scikit-learn's digits: level/16), colour
channels averaged, flattened row by row; a table row's declared feature columns scaled by their declared bounds
(unclipped), in the natural order of their names (``p2`` before ``p10``: the order a file stores them in does not
matter). Never an id column, never the label (a relabelled or re-keyed copy is the same records). So digits built
in and digits exported to CSV, MNIST's IDX files and MNIST exported to PNG folders canonicalise alike.

Each record gets several signatures, so that a small edit leaves one intact. The threat model is an honest curator's
copies (an export, a resize, a crop), not an adversary rewriting the data (``docs/privacy.md``).

1. Values (scheme 1; images and tables). ``d >= SIMHASH_MIN_DIM`` features: the vector centred on its own mean (a
   brightness shift or a change of declared bounds cancels), then ``SIGNATURES`` bands of 48 sign bits of random
   projections (SimHash; Charikar 2002). A ±1/255 edit of MNIST moves the direction by about 1 %, so a band survives
   with ≈ 0.87: one of eight survives all but never. Fewer features (narrow tables): the scaled values on a grid of
   ``levels`` steps per unit at ``SIGNATURES`` grid offsets; jitter far below a step leaves one offset's cell whole.
2. Geometry (scheme 2; images only). A shift, crop, pad or flip moves every pixel, a resize resamples them: scheme 1
   sees other vectors. So each image is also put in a canonical frame before hashing (``_frames``): the background
   (the border's median) subtracted; the centroid and radius of gyration of the foreground (levels more than
   ``FOREGROUND`` from the background) fix a ``GRID`` x ``GRID`` window of ``WINDOW`` radii each side, sampled
   bilinearly after a Gaussian blur of ``BLUR`` samples (a resize is a scale and a blur: both cancel); each ring's
   mean removed (every centred digit is a blob: the rings are what they share); mirrored so that the horizontal
   skewness is negative (both orientations when it is within ``SKEW_TIE`` of 0). Then ``FRAME_BANDS`` SimHash bands
   of ``FRAME_BITS`` bits: more bits than scheme 1, because canonical frames of different digits are closer (nearest
   neighbours in MNIST at 0.1-0.2 rad) than a resize moves one (0.02-0.06 rad). Rates measured by
   ``bench/content_identity.py``.
3. Too little content to tell. A table whose declared features can take few values (integers 0..9 in five columns:
   17 bits) holds rows that unrelated tables hold too: such a row gets no signature (``MIN_RECORD_BITS``), and
   the ledger knows the table by its record ids alone.

A signature is a 16-byte sha256 of (scheme, dimension, band, quantised values): no raw value. The ledger keeps
only HMACs of signatures under the curator key (``dptune.ledger``), so a budget opened before scheme 2 holds
scheme-1 signatures alone and meets exact copies and small edits as before; ``dptune ledger adopt`` gives it the
scheme-2 ones. How many of a dataset's records share a signature with a budget's decides whether it holds that
budget's records (``dptune.ledger.SAME_DATASET_SHARE``, set from ``tests/test_content_identity.py``).
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Iterable, Sequence

import numpy as np

__all__ = ["SIGNATURES", "SIG_BYTES", "column_levels", "image_signatures", "natural_order", "row_signatures"]

SIGNATURES = 8  # per record, scheme 1: one a band (SimHash) or a grid offset (narrow tables)
SIG_BYTES = 16
SIMHASH_MIN_DIM = 16
BITS = 48  # per scheme-1 SimHash band
MAX_PIXELS = 64 * 64  # larger images are area-averaged to at most 64 x 64 first (deterministic, from the stored pixels)
# scheme 2, the canonical frame (values measured by bench/content_identity.py on MNIST and digits)
GRID = 16  # samples a side
WINDOW = 2.0  # radii of gyration each side of the centroid: MNIST's 20-pixel box for a radius of 5 pixels
BLUR = 0.5  # Gaussian sigma before sampling, in samples: below it a resize's resampling shows, above it digits blur
FOREGROUND = 0.1  # a level this close to the background weighs nothing in the moments (±1/255 noise, PNG ringing)
SKEW_TIE = 0.05  # |horizontal skewness| within it: both orientations (a resize moves skewness by ~0.01)
FRAME_BANDS, FRAME_BITS = 24, 128  # MNIST 5000 vs 5000: 96 bits 0.051 collide, 128 0.032; bands for resizes
MIN_RECORD_BITS = 24.0  # a table row that can take fewer than 2^24 values gets no signature
CONTINUOUS_LEVELS = 2.0 ** 16  # what one real-valued feature is counted as (a 2-feature table: 32 bits)
_TAG = b"dptune-content/1\0"
_FRAME_TAG = b"dptune-content/2\0frame\0"


def image_signatures(images: Iterable[np.ndarray], levels: float, geometry: bool = True) -> list[tuple[bytes, ...]]:
    """Signatures of images given channels first, (C, H, W) or (H, W), as stored levels 0..``levels``: scheme 1's
    and, unless ``geometry`` is False (what a budget opened before scheme 2 stores), scheme 2's."""
    rows: list[np.ndarray] = []
    for im in images:
        a = np.asarray(im, dtype=np.float64) / float(levels)
        rows.append(_area_limit(a.mean(axis=0) if a.ndim == 3 else a))
    values = signatures([r.reshape(-1) for r in rows])
    if not geometry:
        return values
    frames = [_frames(r) for r in rows]
    flat = [v for fs in frames for v in fs]
    hashed = iter(_simhash_frames(np.stack(flat)) if flat else [])
    return [sigs + tuple(s for _ in fs for s in next(hashed)) for sigs, fs in zip(values, frames, strict=True)]


def row_signatures(values: np.ndarray, levels: Sequence[float] | None = None) -> list[tuple[bytes, ...]]:
    """Signatures of table rows (N, d), each feature already scaled by its declared bounds; ``levels``: how many
    values each feature can take (``column_levels``). None: real-valued features."""
    x = np.asarray(values, dtype=np.float64)
    bits = sum(math.log2(max(1.0, min(CONTINUOUS_LEVELS, v))) for v in (levels or [CONTINUOUS_LEVELS] * x.shape[1]))
    if bits < MIN_RECORD_BITS:  # rows unrelated tables hold as well: known by their ids alone
        return [() for _ in range(x.shape[0])]
    return signatures(list(x))


def column_levels(raw: np.ndarray, low: float, high: float) -> float:
    """How many values a feature within its declared bounds can take: a column whose values all lie on a decimal
    lattice (integers, tenths, ... down to 1e-6) takes one per step; any other column is real-valued (inf). A copy
    (CSV, Parquet, float32) keeps the lattice, so the count, and whether rows are signed, do not change."""
    v = np.asarray(raw, dtype=np.float64)
    for k in range(7):
        scaled = v * 10.0 ** k
        if np.all(np.abs(scaled - np.round(scaled)) <= 1e-6 * np.maximum(1.0, np.abs(scaled))):
            return abs(high - low) * 10.0 ** k + 1.0
    return math.inf


def natural_order(names: Sequence[str]) -> list[int]:
    """Indices of ``names`` in natural order (``p2`` before ``p10``): a table's canonical feature order."""
    def key(i: int) -> list[tuple[int, int | str]]:
        return [(0, int(t)) if t.isdigit() else (1, t) for t in re.findall(r"\d+|\D+", names[i])]
    return sorted(range(len(names)), key=key)


def signatures(vectors: Sequence[np.ndarray]) -> list[tuple[bytes, ...]]:
    """Scheme 1's ``SIGNATURES`` signatures of each canonical vector (vectors of one length hashed in one batch)."""
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


def _sign_bits(z: np.ndarray, seed: list[int], bands: int, bits: int) -> np.ndarray:
    """(n, bands, bits/8) packed signs of fixed projections: the same for every dataset and ledger (not a secret;
    the HMAC is)."""
    n, d = z.shape
    proj = np.random.default_rng(seed).standard_normal((d, bands * bits)).astype(np.float32)
    out = np.empty((n, bands * bits), dtype=bool)
    for start in range(0, n, 4096):
        out[start:start + 4096] = (z[start:start + 4096].astype(np.float32) @ proj) > 0
    return np.packbits(out.reshape(n, bands, bits), axis=2)


def _simhash(x: np.ndarray) -> list[tuple[bytes, ...]]:
    n, d = x.shape
    z = x - x.mean(axis=1, keepdims=True)
    flat = np.abs(z).max(axis=1) < 1e-9  # a constant image: its mean level instead of a direction
    packed = _sign_bits(z, [0x5EED, d], SIGNATURES, BITS)
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


def _frames(a: np.ndarray) -> list[np.ndarray]:
    """The image (H, W) in its canonical frame: one vector of GRID² values, two when its orientation is a tie, none
    without foreground (a blank image: scheme 1 knows it by its level)."""
    from scipy import ndimage

    d = a - np.median(np.concatenate([a[0], a[-1], a[1:-1, 0], a[1:-1, -1]]))
    w = np.maximum(np.abs(d) - FOREGROUND, 0.0)
    total = float(w.sum())
    if total <= 0.0:
        return []
    ys, xs = np.arange(a.shape[0], dtype=np.float64), np.arange(a.shape[1], dtype=np.float64)
    wy, wx = w.sum(axis=1), w.sum(axis=0)
    cy, cx = float(wy @ ys) / total, float(wx @ xs) / total
    radius = math.sqrt(float(wy @ (ys - cy) ** 2 + wx @ (xs - cx) ** 2) / total)
    if radius < 0.5:  # a single dot: no scale to normalise by
        return []
    skew = float(wx @ (xs - cx) ** 3) / total / radius ** 3
    step = 2.0 * WINDOW * radius / GRID
    sigma = BLUR * step
    margin = int(math.ceil(4.0 * sigma)) + 1  # blurred content beyond the edge stays (a shift or pad must not cut it)
    padded = ndimage.gaussian_filter(np.pad(d, margin), sigma, mode="constant")
    offsets = (np.arange(GRID) - (GRID - 1) / 2.0) * step
    coords = np.meshgrid(cy + margin + offsets, cx + margin + offsets, indexing="ij")
    v = ndimage.map_coordinates(padded, coords, order=1, mode="grid-constant", cval=0.0).reshape(-1)
    v = v - _RING_MEAN @ v
    v = v.reshape(GRID, GRID)
    out = [v.reshape(-1)] if skew <= SKEW_TIE else []
    if skew >= -SKEW_TIE:
        out.append(v[:, ::-1].reshape(-1))
    return out


def _ring_mean() -> np.ndarray:
    """(GRID², GRID²): each sample replaced by the mean of its ring about the centre (unit-wide rings)."""
    g = np.arange(GRID) - (GRID - 1) / 2.0
    ring = np.floor(np.hypot(g[:, None], g[None, :])).astype(np.int64).reshape(-1)
    same = ring[:, None] == ring[None, :]
    return same / same.sum(axis=1, keepdims=True)


_RING_MEAN = _ring_mean()


def _simhash_frames(frames: np.ndarray) -> list[tuple[bytes, ...]]:
    packed = _sign_bits(frames, [0x5EED, 2, GRID * GRID], FRAME_BANDS, FRAME_BITS)
    return [tuple(_digest(_FRAME_TAG + bytes([b]) + packed[i, b].tobytes()) for b in range(FRAME_BANDS))
            for i in range(len(frames))]


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
