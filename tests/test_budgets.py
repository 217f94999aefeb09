"""Budgets keyed on the privacy unit (issue 22 item 2, issue 40 items 5-6): careless copies keep their records'
content (and ids) and hit the budget of the data they copy; a union of budgeted datasets is charged to each; data
that partly overlaps a budgeted set never gets a budget implicitly (`--budget-epsilon`), only through the explicit
`python -m dptune.cli.ledger new-budget`. Copies under other ids or formats: tests/test_budget_identity.py. Every search here draws K = 0 (the test hook): the whole CLI path up
to the release, without Ray."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import pytest
import yaml

from dptune.ledger import Ledger
from tests.conftest import digits_seed_with_k
from tests.test_data_formats import _write_mnist

ROWS = 120


def _table(ids: list[Any], seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    return pa.table({"id": ids, "a": rng.random(len(ids)), "b": rng.random(len(ids)),
                     "y": [i % 2 for i in range(len(ids))]})


def _table_space(path: Path, label: str = "y", **dataset: Any) -> dict[str, Any]:
    return {"name": "tbl",
            "dataset": {"name": "table", "path": str(path), "label": label, "classes": [0, 1], "id_column": "id",
                        "features": {"a": [0, 1], "b": [0, 1]}, "validation_size": 20, "test_size": 20, **dataset},
            "model": {"name": "mlp", "kwargs": {"hidden": [8], "norm": "group", "act": "tanh"}},
            "fixed": {"epochs": 1, "batch_size": 32, "max_grad_norm": 1.0, "optimizer": "sgd", "momentum": 0.0,
                      "clipping": "auto"},
            "space": {"learning_rate": {"type": "float", "low": 0.25, "high": 1.0, "log": True},
                      "groups": {"type": "categorical", "choices": [4, 8]},
                      "noise_multiplier": {"type": "float", "low": 3.0, "high": 4.0}},
            "default": {"learning_rate": 0.5, "groups": 4, "noise_multiplier": 3.0},
            "privacy": {"delta": 1e-5, "stopping": "poisson", "mean": 2, "score_noise": 6.0}}


def _mnist_space(path: Path, name: str = "mnist") -> dict[str, Any]:
    return {"name": "mn",
            # 60 training images of the official 60,000 (issue 40, item 10: a subset is declared)
            "dataset": {"name": name, "path": str(path), "validation_size": 10, "test_size": 10, "pool_size": 60},
            "model": {"name": "tanh_cnn"},
            "fixed": {"epochs": 1, "batch_size": 16, "max_grad_norm": 1.0, "optimizer": "sgd", "momentum": 0.0,
                      "clipping": "auto"},
            "space": {"learning_rate": {"type": "float", "low": 0.1, "high": 1.0, "log": True},
                      "noise_multiplier": {"type": "float", "low": 3.0, "high": 4.0}},
            "default": {"learning_rate": 0.5, "noise_multiplier": 3.0},
            "privacy": {"delta": 1e-5, "stopping": "poisson", "mean": 2, "score_noise": 6.0}}


class World:
    def __init__(self, tmp: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
        self.tmp, self.ledger_path, self.capsys = tmp, tmp / "ledger.sqlite", capsys
        monkeypatch.setenv("DPTUNE_TEST_DRAW_SEED", str(digits_seed_with_k(0, 0)))  # K = 0: no Ray
        monkeypatch.setenv("HOME", str(tmp / "home"))
        self.n = 0

    def space(self, raw: dict[str, Any]) -> Path:
        self.n += 1
        path = self.tmp / f"space{self.n}.yaml"
        path.write_text(yaml.safe_dump(raw))
        return path

    def search(self, raw: dict[str, Any], *extra: str) -> tuple[int, str, str | None]:
        """(exit status, stdout + stderr, the certificate's dataset id)."""
        from dptune.cli.search import main

        self.n += 1
        name = f"s{self.n}"
        rc = main(["--space", str(self.space(raw)), "--name", name, "--runs-dir", str(self.tmp / "runs"),
                   "--ledger", str(self.ledger_path), *extra])
        out = self.capsys.readouterr()
        cert = self.tmp / "runs" / name / "release" / "certificate.json"
        return rc, out.out + out.err, json.loads(cert.read_text())["dataset_id"] if cert.is_file() else None

    def new_budget(self, raw: dict[str, Any], *extra: str) -> tuple[int, str]:
        from dptune.cli.ledger import main

        rc = main(["new-budget", "--ledger", str(self.ledger_path), "--space", str(self.space(raw)), *extra])
        out = self.capsys.readouterr()
        return rc, out.out + out.err

    def budgets(self) -> dict[str, tuple[float, int]]:
        """dataset id -> (ε spent, number of charges)."""
        led = Ledger(self.ledger_path)
        return {led.dataset_id(fp): (led.spent(fp), len(led.charges(fp))) for fp in led.fingerprints()}


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> World:
    return World(tmp_path, monkeypatch, capsys)


def _write(table: pa.Table, path: Path) -> Path:
    pcsv.write_csv(table, path)
    return path


def test_careless_copies_of_a_table_hit_its_budget_by_record_id(world: World) -> None:
    """A 1e-9 jitter on a column, an added constant column, a renamed label column, a pandas file saved with
    its index: each was a fresh budget when budgets were keyed on bytes; with the id column declared each is
    charged to the original's budget, even when the search passes --budget-epsilon."""
    import pandas as pd

    base = _table([f"p{i:04d}" for i in range(ROWS)])
    rc, out, first = world.search(_table_space(_write(base, world.tmp / "base.csv")), "--budget-epsilon", "50")
    assert rc == 0 and first is not None, out
    df = base.to_pandas()
    jitter = df.assign(b=df["b"] + 1e-9)
    constant = df.assign(site=1.0)
    renamed = df.rename(columns={"y": "diagnosis"})
    copies = {"jitter": (jitter, "y", False), "constant": (constant, "y", False),
              "renamed": (renamed, "diagnosis", False), "index": (df, "y", True)}
    for name, (frame, label, index) in copies.items():
        path = world.tmp / f"{name}.csv"
        frame.to_csv(path, index=index)  # index=True: pandas' unnamed index column, as careless saves do
        rc, out, dataset_id = world.search(_table_space(path, label=label), "--budget-epsilon", "50")
        assert rc == 0, (name, out)
        assert dataset_id == first, name  # the same budget, not a new one
        assert "opened a privacy budget" not in out, name
    assert list(world.budgets()) == [first] and world.budgets()[first][1] == 1 + len(copies)
    assert isinstance(pd.read_csv(world.tmp / "index.csv").columns[0], str)


def test_edited_pixels_of_a_builtin_hit_its_budget(world: World) -> None:
    """MNIST files with every pixel +1/255 (and one LSB flipped) keep each image's index in its official
    split, so they are charged to the budget of the original files."""
    from tests.test_data_formats import _write_idx

    images, labels = _write_mnist(world.tmp / "orig", "train", 60, gz=False)
    test_images, test_labels = _write_mnist(world.tmp / "orig", "t10k", 20, gz=False, seed=1)
    rc, out, first = world.search(_mnist_space(world.tmp / "orig"), "--budget-epsilon", "1000")
    assert rc == 0 and first is not None, out
    copy = world.tmp / "copy"
    copy.mkdir()
    for prefix, x, y in (("train", images, labels), ("t10k", test_images, test_labels)):
        edited = np.minimum(x.astype(np.int64) + 1, 255).astype(np.uint8)
        edited[0, 0, 0] ^= 1
        _write_idx(copy / f"{prefix}-images-idx3-ubyte", edited, gz=False)
        _write_idx(copy / f"{prefix}-labels-idx1-ubyte", y, gz=False)
    rc, out, again = world.search(_mnist_space(copy), "--budget-epsilon", "1000")
    assert rc == 0 and again == first, out
    assert world.budgets()[first][1] == 2 and len(world.budgets()) == 1


def test_union_of_two_budgeted_tables_is_charged_to_both(world: World) -> None:
    """A union of two budgeted datasets charges every budget it overlaps (all in one transaction); data with
    records in no budget is refused until its budget is opened explicitly with new-budget."""
    a = _table([f"a{i}" for i in range(ROWS)], seed=1)
    b = _table([f"b{i}" for i in range(ROWS)], seed=2)
    rc, out, id_a = world.search(_table_space(_write(a, world.tmp / "a.csv")), "--budget-epsilon", "50")
    assert rc == 0, out
    rc, out, id_b = world.search(_table_space(_write(b, world.tmp / "b.csv")), "--budget-epsilon", "50")
    assert rc == 0 and id_a != id_b, out
    before = world.budgets()
    union = _write(pa.concat_tables([a, b]), world.tmp / "union.csv")
    rc, out, id_u = world.search(_table_space(union), "--budget-epsilon", "50")
    assert rc == 0 and id_u in (id_a, id_b), out
    after = world.budgets()
    assert set(after) == {id_a, id_b}  # no budget opened for the union
    for i in (id_a, id_b):  # each budget paid for the union's search
        assert after[i][1] == before[i][1] + 1 and after[i][0] > before[i][0]
    # half budgeted, half new: refused, nothing charged, not even with --budget-epsilon
    c = _table([f"c{i}" for i in range(ROWS)], seed=3)
    mixed = _table_space(_write(pa.concat_tables([a, c]), world.tmp / "mixed.csv"))
    rc, out, _ = world.search(mixed, "--budget-epsilon", "50")
    assert rc == 2 and "new-budget" in out and "records in no budget" in out, out
    assert world.budgets() == after
    rc, out = world.new_budget(mixed, "--epsilon", "40", "--delta", "1e-6", "--label", "a-and-c")
    assert rc == 0 and "shares records with" in out and "existing budgets (2)" in out, out
    rc, out, id_m = world.search(mixed)
    assert rc == 0, out
    final = world.budgets()
    assert len(final) == 3 and id_m not in (id_a, id_b)
    assert final[id_a][1] == after[id_a][1] + 1 and final[id_b] == after[id_b] and final[id_m][1] == 1


def test_data_resembling_a_budgeted_set_is_charged_to_its_budget(world: World) -> None:
    """The same images under other record ids (MNIST's files read as Fashion-MNIST) share no id but their content
    with a budgeted set: charged to its budget, even with --budget-epsilon (issue 40 item 5: a budget follows the
    records). A budget opened for them explicitly with new-budget, which names the match, is charged beside it."""
    _write_mnist(world.tmp / "d", "train", 60, gz=False)
    _write_mnist(world.tmp / "d", "t10k", 20, gz=False, seed=1)
    rc, out, first = world.search(_mnist_space(world.tmp / "d"), "--budget-epsilon", "1000")
    assert rc == 0, out
    fashion = _mnist_space(world.tmp / "d", name="fashion_mnist")
    rc, out, again = world.search(fashion, "--budget-epsilon", "1000")
    assert rc == 0 and again == first and "known by their content" in out and "opened" not in out, out
    assert list(world.budgets()) == [first] and world.budgets()[first][1] == 2
    rc, out = world.new_budget(fashion, "--epsilon", "1000", "--delta", "1e-6")
    assert rc == 0 and "shares records with" in out and "by content" in out and first in out, out
    rc, out, _ = world.search(fashion)
    assert rc == 0 and len(world.budgets()) == 2, out
    (opened,) = set(world.budgets()) - {first}
    assert world.budgets()[first][1] == 3 and world.budgets()[opened][1] == 1  # each budget paid for it


def test_table_without_id_column_is_warned(world: World) -> None:
    raw = _table_space(_write(_table(list(range(ROWS))), world.tmp / "t.csv"))
    del raw["dataset"]["id_column"]
    rc, out, _ = world.search(raw, "--budget-epsilon", "50")
    assert rc == 0 and "declares no dataset.id_column" in out and "by their content only" in out, out


def test_budget_opened_before_record_ids_adopts_them(world: World) -> None:
    """A budget an older dptune opened (content digests, no ids) still takes its data, and takes the data's
    record ids with it: a careless copy searched afterwards is charged to it by id."""
    from dptune.config import load_space
    from dptune.data import load_dataset

    base = _table([f"p{i}" for i in range(ROWS)])
    raw = _table_space(_write(base, world.tmp / "base.csv"))
    data = load_dataset(load_space(world.space(raw)).dataset)
    led = Ledger(world.ledger_path)
    led.set_budget(data.pool_fingerprint(), 50.0, 1e-5, label="old", digests=data.example_digests())  # no ids
    legacy_id = led.dataset_id(data.pool_fingerprint())
    rc, out, first = world.search(raw)
    assert rc == 0 and first == legacy_id, out
    df = base.to_pandas()
    df.assign(b=df["b"] + 1e-9).to_csv(world.tmp / "jitter.csv", index=False)
    rc, out, again = world.search(_table_space(world.tmp / "jitter.csv"), "--budget-epsilon", "50")
    assert rc == 0 and again == legacy_id and list(world.budgets()) == [legacy_id], out


def test_imagefolder_records_are_their_paths(tmp_path: Path) -> None:
    """An imagefolder image's id is its path under the dataset folder: every pixel +1/255 keeps the ids."""
    from PIL import Image

    from dptune.config import DatasetSpec
    from dptune.data import load_dataset

    for root, shift in ((tmp_path / "orig", 0), (tmp_path / "copy", 1)):
        for split, n in (("train", 12), ("test", 4)):
            for c in ("cat", "dog"):
                (root / split / c).mkdir(parents=True)
                for i in range(n):
                    px = np.random.default_rng([len(split), len(c), i]).integers(0, 255, (8, 8, 3))
                    Image.fromarray((px + shift).astype(np.uint8)).save(root / split / c / f"{i}.png")
    spec = {"name": "imagefolder", "validation_size": 4, "test_size": 4, "classes": ["cat", "dog"]}
    a = load_dataset(DatasetSpec(path=str(tmp_path / "orig"), **spec))
    b = load_dataset(DatasetSpec(path=str(tmp_path / "copy"), **spec))
    assert a.record_ids is not None and len(a.record_ids) == 2 * (12 + 4) == len(set(a.record_ids))
    assert a.record_ids == b.record_ids and "imagefolder/train/cat/0.png" in a.record_ids
    assert not set(a.example_digests()) & set(b.example_digests())  # the content differs everywhere
