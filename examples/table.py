"""A table of your own: write a real CSV file, then search and train on it privately.

The table: scikit-learn's bundled UCI Breast Cancer Wisconsin data (569 rows, offline), ten "mean" features,
the label ``diagnosis`` and a ``record`` id (the ledger knows a dataset by its records' ids). The space
declares each feature's bounds from the data set's documentation, never from the file (values are clipped
to them and scaled onto [-1, 1] from them), and the ``classes``: none is read off the data.

    python examples/table.py               # the real thing (table and ledger under runs/)
    python examples/table.py --smoke-test  # 1 epoch, a fixed draw, temp dirs: NOT PRIVATE
"""

from __future__ import annotations

import argparse
import csv
import tempfile
from pathlib import Path
from typing import Any

from sklearn.datasets import load_breast_cancer

import dptune

BOUNDS = {  # sklearn.datasets.load_breast_cancer().DESCR, "Summary Statistics" (published Min, Max)
    "mean radius": [6.981, 28.11], "mean texture": [9.71, 39.28], "mean perimeter": [43.79, 188.5],
    "mean area": [143.5, 2501.0], "mean smoothness": [0.053, 0.163], "mean compactness": [0.019, 0.345],
    "mean concavity": [0.0, 0.427], "mean concave points": [0.0, 0.201], "mean symmetry": [0.106, 0.304],
    "mean fractal dimension": [0.05, 0.097],
}
TARGET_EPSILON = 8.0  # search + final training, composed
SMOKE_SEED = 2  # NOT PRIVATE, smoke test only: a fixed draw (one trial under Poisson(2))


def write_csv(path: Path) -> None:
    data = load_breast_cancer()
    columns = [list(data.feature_names).index(name) for name in BOUNDS]
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["record", *BOUNDS, "diagnosis"])
        for n, (row, label) in enumerate(zip(data.data, data.target, strict=True)):
            out.writerow([f"bc-{n}", *(row[i] for i in columns), data.target_names[label]])


def table_space(path: Path, epochs: float) -> dict[str, Any]:
    return {
        "name": "breast_cancer_csv",
        "dataset": {"name": "table", "path": str(path), "label": "diagnosis", "id_column": "record",
                    "classes": ["malignant", "benign"], "features": BOUNDS,
                    "validation_size": 100, "test_size": 100, "split_seed": 0},  # 369 rows train
        "model": {"name": "mlp", "kwargs": {"hidden": [32], "norm": "group", "act": "tanh"}},
        "fixed": {"epochs": epochs, "batch_size": 128, "max_grad_norm": 1.0, "optimizer": "sgd",
                  "momentum": 0.9},
        "space": {"learning_rate": {"type": "float", "low": 0.25, "high": 1.0, "log": True},
                  "groups": {"type": "categorical", "choices": [4, 8]},
                  "noise_multiplier": {"type": "float", "low": 3.0, "high": 4.0}},
        "default": {"learning_rate": 0.5, "groups": 4, "noise_multiplier": 3.0},  # released when K = 0
        "privacy": {"delta": 1e-5, "stopping": "poisson", "mean": 2, "score_noise": 6.0},
    }


def main(smoke_test: bool, work: Path) -> None:
    path = (work / "data" / "breast_cancer_mean.csv").resolve()
    write_csv(path)
    space = table_space(path, epochs=1 if smoke_test else 10)
    print(f"plan: the search costs epsilon {dptune.plan(space, n_train=369).search_epsilon:.3f}")
    found = dptune.search(space, budget_epsilon=30, ledger=work / "ledger.sqlite", runs_dir=work,
                          num_cpus=2 if smoke_test else None, seed=SMOKE_SEED if smoke_test else None)
    print(f"released config: { {k: found.config[k] for k in space['space']} }")
    print(f"released score: {found.score} (noised validation accuracy)")
    model = dptune.train(found, target_epsilon=TARGET_EPSILON, train_on_validation=True,
                         seed=1 if smoke_test else None)
    print(f"test accuracy: {model.metrics['test_accuracy']:.4f}")
    print(f"total epsilon: {model.epsilon:.4f} (target {TARGET_EPSILON:g}); model: {model.model}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke-test", action="store_true", help="tiny and fast, NOT PRIVATE, temp dirs")
    if parser.parse_args().smoke_test:
        with tempfile.TemporaryDirectory(prefix="dptune-example-") as tmp:
            main(True, Path(tmp))
    else:
        main(False, Path("runs"))
