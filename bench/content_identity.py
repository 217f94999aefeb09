"""Does a budget follow its records' copies, and only them? Matched shares of copies and of unrelated data.

    python bench/content_identity.py [--mnist ../shared/data/mnist-t10k] [--n 5000]

For each copy an honest curator makes (a shift, a flip, a resize, padding, a crop, a PNG or ±1/255 round trip, a
table's columns in another order): the share of the copy's records that meet the original's content signatures,
as the ledger counts it (over the smaller set), before issue 59 item 4 (scheme 1 alone, a table in file order, every
table row signed) and now. For unrelated data (MNIST's first n test images against the next n, digits against
digits and against MNIST, unrelated tables): the share that collides, i.e. the false-positive share. The last
column says what the ledger decides now: a copy must reach ``SAME_DATASET_SHARE`` (charged to the original's
budget), unrelated data must stay below it (a budget of its own). MNIST rows need the t10k IDX files (skipped
without them); digits and tables are bundled with scikit-learn.
"""

from __future__ import annotations

import argparse
import gzip
import io
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import yaml
from PIL import Image

from dptune.data import column_levels, image_signatures, row_signatures
from dptune.ledger import SAME_DATASET_SHARE

Sigs = list[tuple[bytes, ...]]
Image8 = np.ndarray  # (H, W) uint8
ROOT = Path(__file__).resolve().parent.parent


def share(data: Sigs, budget: Sigs) -> float:
    """The ledger's measure: records of ``data`` meeting ``budget``'s signatures, over the smaller set's size."""
    theirs = {s for sigs in budget for s in sigs}
    return sum(any(s in theirs for s in sigs) for sigs in data) / max(1, min(len(data), len(budget)))


def shift(im: Image8, down: int, right: int) -> Image8:
    """Moved by whole pixels, the vacated rows and columns zero (a curator's off-by-one crop and pad)."""
    out = np.zeros_like(im)
    h, w = im.shape
    out[down:, right:] = im[:h - down, :w - right]
    return out


def resize(im: Image8, side: int, how: Image.Resampling = Image.Resampling.BILINEAR) -> Image8:
    """PIL's resize (bilinear: torchvision's ``Resize``; bicubic: PIL's default)."""
    return np.asarray(Image.fromarray(im).resize((side, side), how))


def pad(im: Image8, side: int) -> Image8:
    top, left = (side - im.shape[0]) // 2, (side - im.shape[1]) // 2
    out = np.zeros((side, side), np.uint8)
    out[top:top + im.shape[0], left:left + im.shape[1]] = im
    return out


def crop(im: Image8, side: int) -> Image8:
    top, left = (im.shape[0] - side) // 2, (im.shape[1] - side) // 2
    return im[top:top + side, left:left + side]


def png(im: Image8) -> np.ndarray:
    """A PNG round trip read back as RGB (C, H, W), as the imagefolder reader reads it."""
    buf = io.BytesIO()
    Image.fromarray(im).save(buf, format="PNG")
    return np.asarray(Image.open(io.BytesIO(buf.getvalue())).convert("RGB")).transpose(2, 0, 1)


def image_copies(side: int, seed: int = 0) -> dict[str, Callable[[Image8], np.ndarray]]:
    """The copies of an 8-bit image measured (``side``: its stored size)."""
    rng = np.random.default_rng(seed)
    big, small = max(32, side + 4), max(side - 2, 4)
    return {"shift right 1": lambda im: shift(im, 0, 1), "shift down 1": lambda im: shift(im, 1, 0),
            "flip horizontally": lambda im: im[:, ::-1],
            "resize 32 (bilinear)": lambda im: resize(im, 32),
            "resize 32 (bicubic)": lambda im: resize(im, 32, Image.Resampling.BICUBIC),
            f"pad {big}": lambda im: pad(im, big), f"crop {small}": lambda im: crop(im, small),
            "PNG round trip": png,
            "±1/255 noise": lambda im: np.clip(im.astype(np.int64) + rng.integers(-1, 2, im.shape), 0, 255)}


def rows_for(name: str, before: float, now: float, copy: bool) -> str:
    ok = now >= SAME_DATASET_SHARE if copy else now < SAME_DATASET_SHARE
    verdict = ("charged to its budget" if now >= SAME_DATASET_SHARE else "fresh budget") + (" ✓" if ok else " ✗")
    return f"| {name} | {before:.3f} | {now:.3f} | {verdict} |"


def images(name: str, budget: list[Image8], others: dict[str, tuple[list[np.ndarray], float]]) -> list[str]:
    """Rows for copies of ``budget`` (8-bit images) and for unrelated image sets (images, their levels)."""
    base, base_v1 = image_signatures(budget, 255), image_signatures(budget, 255, geometry=False)
    out = []
    for what, copy in image_copies(budget[0].shape[0]).items():
        copies = [copy(im) for im in budget]
        out.append(rows_for(f"{name}: {what}", share(image_signatures(copies, 255, geometry=False), base_v1),
                            share(image_signatures(copies, 255), base), True))
    for what, (ims, levels) in others.items():
        out.append(rows_for(f"{name} vs {what} (unrelated)", share(image_signatures(ims, levels, geometry=False),
                                                                   base_v1),
                            share(image_signatures(ims, levels), base), False))
    return out


def tables() -> list[str]:
    """Rows for a table's columns reordered (through the table reader) and for unrelated tables."""
    from sklearn.datasets import load_breast_cancer, load_digits, load_iris, load_wine

    out = []
    x = np.random.default_rng(6).random((2000, 6))
    reordered = _through_reader(x, list(range(6))[::-1])
    out.append(rows_for("table (6 real features): columns reordered in the file",
                        share(row_signatures(x[:, ::-1]), row_signatures(x)), share(reordered, _through_reader(x)),
                        True))
    digits = load_digits()
    as_csv = _through_reader(digits.data, list(np.random.default_rng(1).permutation(64)), bounds=(0.0, 16.0))
    out.append(rows_for("digits as CSV, columns shuffled, vs the built-in digits", share(
        row_signatures(digits.data[:, np.random.default_rng(1).permutation(64)] / 16), image_signatures(
            digits.images, 16, geometry=False)), share(as_csv, image_signatures(digits.images, 16)), True))
    rng = np.random.default_rng(4)
    cancer = load_breast_cancer(as_frame=True).frame
    declared = yaml.safe_load((ROOT / "search_spaces" / "breast_cancer.yaml").read_text())["dataset"]["features"]
    for what, data, bounds in [
            ("4 integer features 0..5", rng.integers(0, 6, (4000, 4)).astype(float), None),
            ("8 integer features 0..9", rng.integers(0, 10, (4000, 8)).astype(float), None),
            ("6 real features", rng.random((4000, 6)), None), ("iris (4 features, tenths)", load_iris().data, None),
            ("wine (13 features)", load_wine().data, None),
            ("breast cancer (30 features, its space's bounds)", cancer[list(declared)].to_numpy(dtype=np.float64),
             np.array(list(declared.values()), dtype=np.float64).T)]:
        half = len(data) // 2
        # declared bounds, else whole units around the data (what a documentation would give)
        low, high = bounds if bounds is not None else (np.floor(data.min(axis=0)), np.ceil(data.max(axis=0)))
        scaled = (data - low) / (high - low)
        levels = [column_levels(data[:, j], low[j], high[j]) for j in range(data.shape[1])]
        out.append(rows_for(f"{what}: one half vs the other (unrelated)",
                            share(row_signatures(scaled[:half]), row_signatures(scaled[half:])),
                            share(row_signatures(scaled[:half], levels), row_signatures(scaled[half:], levels)),
                            False))
    return out


def _through_reader(x: np.ndarray, order: list[int] | None = None, bounds: tuple[float, float] = (0.0, 1.0)) -> Sigs:
    """``x``'s rows written to CSV (columns ``f0..`` in ``order``) and read back by dptune's table reader."""
    import tempfile

    import pyarrow as pa
    import pyarrow.csv as pcsv

    from dptune.config import DatasetSpec
    from dptune.data import load_dataset

    order = order if order is not None else list(range(x.shape[1]))
    columns = {f"f{j}": x[:, j] for j in order}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "t.csv"
        pcsv.write_csv(pa.table({**columns, "label": np.arange(len(x)) % 2}), path)
        spec = DatasetSpec(name="table", path=str(path), label="label", classes=[0, 1], validation_size=10, test_size=10,
                           features={f"f{j}": list(bounds) for j in range(x.shape[1])})
        return load_dataset(spec).content_signatures()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mnist", type=Path, default=ROOT.parent / "shared" / "data" / "mnist-t10k")
    parser.add_argument("--n", type=int, default=5000, help="MNIST images in the budget (and as many unrelated)")
    args = parser.parse_args(argv)
    from sklearn.datasets import load_digits

    start = time.perf_counter()
    digits = load_digits().images
    digits8 = [np.round(im * 255 / 16).astype(np.uint8) for im in digits]  # digits exported as 8-bit images
    print(f"threshold SAME_DATASET_SHARE = {SAME_DATASET_SHARE}\n")
    print("| data | share before | share now | the ledger now |\n|---|---|---|---|")
    lines: list[str] = []
    mnist = args.mnist / "t10k-images-idx3-ubyte.gz"
    if mnist.is_file():
        with gzip.open(mnist) as f:
            all_mnist = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 28, 28)
        budget, other = list(all_mnist[:args.n]), list(all_mnist[args.n:2 * args.n])
        lines += images(f"MNIST test[:{args.n}]", budget, {f"MNIST test[{args.n}:{2 * args.n}]": (other, 255),
                                                         "digits": (list(digits), 16)})
    else:
        print(f"(MNIST rows skipped: {mnist} is not here)", file=sys.stderr)
    lines += images("digits (as 8-bit)", digits8, {})
    lines.append(rows_for("digits: first 900 vs the other 897 (unrelated)",
                          share(image_signatures(digits[:900], 16, geometry=False),
                                image_signatures(digits[900:], 16, geometry=False)),
                          share(image_signatures(digits[:900], 16), image_signatures(digits[900:], 16)), False))
    lines += tables()
    print("\n".join(lines))
    print(f"\n({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
