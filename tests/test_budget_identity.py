"""A dataset's budget follows its records, whatever their ids or format (issue 40 items 5-7).

Item 5: seven copies of budgeted data that each opened a fresh budget from plain ``--budget-epsilon`` (re-keyed and
re-pseudonymised ids, zero-padded ids through a CSV round trip, the table without its id column, digits exported to
CSV, MNIST exported to PNG folders, MNIST's files placed as the ``train`` split with pixels +1/255) are each charged
to the original's budget, and no budget is opened. A copy that keeps the ids but not the content (a feature column
added, values jittered beyond a small edit) is refused until ``adopt`` or ``new-budget`` says which records it holds.
Item 6: an unrelated table with ids 0..568 and another dataset in MNIST's format are refused the same way (ids alone
cannot tell them from such a copy) and get budgets of their own through ``new-budget``, never charged to the budget
whose ids look alike. Item 7: ``alc.public`` refuses an export of
budgeted images. Every search draws K = 0 (the test hook): the whole CLI path up to the release, without Ray."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest

from tests.test_budgets import World
from tests.test_data_formats import SHARED_MNIST, _write_idx

MNIST_N = 1000  # the first 1,000 images of MNIST's real test split keep these tests fast
needs_mnist = pytest.mark.skipif(not SHARED_MNIST.is_dir(), reason="../shared/data/mnist-t10k is not here (a user's clone)")


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> World:
    return World(tmp_path, monkeypatch, capsys)


def _space(dataset: dict[str, Any], model: dict[str, Any]) -> dict[str, Any]:
    return {"name": "copy", "dataset": dataset, "model": model,
            "fixed": {"epochs": 1, "batch_size": 16, "max_grad_norm": 1.0, "optimizer": "sgd", "momentum": 0.0,
                      "clipping": "auto"},
            "space": {"learning_rate": {"type": "float", "low": 0.1, "high": 1.0, "log": True},
                      "noise_multiplier": {"type": "float", "low": 3.0, "high": 4.0}},
            "default": {"learning_rate": 0.5, "noise_multiplier": 3.0},
            "privacy": {"delta": 1e-5, "stopping": "poisson", "mean": 2, "score_noise": 6.0}}


MLP = {"name": "mlp", "kwargs": {"hidden": [8], "norm": "group", "act": "tanh"}}
CNN = {"name": "tanh_cnn"}


def _mnist(n: int = MNIST_N) -> tuple[np.ndarray, np.ndarray]:
    import gzip

    with gzip.open(SHARED_MNIST / "t10k-images-idx3-ubyte.gz") as f:
        images = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 28, 28)
    with gzip.open(SHARED_MNIST / "t10k-labels-idx1-ubyte.gz") as f:
        labels = np.frombuffer(f.read(), np.uint8, offset=8)
    return images[:n], labels[:n]


def _idx_folder(folder: Path, prefix: str, images: np.ndarray, labels: np.ndarray) -> dict[str, Any]:
    folder.mkdir(parents=True, exist_ok=True)
    _write_idx(folder / f"{prefix}-images-idx3-ubyte", images, gz=False)
    _write_idx(folder / f"{prefix}-labels-idx1-ubyte", labels, gz=False)
    return {"name": "mnist", "path": str(folder), "split": "train" if prefix == "train" else "test",
            "validation_size": 50, "test_size": 50, "pool_size": len(labels)}  # a subset, declared as one


def _png_folder(root: Path, images: np.ndarray, labels: np.ndarray) -> dict[str, Any]:
    from PIL import Image

    for i, (im, c) in enumerate(zip(images, labels, strict=True)):
        (root / "train" / str(c)).mkdir(parents=True, exist_ok=True)
        Image.fromarray(im).save(root / "train" / str(c) / f"{i:05d}.png")  # 8-bit greyscale, as exporters write
    return {"name": "imagefolder", "path": str(root), "validation_size": 50, "test_size": 50,
            "classes": [str(c) for c in range(10)]}


def _features(n: int, d: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"f{j}": rng.random(n) for j in range(d)}


def _csv(path: Path, columns: dict[str, Any]) -> Path:
    pcsv.write_csv(pa.table(columns), path)
    return path


def _table(path: Path, features: list[str], bounds: tuple[float, float] = (0.0, 1.0), classes: list[Any] | None = None,
           id_column: str | None = "id") -> dict[str, Any]:
    return {"name": "table", "path": str(path), "label": "y", "classes": classes or [0, 1],
            **({"id_column": id_column} if id_column else {}),
            "features": {f: list(bounds) for f in features}, "validation_size": 20, "test_size": 20}


def _charged_to(world: World, first: str, copies: dict[str, dict[str, Any]]) -> None:
    """Each copy: charged to the budget ``first`` (its certificate names it), no budget opened."""
    for name, raw in copies.items():
        before = world.budgets()
        rc, out, dataset_id = world.search(raw, "--budget-epsilon", "1000")
        assert rc == 0, (name, out)
        assert dataset_id == first and "opened a privacy budget" not in out, (name, out.splitlines())
        after = world.budgets()
        assert list(after) == [first] and after[first][1] == before[first][1] + 1, name


def test_table_copies_under_other_ids_are_charged_to_its_budget(world: World) -> None:
    """Re-keyed ids, re-pseudonymised ids, zero-padded ids through a CSV round trip (``00017`` -> ``17.0``) and the
    table without its id column share no id with the original: each is charged to the original's budget."""
    n = 300
    cols = _features(n, 6, seed=0)
    y = [i % 2 for i in range(n)]
    names = list(cols)
    base = world.tmp / "base.parquet"  # string ids "00017": a CSV round trip reads them back as numbers (17.0)
    pq.write_table(pa.table({"id": [f"{i:05d}" for i in range(n)], **cols, "y": y}), base)
    rc, out, first = world.search(_space(_table(base, names), MLP), "--budget-epsilon", "1000")
    assert rc == 0 and first is not None, out
    perm = np.random.default_rng(1).permutation(n)
    copies = {
        "re-keyed": _csv(world.tmp / "rekeyed.csv", {"id": [int(i) + 10_000 for i in perm], **cols, "y": y}),
        "re-pseudonymised": _csv(world.tmp / "pseudo.csv", {"id": [f"x{i:x}z" for i in perm], **cols, "y": y}),
        "csv round trip": _csv(world.tmp / "float.csv", {"id": [float(i) for i in range(n)], **cols, "y": y}),
    }
    raws = {k: _space(_table(p, names), MLP) for k, p in copies.items()}
    raws["no id column"] = _space(_table(_csv(world.tmp / "noid.csv", {**cols, "y": y}), names, id_column=None), MLP)
    _charged_to(world, first, raws)


def test_digits_exported_to_csv_are_charged_to_the_builtins_budget(world: World) -> None:
    from sklearn.datasets import load_digits

    d = load_digits()
    rc, out, first = world.search(_space({"name": "digits", "validation_size": 100, "test_size": 100},
                                         {"name": "gn_cnn"}), "--budget-epsilon", "1000")
    assert rc == 0 and first is not None, out
    pixels = {f"p{j}": d.data[:, j].astype(np.int64) for j in range(64)}
    path = _csv(world.tmp / "digits.csv", {"id": list(range(len(d.target))), **pixels, "y": d.target.astype(np.int64)})
    as_table = _table(path, list(pixels), bounds=(0.0, 16.0), classes=list(range(10)))
    other_bounds = _table(path, list(pixels), bounds=(0.0, 255.0), classes=list(range(10)))  # not what the builtin sees
    _charged_to(world, first, {"digits as CSV": _space(as_table, MLP), "other bounds": _space(other_bounds, MLP)})


@needs_mnist
def test_mnist_exports_are_charged_to_its_budget(world: World) -> None:
    """MNIST's images as a PNG folder, and as the ``train`` split's files with every pixel +1/255."""
    images, labels = _mnist()
    rc, out, first = world.search(_space(_idx_folder(world.tmp / "mnist", "t10k", images, labels), CNN),
                                  "--budget-epsilon", "1000")
    assert rc == 0 and first is not None, out
    plus = np.minimum(images.astype(np.int64) + 1, 255).astype(np.uint8)
    _charged_to(world, first, {
        "png folder": _space(_png_folder(world.tmp / "png", images, labels), CNN),
        "train split +1/255": _space(_idx_folder(world.tmp / "plus", "train", plus, labels), CNN)})


def test_an_unrelated_table_with_the_same_ids_gets_its_own_budget(world: World) -> None:
    """Item 6: digits as a CSV with ids 0..1796 is budgeted; an unrelated table with ids 0..568 is other records.
    Its ids alone cannot tell it from a copy of the digits with their content changed, so it is refused until
    ``new-budget`` opens its own budget explicitly; then it is charged to that budget only, never the digits'."""
    from sklearn.datasets import load_digits

    d = load_digits()
    pixels = {f"p{j}": d.data[:, j] for j in range(64)}
    path = _csv(world.tmp / "digits.csv", {"id": list(range(len(d.target))), **pixels, "y": d.target.astype(np.int64)})
    rc, out, digits_id = world.search(_space(_table(path, list(pixels), (0.0, 16.0), list(range(10))), MLP),
                                      "--budget-epsilon", "1000")
    assert rc == 0 and digits_id is not None, out
    n = 569
    cols = _features(n, 10, seed=3)
    other = _csv(world.tmp / "other.csv", {"id": list(range(n)), **cols, "y": [i % 2 for i in range(n)]})
    raw = _space(_table(other, list(cols)), MLP)
    rc, out, other_id = world.search(raw, "--budget-epsilon", "1000")  # its ids look like the digits budget's:
    assert rc == 2 and other_id is None and " new-budget " in out, out  # refused until the curator says it is other data
    assert len(world.budgets()) == 1 and world.budgets()[digits_id][1] == 1
    rc, out = world.new_budget(raw, "--epsilon", "1000", "--delta", "1e-5")
    assert rc == 0, out
    rc, out, other_id = world.search(raw)
    assert rc == 0 and other_id not in (None, digits_id), out
    budgets = world.budgets()
    assert budgets[digits_id][1] == 1 and budgets[other_id][1] == 1  # the digits budget was not charged
    rc, out, again = world.search(_space(_table(other, list(cols)), MLP))
    assert rc == 0 and again == other_id and world.budgets()[digits_id][1] == 1, out


@needs_mnist
def test_another_dataset_in_mnists_format_gets_its_own_budget(world: World) -> None:
    """Item 6: IDX files of other images read as ``mnist`` carry ids ``mnist/test/<i>`` too: not MNIST's records,
    but refused until ``new-budget`` (ids alone cannot tell them from MNIST heavily edited); then each is charged
    to its own budget."""
    images, labels = _mnist(300)
    rc, out, first = world.search(_space(_idx_folder(world.tmp / "mnist", "t10k", images, labels), CNN),
                                  "--budget-epsilon", "1000")
    assert rc == 0 and first is not None, out
    other = np.random.default_rng(5).integers(0, 256, images.shape, dtype=np.uint8)
    raw = _space(_idx_folder(world.tmp / "other", "t10k", other, labels), CNN)
    rc, out, second = world.search(raw, "--budget-epsilon", "1000")
    assert rc == 2 and second is None and len(world.budgets()) == 1, out  # MNIST's ids, not its content: refused
    rc, out = world.new_budget(raw, "--epsilon", "1000", "--delta", "1e-5")
    assert rc == 0, out
    rc, out, second = world.search(raw)
    assert rc == 0 and second not in (None, first) and world.budgets()[first][1] == 1, out
    rc, out, again = world.search(_space(_idx_folder(world.tmp / "mnist", "t10k", images, labels), CNN))
    assert rc == 0 and again == first and world.budgets()[second][1] == 1, out  # each to its own


@needs_mnist
def test_alc_public_refuses_exports_of_budgeted_images(world: World) -> None:
    """Item 7: MNIST as PNGs, and MNIST +1/255 as the train split, are MNIST's records: not public for alc."""
    from dptune.config import ConfigError, parse_space
    from dptune.ledger import Ledger
    from dptune.tuning.precharge import check_public

    images, labels = _mnist()
    rc, out, first = world.search(_space(_idx_folder(world.tmp / "mnist", "t10k", images, labels), CNN),
                                  "--budget-epsilon", "1000")
    assert rc == 0 and first is not None, out
    ledger = Ledger(world.ledger_path)
    label = ledger.label(ledger.budget_key(first))
    plus = np.minimum(images.astype(np.int64) + 1, 255).astype(np.uint8)
    publics = {"png": _png_folder(world.tmp / "png", images, labels),
               "plus": _idx_folder(world.tmp / "plus", "train", plus, labels)}
    other = np.random.default_rng(5).integers(0, 256, images[:200].shape, dtype=np.uint8)
    fresh = _idx_folder(world.tmp / "fresh", "t10k", other, labels[:200])
    for name, public in publics.items():
        raw = _space(_png_folder(world.tmp / f"private-{name}", other[:100], labels[:100]), CNN)
        raw["fixed"]["clipping"] = "alc"
        raw["alc"] = {"public": public, "quantile": 0.5, "examples": 64}
        with pytest.raises(ConfigError, match="^alc.public: ") as e:
            check_public(parse_space(raw), ledger)
        assert label in str(e.value), name
        raw["alc"]["public"] = fresh
        check_public(parse_space(raw), ledger)  # images no budget holds pass
    assert world.budgets()[first][1] == 1  # nothing charged


def _ledger_cli(world: World, *argv: str) -> tuple[int, str]:
    from dptune.cli.ledger import main

    rc = main([argv[0], "--ledger", str(world.ledger_path), *argv[1:]])
    out = world.capsys.readouterr()
    return rc, out.out + out.err


def _keyed_copies(world: World) -> tuple[str, str, dict[str, dict[str, Any]]]:
    """A budgeted table with declared ids "r0".."r299", and two copies that keep its ids but not its content as the
    ledger sees it: a feature column added to ``dataset.features``, and every value jittered by 2e-3 of its range
    (8 grid steps: beyond the signatures' tolerance). Returns (the budget's id, its label, the copies' spaces)."""
    from dptune.ledger import Ledger

    n = 300
    cols = _features(n, 2, seed=0)  # a narrow table: its grid signatures have steps of 1/4096 of the range
    ids, y, names = [f"r{i}" for i in range(n)], [i % 2 for i in range(n)], list(cols)
    rc, out, first = world.search(_space(_table(_csv(world.tmp / "base.csv", {"id": ids, **cols, "y": y}), names), MLP),
                                  "--budget-epsilon", "1000")
    assert rc == 0 and first is not None, out
    extra = np.random.default_rng(7).random(n)
    rng = np.random.default_rng(8)
    jittered = {k: np.clip(v + rng.normal(0.0, 2e-3, n), 0.0, 1.0) for k, v in cols.items()}
    copies = {
        "added column": _space(_table(_csv(world.tmp / "wider.csv", {"id": ids, **cols, "site": extra, "y": y}),
                                      [*names, "site"]), MLP),
        "jittered": _space(_table(_csv(world.tmp / "jitter.csv", {"id": ids, **jittered, "y": y}), names), MLP),
    }
    ledger = Ledger(world.ledger_path)
    return first, ledger.label(ledger.budget_key(first)), copies


def test_copies_that_keep_the_ids_but_not_the_content_are_refused(world: World) -> None:
    """Issue 40 item 5's gap: a copy whose content misses the signatures but whose declared ids are the budget's
    is neither opened a budget implicitly (``--budget-epsilon``) nor charged silently: exit 2, nothing charged,
    the message names the budget and both fixes (``adopt`` if it is the same records, ``new-budget`` if not)."""
    first, label, copies = _keyed_copies(world)
    before = world.budgets()
    for name, raw in copies.items():
        for extra in (("--budget-epsilon", "1000"), ()):
            rc, out, dataset_id = world.search(raw, *extra)
            assert rc == 2 and dataset_id is None, (name, extra, out)
            assert label in out and "record ids" in out and "nothing was charged" in out, (name, out)
            assert " adopt " in out and f"--dataset-id {first}" in out and " new-budget " in out, (name, out)
            assert "opened a privacy budget" not in out, name
            assert world.budgets() == before, name  # no budget opened, nothing charged


def test_explicit_acts_decide_a_refused_copys_budget(world: World) -> None:
    """After ``new-budget`` (the curator declares the jittered copy other data) its searches are charged to its own
    budget only; after ``adopt`` (the added-column copy is the same records) its searches are charged to the
    original's budget, and no budget is opened."""
    first, label, copies = _keyed_copies(world)
    rc, out = world.new_budget(copies["jittered"], "--epsilon", "1000", "--delta", "1e-5")
    assert rc == 0 and f"record ids with {label}" in out and f"opened the budget of {label}" not in out, out
    rc, out, own = world.search(copies["jittered"])
    assert rc == 0 and own not in (None, first), out
    budgets = world.budgets()
    assert budgets[own][1] == 1 and budgets[first][1] == 1, budgets  # the id-overlapping budget is not charged
    rc, out = _ledger_cli(world, "adopt", "--space", str(world.space(copies["added column"])), "--dataset-id", first)
    assert rc == 0 and label in out, out
    for _ in range(2):
        rc, out, dataset_id = world.search(copies["added column"], "--budget-epsilon", "1000")
        assert rc == 0 and dataset_id == first and "opened a privacy budget" not in out, out
    budgets = world.budgets()
    assert set(budgets) == {first, own} and budgets[first][1] == 3 and budgets[own][1] == 1, budgets
    rc, out = _ledger_cli(world, "adopt", "--space", str(world.space(copies["jittered"])), "--dataset-id", "nope")
    assert rc == 2 and "--dataset-id" in out, out
