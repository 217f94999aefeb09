"""The Splits value and the subsampling used for tuning on part of the data."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from dptune.config import ConfigError

Pair = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True, eq=False)
class Splits:
    """train/val/test as (x float32 N x C x H x W, y int64) pairs, already normalised. A table's rows are
    (N, 1, 1, d): one channel, one row of d features."""

    train: Pair
    val: Pair
    test: Pair
    num_classes: int
    input_shape: tuple[int, int, int]
    # digests of the source records when the tensors depend on user choices (a table: which columns, which
    # bounds); None: the tensors themselves (fixed preprocessing) identify the examples
    record_digests: tuple[bytes, ...] | None = None
    # the privacy unit: one identifier per record of train ∪ validation ∪ test (a table's declared id column,
    # a built-in's "<name>/<official split>/<index>", an imagefolder's relative path); None: a table without
    # dataset.id_column, whose records the ledger can only know by their content
    record_ids: tuple[str, ...] | None = None
    # what identifies each record for its budget, in the order of record_ids (the source's): its content signatures
    # (``dptune.data._content``: the model's input before any resize or normalisation, never an id or a label);
    # None: computed from the tensors (a Splits built outside the loaders)
    record_signatures: tuple[tuple[bytes, ...], ...] | None = None

    def example_digests(self) -> list[bytes]:
        """sha256 of every example (train ∪ validation ∪ test; image bytes + label, or the source record),
        sorted. Curator-side only (the ledger): an exact hash of private records decides membership of the
        last one. Computed once per Splits (the search needs them for the fingerprint and the ledger)."""
        return list(self._sorted_digests)

    def content_signatures(self) -> list[tuple[bytes, ...]]:
        """Each record's content signatures (curator-side only, like the digests), in the order of record_ids."""
        return list(self._signatures)

    @functools.cached_property
    def _signatures(self) -> tuple[tuple[bytes, ...], ...]:
        if self.record_signatures is not None:
            return self.record_signatures
        from dptune.data._content import image_signatures

        # the tensors are normalised and maybe resized: the signatures' direction (centred, signs of projections)
        # is unchanged by a fixed affine normalisation, not by a resize; the loaders give the stored pixels'
        xs = [p[0].detach().cpu().numpy() for p in (self.train, self.val, self.test)]
        return tuple(image_signatures((x for part in xs for x in part), 1.0))

    @functools.cached_property
    def _sorted_digests(self) -> tuple[bytes, ...]:
        if self.record_digests is not None:
            return tuple(sorted(self.record_digests))
        digests = []
        for x, y in (self.train, self.val, self.test):
            xa = x.detach().cpu().contiguous().numpy()
            ya = y.detach().cpu().numpy().astype(np.int64)
            for i in range(len(ya)):
                digests.append(hashlib.sha256(xa[i].tobytes() + ya[i].tobytes()).digest())
        return tuple(sorted(digests))

    def pool_fingerprint(self) -> str:
        """sha256 over the *set* of all examples, independent of the split: the privacy ledger's key, so
        re-splitting the same data cannot open a fresh budget. Curator-side only, like the digests."""
        h = hashlib.sha256(b"dptune-pool/1")
        for d in self.example_digests():
            h.update(d)
        return h.hexdigest()


def make_splits(train: Pair, val: Pair, test: Pair, num_classes: int,
                record_digests: tuple[bytes, ...] | None = None, record_ids: tuple[str, ...] | None = None,
                signatures: list[tuple[bytes, ...]] | None = None) -> Splits:
    def fix(p: Pair) -> Pair:
        return p[0].to(torch.float32).contiguous(), p[1].to(torch.int64).contiguous()

    tr = fix(train)
    c, h, w = tr[0].shape[1:]
    if signatures is not None and record_ids is not None and len(signatures) != len(record_ids):
        raise AssertionError("one content signature tuple per record id")  # a loader's bug, never user input
    return Splits(tr, fix(val), fix(test), num_classes, (int(c), int(h), int(w)), record_digests, record_ids,
                  tuple(signatures) if signatures is not None else None)


def poisson_subsample(splits: Splits, fraction: float, seed: int) -> Splits:
    """Keep each training example independently with probability ``fraction`` (val/test unchanged)."""
    if not 0 < fraction <= 1:
        raise ConfigError("search.tune_fraction", f"{fraction} is not in (0, 1]", "choose e.g. 0.25, or 1 for off")
    x, y = splits.train
    keep = np.random.default_rng(seed).random(len(y)) < fraction
    if not keep.any():
        raise ConfigError("search.tune_fraction", f"a fraction of {fraction} kept no training example",
                          "choose a larger fraction")
    idx = torch.from_numpy(np.flatnonzero(keep))
    return dataclasses.replace(splits, train=(x[idx], y[idx]))


def split_indices(n: int, sizes: tuple[int, ...], seed: int, field: str) -> list[np.ndarray]:
    """Deterministic disjoint index sets of the given sizes, plus the rest (last element)."""
    if sum(sizes) >= n:
        raise ConfigError(field, f"the held-out splits ({' + '.join(map(str, sizes))}) leave no training "
                          f"examples out of {n}", f"choose held-out sizes that sum to less than {n}")
    perm = np.random.default_rng(seed).permutation(n)
    out, start = [], 0
    for s in sizes:
        out.append(np.sort(perm[start:start + s]))
        start += s
    out.append(np.sort(perm[start:]))
    return out
