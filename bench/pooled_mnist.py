"""Pool MNIST tuning-value runs over their split seeds (issue 13): per total ε and mode, the paired difference
to the literature default (a) and the share of the oracle gap closed, over every row that ran the mode.

Each run of ``bench/tuning_value.py --dataset mnist`` keeps every task's result in the .json beside its report;
this reads those records (no training), so runs on disjoint seeds can be judged together. A (ε, seed, task)
found in two records is taken from the first. Statistics are the bench's own (``paired_stats``,
``gap_share``): 95 % bootstrap CI of the paired mean difference, paired t-test, share CI by a paired
bootstrap over rows.

    .venv/bin/python bench/pooled_mnist.py bench/results/tuning_value_mnist_scaled.json \\
        bench/results/tuning_value_mnist_all.json bench/results/tuning_value_mnist_noisymax.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tuning_value import paired_stats  # noqa: E402
from tuning_value_mnist import MODE_NAMES, ORACLE_GRID, gap_share, mode_values  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def load_cells(paths: list[Path]) -> dict[tuple[float, int], dict[str, dict[str, Any]]]:
    cells: dict[tuple[float, int], dict[str, dict[str, Any]]] = {}
    for path in paths:
        for r in json.loads(path.read_text()):
            cells.setdefault((float(r["epsilon"]), int(r["seed"])), {}).setdefault(r["task"], r)
    grid = {f"grid{i}" for i in range(len(ORACLE_GRID))}
    return {k: v for k, v in cells.items() if grid <= set(v)}  # rows with a complete (a)/(o) grid


def _seeds(seeds: list[int]) -> str:
    runs, start = [], seeds[0]
    for a, b in zip(seeds, [*seeds[1:], None]):
        if b != a + 1:
            runs.append(f"{start}–{a}" if a != start else f"{a}")
            start = b  # type: ignore[assignment]
    return ", ".join(runs)


def table(cells: dict[tuple[float, int], dict[str, dict[str, Any]]], modes: list[str]) -> list[str]:
    lines = ["| ε | mode | seeds | rows | (a) % | (o) % | mode % | − (a) [95 % CI] | paired t p | beats (a) | "
             "share of gap [95 % CI] |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for eps in sorted({e for e, _ in cells}, key=lambda e: (e != 2, e != 4, e)):
        for m in modes:
            rows = [(s, mode_values(v)) for (e, s), v in sorted(cells.items()) if e == eps]
            rows = [(s, r) for s, r in rows if m in r]
            if not rows:
                continue
            col = {k: np.array([r[k] for _, r in rows]) for k in ("a", "o", m)}
            mean, lo, hi, p = paired_stats(col[m] - col["a"])
            sig = "yes" if (lo > 0 and p < 0.05) else ("worse" if (hi < 0 and p < 0.05) else "no")
            sh, slo, shi = gap_share(col[m], col["a"], col["o"])
            lines.append(f"| {eps:g} | {MODE_NAMES[m]} | {_seeds([s for s, _ in rows])} | {len(rows)} | "
                         f"{100 * col['a'].mean():.1f} | {100 * col['o'].mean():.1f} | {100 * col[m].mean():.1f} | "
                         f"{100 * mean:+.2f} [{100 * lo:+.2f}, {100 * hi:+.2f}] | {p:.3g} | {sig} | "
                         f"{sh:.2f} [{slo:.2f}, {shi:.2f}] |")
    return lines


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("records", nargs="+", type=Path, help=".json records of bench/tuning_value.py --dataset mnist")
    p.add_argument("--modes", default="m,g,b,d,s", help="modes to pool (each over the rows that ran it)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "tuning_value_mnist_pooled.md")
    args = p.parse_args(argv)
    cells = load_cells(args.records)
    names = " ".join(str(r.resolve().relative_to(ROOT) if r.resolve().is_relative_to(ROOT) else r) for r in args.records)
    text = "\n".join([
        "# MNIST tuning value, pooled over runs (bench/pooled_mnist.py, issue 13)", "",
        f"Command: `python bench/pooled_mnist.py {names}`", "",
        (__doc__ or "").split("\n\n")[1].replace("\n", " "), "",
        *table(cells, [m for m in args.modes.split(",") if m]), "",
        "Beats (a) = 95 % bootstrap CI of the paired mean difference excludes 0 and paired t-test p < 0.05.", ""])
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
