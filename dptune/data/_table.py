"""Tables: Parquet or CSV files read with pyarrow, one example per row.

Preprocessing looks at no private data: each declared feature is clipped to its declared public bounds
[low, high] and mapped linearly onto [-1, 1] from those bounds (never from the data's mean, std, min or
max). A row becomes a (1, 1, d) tensor: one channel, one row of the d declared features, in declared order
(the ``mlp`` model flattens it). Labels: the declared ``dataset.classes`` in order (class i = classes[i]),
required: a class list read off the data would make the model's output layer reveal a record with a new label.

Refused with a ConfigError naming the column (CLIs: exit 2, before anything is charged): a missing label
column, a declared feature that does not exist or is not numeric, any missing value (null or NaN) in a
declared feature or the label, a label that ``classes`` does not list. dptune does not impute: an imputed
value would be computed from private data. Messages say what is wrong, never how many records or which value
(a count or a label value of private records is a release).

Ledger identity: each row's declared features on their bounds' scale, in the natural order of their names
(``dptune.data._content``: never the id column, never the label), so the same rows under other ids, without their id
column, with their columns in another order, or exported from images are known as the records they are; rows whose
declared features take too few values to tell them from other tables' (``column_levels``) are known by id alone. The
declared ``dataset.id_column`` (present and distinct in every row) names each record within that dataset (a row
whose values changed keeps its id).
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from dptune.config import ConfigError, DatasetSpec
from dptune.data._content import column_levels, natural_order, row_signatures
from dptune.data._loaders import take
from dptune.data._splits import Splits, make_splits, split_indices

__all__ = ["load_table", "read_table"]


def read_table(path: str | Path) -> pa.Table:
    """The table at ``path`` (.parquet / .pq, or .csv / .csv.gz with a header row)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError("dataset.path", f"{str(p)!r} is not an existing file", "point dataset.path at a .parquet "
                          "or .csv file")
    name = p.name.lower()
    try:
        if name.endswith((".parquet", ".pq")):
            import pyarrow.parquet as pq

            return pq.read_table(p)
        if name.endswith((".csv", ".csv.gz")):
            import pyarrow.csv as pcsv

            return pcsv.read_csv(p)
    except (pa.ArrowException, OSError) as e:
        raise ConfigError("dataset.path", f"cannot read {p.name} ({type(e).__name__}: {e})",
                          "use a valid Parquet file, or a CSV file with a header row") from e
    raise ConfigError("dataset.path", f"{p.name} is neither .parquet nor .csv", "use a .parquet or .csv file")


def load_table(spec: DatasetSpec) -> Splits:
    """The table of ``spec`` split into train / validation / test by ``split_seed``."""
    table = read_table(spec.path or "")
    label = str(spec.label)
    if label not in table.column_names:
        raise ConfigError("dataset.label", f"column {label!r} does not exist in {Path(spec.path or '').name}",
                          f"name one of its columns: {', '.join(table.column_names[:30])}")
    bounds = [(col, float(lo), float(hi)) for col, (lo, hi) in (spec.features or {}).items()]
    raw = [_feature(table, col) for col, _, _ in bounds]
    # each feature on its declared bounds' scale (0 at low, 1 at high; unclipped): the records' content identity
    scaled = np.stack([(v - lo) / (hi - lo) for v, (_, lo, hi) in zip(raw, bounds, strict=True)], axis=1)
    model_input = np.clip(scaled * 2.0 - 1.0, -1.0, 1.0)  # what the model sees: clipped to the bounds, in [-1, 1]
    x = torch.from_numpy(model_input.astype(np.float32)).view(table.num_rows, 1, 1, scaled.shape[1])
    # identity: the features in their names' natural order, whatever order the file stores or the space declares
    order = natural_order([col for col, _, _ in bounds])
    levels = [column_levels(raw[j], bounds[j][1], bounds[j][2]) for j in order]
    y, classes = _labels(table.column(label), label, spec.classes)
    te, val, tr = split_indices(len(y), (spec.test_size, spec.validation_size), spec.split_seed, "dataset.test_size")
    return make_splits(take(x, y, tr), take(x, y, val), take(x, y, te), classes, record_digests(table),
                       record_ids=_record_ids(table, spec.id_column), signatures=row_signatures(scaled[:, order], levels))


def _record_ids(table: pa.Table, id_column: str | None) -> tuple[str, ...] | None:
    """The declared id column's values, one per row: present, distinct (counts and values are never printed)."""
    if id_column is None:
        return None
    if id_column not in table.column_names:
        raise ConfigError("dataset.id_column", f"column {id_column!r} does not exist in the table",
                          "name the column that identifies each record (names are case-sensitive)")
    column = table.column(id_column)
    if column.null_count:
        raise ConfigError("dataset.id_column", f"column {id_column!r} has missing values",
                          "give every record an id before loading")
    ids = tuple(f"table/{_canonical(v)}" for v in column.to_pylist())
    if len(set(ids)) != len(ids):
        raise ConfigError("dataset.id_column", f"column {id_column!r} repeats an id",
                          "give each record a distinct id (one record, one id)")
    return ids


def _feature(table: pa.Table, col: str) -> np.ndarray:
    """One declared feature's values, checked (present, numeric, none missing)."""
    field = f"dataset.features.{col}"
    if col not in table.column_names:
        raise ConfigError(field, f"column {col!r} does not exist in the table",
                          "declare only existing columns (names are case-sensitive)")
    column = table.column(col)
    if not (pa.types.is_integer(column.type) or pa.types.is_floating(column.type)
            or pa.types.is_decimal(column.type)):
        raise ConfigError(field, f"column {col!r} is {column.type}, not numeric",
                          "declare numeric columns only (encode a category as numbers first)")
    values = np.asarray(column.to_numpy(zero_copy_only=False), dtype=np.float64)
    if column.null_count or np.isnan(values).any():
        raise ConfigError(field, f"column {col!r} has missing values (null or NaN)",
                          "drop or fill them before loading: dptune does not impute from private data")
    return values


def _labels(column: pa.ChunkedArray, name: str, classes: list[Any] | None) -> tuple[torch.Tensor, int]:
    if classes is None:  # DatasetSpec refuses a table without them; here for a spec built around that check
        raise ConfigError("dataset.classes", "is required for a table", "declare the classes in order")
    if column.null_count:
        raise ConfigError("dataset.label", f"column {name!r} has missing labels", "drop those rows before loading")
    if pa.types.is_dictionary(column.type):
        column = column.cast(column.type.value_type)
    integer = pa.types.is_integer(column.type)
    if not (integer or pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise ConfigError("dataset.label", f"column {name!r} is {column.type}: labels must be integers or strings",
                          "store class labels as integers or as strings, and list them in dataset.classes")
    if not all(isinstance(c, int) if integer else isinstance(c, str) for c in classes):
        raise ConfigError("dataset.classes", f"column {name!r} holds {'integers' if integer else 'strings'}, "
                          f"dataset.classes lists {classes!r}", "list the label values as they are stored")
    index = {c: i for i, c in enumerate(classes)}
    values = column.to_pylist()
    if any(v not in index for v in values):  # never quoted: a private record's label
        raise ConfigError("dataset.label", f"column {name!r} holds a value that dataset.classes does not list",
                          "list every label value in dataset.classes (or drop the rows whose label is not a class)")
    return torch.tensor([index[v] for v in values], dtype=torch.int64), len(index)


def record_digests(table: pa.Table) -> tuple[bytes, ...]:
    """sha256 of each row over every column, by name; numbers as floats, so the same table digests alike
    from Parquet and from CSV (where an integral float column may read as integers)."""
    names = sorted(table.column_names)
    columns = [table.column(n).to_pylist() for n in names]
    return tuple(hashlib.sha256(b"dptune-row/1" + json.dumps([[n, _canonical(v)] for n, v in zip(names, row)])
                                .encode()).digest() for row in zip(*columns))


def _canonical(value: Any) -> Any:
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int | float):
        return None if isinstance(value, float) and math.isnan(value) else float(value)
    return str(value)
