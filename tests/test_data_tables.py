"""Tables (Parquet and CSV through pyarrow): declared bounds applied (clip, then scale to [-1, 1]), labels,
every bad table named by its column, the ledger identity of a table, and a real DP-SGD trial of the mlp on
scikit-learn's breast-cancer data written to Parquet by ``python -m dptune.data.examples``."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest
import torch
import yaml

from dptune.config import ConfigError, DatasetSpec, load_space, parse_space
from dptune.config.params import trial_steps
from dptune.data import Splits, load_dataset
from dptune.data.examples import breast_cancer_table, main, write_table
from dptune.dpsgd import run_trial, validate_model

ROOT = Path(__file__).resolve().parent.parent
SPACE = ROOT / "search_spaces" / "breast_cancer.yaml"
ROWS = 12


def _table(**changes: Any) -> pa.Table:
    cols: dict[str, Any] = {
        "a": list(range(0, 2 * ROWS, 2)),  # 0..22: above the declared 10 from row 6 on (clipped)
        "b": [-2.0] + [0.1 * i for i in range(1, ROWS)],  # -2 is below the declared -1 (clipped)
        "colour": ["red", "blue"] * (ROWS // 2),
        "label": ["yes", "no", "maybe"] * (ROWS // 3),
    }
    cols.update(changes)
    return pa.table(cols)


def _spec(path: Path, **changes: Any) -> DatasetSpec:
    base: dict[str, Any] = dict(name="table", path=str(path), label="label", features={"a": [0, 10], "b": [-1, 1]},
                                validation_size=2, test_size=2, classes=["maybe", "no", "yes"])
    return DatasetSpec(**{**base, **changes})


def _write(tmp_path: Path, table: pa.Table, kind: str) -> Path:
    path = tmp_path / f"t.{kind}"
    (pq.write_table if kind == "parquet" else pcsv.write_csv)(table, path)
    return path


def _rows(s: Splits) -> list[tuple[int, tuple[float, ...]]]:
    return sorted((int(y), tuple(x.flatten().tolist())) for p in (s.train, s.val, s.test) for x, y in zip(*p))


def _expected(table: pa.Table, bounds: dict[str, list[float]], classes: list[str]) -> list[tuple[int, tuple]]:
    cols = [np.clip((np.asarray(table[c].to_pylist(), float) - lo) / (hi - lo) * 2 - 1, -1, 1)
            for c, (lo, hi) in bounds.items()]
    rows = np.stack(cols, 1).astype(np.float32)
    return sorted((classes.index(lab), tuple(r.tolist())) for lab, r in zip(table["label"].to_pylist(), rows))


@pytest.mark.parametrize("kind", ["parquet", "csv"])
def test_table_bounds_clip_and_scale(tmp_path: Path, kind: str) -> None:
    s = load_dataset(_spec(_write(tmp_path, _table(), kind)))
    assert (len(s.train[1]), len(s.val[1]), len(s.test[1])) == (8, 2, 2)
    assert s.input_shape == (1, 1, 2) and s.num_classes == 3  # rows as (1, 1, d); labels as declared
    assert _rows(s) == _expected(_table(), {"a": [0, 10], "b": [-1, 1]}, ["maybe", "no", "yes"])
    x = torch.cat([s.train[0], s.val[0], s.test[0]])
    assert float(x[..., 0].max()) == 1.0 and float(x[..., 1].min()) == -1.0  # outside the bounds: clipped
    declared = load_dataset(_spec(_write(tmp_path, _table(), kind), classes=["yes", "no", "maybe"]))
    assert _rows(declared) == _expected(_table(), {"a": [0, 10], "b": [-1, 1]}, ["yes", "no", "maybe"])


def test_parquet_and_csv_load_alike_and_identity_ignores_declarations(tmp_path: Path) -> None:
    a = load_dataset(_spec(_write(tmp_path, _table(), "parquet")))
    b = load_dataset(_spec(_write(tmp_path, _table(), "csv")))
    for p, q in zip((a.train, a.val, a.test), (b.train, b.val, b.test), strict=True):
        assert torch.equal(p[0], q[0]) and torch.equal(p[1], q[1])
    assert a.example_digests() == b.example_digests() and len(a.example_digests()) == ROWS
    # other features or bounds for the same table: the same dataset to the ledger (no fresh budget)
    c = load_dataset(_spec(_write(tmp_path, _table(), "csv"), features={"a": [-5, 50]}))
    assert c.pool_fingerprint() == a.pool_fingerprint() and c.input_shape == (1, 1, 1)
    changed = _table(b=[9.0] + [0.1 * i for i in range(1, ROWS)])
    d = load_dataset(_spec(_write(tmp_path, changed, "parquet")))
    assert len(set(d.example_digests()) - set(a.example_digests())) == 1  # one record differs


def test_integer_labels(tmp_path: Path) -> None:
    s = load_dataset(_spec(_write(tmp_path, _table(label=[i % 4 for i in range(ROWS)]), "parquet"),
                           classes=[0, 1, 2, 3]))
    assert s.num_classes == 4
    s = load_dataset(_spec(_write(tmp_path, _table(label=[i % 2 for i in range(ROWS)]), "csv"), classes=[1, 0]))
    assert s.num_classes == 2 and sorted(_rows(s))[0][0] == 0


NAN_B = [float("nan")] + [0.1 * i for i in range(1, ROWS)]
BAD_TABLES: list[tuple[str, str, dict[str, Any], dict[str, Any], str]] = [
    # (id, file kind, column changes, spec changes, field named)
    ("null-feature", "csv", {"a": [None] + list(range(1, ROWS))}, {}, "dataset.features.a"),
    ("nan-feature", "parquet", {"b": NAN_B}, {}, "dataset.features.b"),
    ("no-label-column", "parquet", {}, {"label": "target"}, "dataset.label"),
    ("non-numeric", "csv", {}, {"features": {"a": [0, 1], "colour": [0, 1]}}, "dataset.features.colour"),
    ("no-such-feature", "parquet", {}, {"features": {"zz": [0, 1]}}, "dataset.features.zz"),
    ("null-label", "parquet", {"label": [None] + ["yes"] * (ROWS - 1)}, {}, "dataset.label"),
    ("float-label", "parquet", {"label": [0.5] * ROWS}, {}, "dataset.label"),
    ("undeclared-label", "csv", {}, {"classes": ["yes", "no"]}, "dataset.label"),
    ("classes-type", "parquet", {}, {"classes": [0, 1, 2]}, "dataset.classes"),
]


@pytest.mark.parametrize(("kind", "columns", "changes", "field"), [c[1:] for c in BAD_TABLES],
                         ids=[c[0] for c in BAD_TABLES])
def test_bad_table_names_the_column(tmp_path: Path, kind: str, columns: dict[str, Any], changes: dict[str, Any],
                                    field: str) -> None:
    path = _write(tmp_path, _table(**columns), kind)
    with pytest.raises(ConfigError) as e:
        load_dataset(_spec(path, **changes))
    assert e.value.field == field, e.value


@pytest.mark.parametrize(("changes", "field"), [
    ({"features": {"a": [1, 1]}}, "dataset.features.a"), ({"features": {"a": [0, float("inf")]}}, "dataset.features.a"),
    ({"features": {"a": 3}}, "dataset.features.a"), ({"features": {}}, "dataset.features"),
    ({"features": {"label": [0, 1]}}, "dataset.features.label"), ({"label": None}, "dataset.label"),
    ({"classes": ["yes"]}, "dataset.classes"), ({"classes": ["a", "a"]}, "dataset.classes"),
    ({"classes": None}, "dataset.classes"),
    ({"split": "test"}, "dataset.split"), ({"name": "digits"}, "dataset.label"),
])
def test_bad_table_declarations(tmp_path: Path, changes: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as e:
        _spec(tmp_path / "t.csv", **changes)
    assert e.value.field == field, e.value


@pytest.mark.parametrize("label", [["yes", "no", "maybe"] * (ROWS // 3), [i % 4 for i in range(ROWS)]])
def test_a_table_whose_classes_would_come_from_its_labels_is_refused(tmp_path: Path, label: list[Any]) -> None:
    """Issue 22 item 5: without dataset.classes one record with a new label changed the model's output layer
    (membership of that record); the class list must be declared (string and integer labels alike)."""
    with pytest.raises(ConfigError) as e:
        load_dataset(_spec(_write(tmp_path, _table(label=label), "csv"), classes=None))
    assert e.value.field == "dataset.classes" and "required" in str(e.value)
    raw = yaml.safe_load(SPACE.read_text())
    del raw["dataset"]["classes"]
    with pytest.raises(ConfigError) as e:  # refused from the space, before any data is read or charged
        parse_space(raw)
    assert e.value.field == "dataset.classes"


def test_messages_about_private_records_neither_count_nor_quote_them(tmp_path: Path) -> None:
    """Issue 22 item 8: a missing-value count or a label value of a private record is a release."""
    cases = [({"b": [float("nan")] * 3 + [0.1 * i for i in range(3, ROWS)]}, {}),
             ({"label": ["secret-label"] + ["yes", "no", "maybe"] * 3 + ["yes", "no"]}, {}),
             ({"label": [None, None] + ["yes", "no", "maybe"] * 3 + ["yes"]}, {})]
    for columns, changes in cases:
        with pytest.raises(ConfigError) as e:
            load_dataset(_spec(_write(tmp_path, _table(**columns), "parquet"), **changes))
        text = str(e.value)
        assert "secret-label" not in text and not re.search(r"\b[23]\b", text), text


def test_bad_table_files(tmp_path: Path) -> None:
    for path in (tmp_path / "absent.parquet", tmp_path):
        with pytest.raises(ConfigError) as e:
            load_dataset(_spec(path))
        assert e.value.field == "dataset.path"
    (tmp_path / "t.xlsx").write_bytes(b"PK")
    (tmp_path / "t.parquet").write_bytes(b"not parquet")
    for name in ("t.xlsx", "t.parquet"):
        with pytest.raises(ConfigError) as e:
            load_dataset(_spec(tmp_path / name))
        assert e.value.field == "dataset.path"


def _descr_bounds() -> dict[str, list[float]]:
    """The Min/Max table of scikit-learn's documentation of the data set, under the column names."""
    from sklearn.datasets import load_breast_cancer

    out = {}
    for m in re.finditer(r"^(.+?) \((mean|standard error|worst)\):\s+([\d.]+)\s+([\d.]+)\s*$",
                         load_breast_cancer().DESCR, re.MULTILINE):
        name, kind = m.group(1).strip(), m.group(2)
        column = {"mean": f"mean {name}", "standard error": f"{name} error", "worst": f"worst {name}"}[kind]
        out[column] = [float(m.group(3)), float(m.group(4))]
    return out


@pytest.fixture(scope="module")
def breast_cancer(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Splits]:
    path = tmp_path_factory.mktemp("bc") / "breast_cancer.parquet"
    assert main(["breast-cancer", str(path)]) == 0  # the command the space's header documents
    space = load_space(SPACE)
    return space, load_dataset(dataclasses.replace(space.dataset, path=str(path)))


def test_breast_cancer_space_declares_the_documented_bounds(breast_cancer: tuple[Any, Splits]) -> None:
    space, data = breast_cancer
    assert space.dataset.features == _descr_bounds() and len(space.dataset.features) == 30
    assert data.input_shape == (1, 1, 30) and data.num_classes == 2
    assert (len(data.train[1]), len(data.val[1]), len(data.test[1])) == (369, 100, 100)
    x = torch.cat([data.train[0], data.val[0], data.test[0]])
    assert float(x.min()) == -1.0 and float(x.max()) <= 1.0  # rounded published minima: a few rows clipped
    assert sorted(torch.bincount(torch.cat([data.train[1], data.val[1], data.test[1]])).tolist()) == [212, 357]


def test_mlp_trial_on_breast_cancer(breast_cancer: tuple[Any, Splits]) -> None:
    space, data = breast_cancer
    for groups in (4, 8):  # what the search checks before it reserves
        validate_model(space.fixed.replace(groups=groups), data.num_classes, data.input_shape)
    config = space.fixed.replace(seed=2**100 + 17)
    result = run_trial(config, data, evaluate_test=True)  # a real DP-SGD trial; private, noised score
    n = len(data.train[1])
    assert result.steps == result.noise_additions == trial_steps(epochs=10, batch_size=128, basis=n)
    assert result.applied_score_noise == 6.0 and math.isfinite(result.score) and not result.diverged
    assert result.test_accuracy is not None and result.test_accuracy > 0.8  # 63 % is the majority class


def test_table_space_refuses_augmentation() -> None:
    raw = yaml.safe_load(SPACE.read_text())
    raw["fixed"]["augmult"] = 4
    with pytest.raises(ConfigError) as e:
        parse_space(raw)
    assert e.value.field == "fixed.augmult"


def test_examples_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["breast-cancer", str(tmp_path / "bc.csv")]) == 0
    table = pcsv.read_csv(tmp_path / "bc.csv")
    assert (table.num_rows, table.num_columns) == (569, 31) and set(table["diagnosis"].to_pylist()) == {
        "malignant", "benign"}
    assert main(["iris", str(tmp_path / "x.csv")]) == 2 and "usage" in capsys.readouterr().err
    write_table(breast_cancer_table(), tmp_path / "sub" / "bc.parquet")
    assert pq.read_table(tmp_path / "sub" / "bc.parquet").num_rows == 569


def test_space_files_plan(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from dptune.cli.plan import main as plan

    monkeypatch.chdir(ROOT)
    assert plan(["--space", "search_spaces/mnist.yaml"]) == 0  # n known without reading: 10,000 - 2,000
    assert plan(["--space", "search_spaces/breast_cancer.yaml", "--n-train", "369"]) == 0
    assert plan(["--space", "search_spaces/breast_cancer.yaml"]) == 2  # a table's size is not known unread
    assert "--n-train" in capsys.readouterr().err
