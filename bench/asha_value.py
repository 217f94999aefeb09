"""Does early stopping pay at the same total ε? Random search to the end (random stopping), each trial stopping
itself (``own_curve``, random stopping) and ASHA under the RDP filter, side by side on the same split seeds.

    python bench/asha_value.py [--seeds 400-405] [--target 8] [--epochs 15] [--out FILE]

Each row (split seed s): the three spaces of the embedded digits — ``digits.yaml`` (fifo, Poisson mean 2),
``digits_own_curve.yaml`` (the same, each trial stopping on its own noised rung scores; charged at a score per rung)
and ``digits_asha.yaml`` (ASHA, a filter of 2 full trials' worth) — each run as a user runs it: ``dptune.search``
(its own draw from OS entropy, a fresh ledger) then ``dptune.train`` on train + validation at total ε ``--target``
(the final run calibrated to what the search left). Per mode: the final test accuracy, the hardware the search used
(trial-epochs: each trial's steps over its steps per epoch, summed, from the curator's sealed rows) and its wall
time; then the paired differences to the fifo search (mean ± standard error over the rows). The modes were declared
with these seeds before any row ran (the commit that added this file); the rows are not used to choose anything.
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

import dptune
from dptune.trials import read_trials

MODES = {"fifo": "search_spaces/digits.yaml", "own_curve": "search_spaces/digits_own_curve.yaml",
         "asha": "search_spaces/digits_asha.yaml"}


def _seeds(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def _row(mode: str, seed: int, target: float, epochs: int, work: Path) -> dict[str, Any]:
    raw = yaml.safe_load(Path(MODES[mode]).read_text())
    raw["dataset"]["split_seed"] = seed
    raw["fixed"]["epochs"] = epochs
    t0 = time.perf_counter()
    found = dptune.search(raw, budget_epsilon=100, ledger=work / f"{mode}-{seed}.sqlite", runs_dir=work / "runs",
                          name=f"{mode}-{seed}", num_cpus=2)
    seconds = time.perf_counter() - t0
    rows = read_trials(found.run / "sealed" / "trials.parquet") if (found.run / "sealed" / "trials.parquet").exists() \
        else []
    n_train = 1797 - raw["dataset"]["validation_size"] - raw["dataset"]["test_size"]
    trial_epochs = sum(r.steps / math.ceil(n_train / int(r.params.get("batch_size", raw["default"]["batch_size"])))
                       for r in rows if r.steps)
    model = dptune.train(found, target_epsilon=target, train_on_validation=True, seed=seed)
    return {"acc": float(model.metrics["test_accuracy"]), "search_eps": found.epsilon, "total_eps": model.epsilon,
            "trial_epochs": trial_epochs, "seconds": seconds, "trials": len(rows)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="400-405")
    ap.add_argument("--target", type=float, default=8.0)
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    results: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in _seeds(args.seeds):
            for mode in MODES:
                r = _row(mode, seed, args.target, args.epochs, Path(tmp))
                results[mode].append(r)
                print(f"seed {seed} {mode:>9}: test {r['acc']:.4f}  search ε {r['search_eps']:.3f}  total ε "
                      f"{r['total_eps']:.3f}  trials {r['trials']}  trial-epochs {r['trial_epochs']:.1f}  "
                      f"{r['seconds']:.0f} s", flush=True)
    lines = [f"`python bench/asha_value.py --seeds {args.seeds} --target {args.target:g} --epochs {args.epochs}` "
             f"(digits, total ε {args.target:g}, {len(results['fifo'])} split seeds)", "",
             "| mode | test accuracy (mean) | Δ vs fifo (paired, ± s.e.) | search ε | trial-epochs (mean) | "
             "× fifo's | search wall time (mean s) |", "|---|---|---|---|---|---|---|"]
    base = results["fifo"]
    for mode, rows in results.items():
        diffs = [r["acc"] - b["acc"] for r, b in zip(rows, base, strict=True)]
        se = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else float("nan")
        te = statistics.mean(r["trial_epochs"] for r in rows)
        te0 = statistics.mean(b["trial_epochs"] for b in base)
        lines.append(f"| {mode} | {statistics.mean(r['acc'] for r in rows):.4f} | "
                     f"{statistics.mean(diffs):+.4f} ± {se:.4f} | {rows[0]['search_eps']:.3f} | {te:.1f} | "
                     f"{te / te0:.2f} | {statistics.mean(r['seconds'] for r in rows):.0f} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
