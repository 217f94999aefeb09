"""Example tables written from data bundled with scikit-learn (offline), for the example spaces.

    python -m dptune.data.examples breast-cancer data/breast_cancer.parquet   (or .csv)

``breast-cancer``: scikit-learn's copy of the UCI Breast Cancer Wisconsin (Diagnostic) data: 569 rows, the
30 numeric features under scikit-learn's names (``mean radius`` ... ``worst fractal dimension``) and the
label column ``diagnosis`` (``malignant`` / ``benign``). ``search_spaces/breast_cancer.yaml`` declares the
feature bounds from the data set's documentation (its Min/Max table), not from the file.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pyarrow as pa

__all__ = ["EXAMPLES", "breast_cancer_table", "main", "write_table"]


def breast_cancer_table() -> pa.Table:
    from sklearn.datasets import load_breast_cancer

    d = load_breast_cancer()
    columns = {str(name): pa.array(d.data[:, i]) for i, name in enumerate(d.feature_names)}
    columns["diagnosis"] = pa.array([str(d.target_names[t]) for t in d.target])
    return pa.table(columns)


EXAMPLES = {"breast-cancer": breast_cancer_table}


def write_table(table: pa.Table, path: Path) -> None:
    """Parquet, or CSV when ``path`` ends in .csv."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix.lower() == ".csv":
        import pyarrow.csv as pcsv

        pcsv.write_csv(table, path)
    else:
        import pyarrow.parquet as pq

        pq.write_table(table, path)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] not in EXAMPLES:
        print(f"usage: python -m dptune.data.examples {{{','.join(EXAMPLES)}}} OUT.parquet|OUT.csv", file=sys.stderr)
        return 2
    out = Path(args[1])
    table = EXAMPLES[args[0]]()
    write_table(table, out)
    print(f"wrote {out}: {table.num_rows} rows, {table.num_columns} columns")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
