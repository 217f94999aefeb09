"""Batch clipping and adaptive layerwise clipping on MNIST (issue 24), paired per split seed, at total ε 2 and 4.

    python bench/clipping_modes.py --seeds 40,41 --epsilons 2,4        # writes bench/results/clipping_modes.md/.json

Pool, splits (8,000 / 1,000 / 1,000 per split seed), model and final training as the tuning-value harness
(``bench/tuning_value.py --space search_spaces/mnist.yaml``, modes S and A).

(flat) ``search_spaces/mnist_scaled.yaml``: the scaled searcher (B × lr, 6 candidates, one noisy max, final run
       planned from the total ε), per-example clipping of the whole gradient at C = 1, GroupNorm tanh CNN;
(alc)  ``search_spaces/mnist_alc.yaml``: the same search, the same draw and noise seeds, each layer clipped to its
       own C_l from public digits (sqrt(Σ C_l²) = 1: the same charge);
(bc)   batch clipping with the BatchNorm tanh CNN (``norm: batch``, ``clipping: batch``) on a grid of B × lr at 10
       epochs, each trained once with the whole ε (σ twice the per-example calibration: sensitivity 2C), scored on
       the *test* split, the best: not private, an upper bound on what any private search over this grid can give
       batch clipping. (A search that plans its final run refuses batch clipping.)
(gn)   the same grid with per-example clipping and GroupNorm, whole ε, test-scored, the best: the same upper bound
       for per-example clipping, side by side.

It also prints the ε that the paper's noise σ = 0.01875 costs under batch clipping (one step; one epoch of
CIFAR-10's 50,000 at B 64): their batch size and epochs could not be read offline, and one step already says it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from harness.context import BenchSpec, bench
from harness.runner import load_modes, run_tasks
from harness.stats import paired_stats

from dptune.accounting import calibrate_final, epsilon, trial_event

SPEC = BenchSpec(space="search_spaces/mnist.yaml")  # the data, the baseline config (planner.baseline), δ
GRID = ((256, 0.1), (256, 1.0), (1024, 0.1), (1024, 1.0))  # (B, lr), 10 epochs
NAMES = {"flat": "(flat) per-example clipping, scaled search", "alc": "(alc) layerwise clipping, same search",
         "bc": "(bc) batch clipping + BatchNorm, best of grid (test-scored upper bound)",
         "gn": "(gn) per-example + GroupNorm, best of grid (test-scored upper bound)"}


def _grid_run(bb: Any, eps: float, seed: int, merged: Any, b: int, lr: float, batch: bool) -> float:
    from dptune.dpsgd import run_trial

    cfg = bb.baseline.replace(batch_size=b, learning_rate=lr, seed=1_000_003 * (seed + 1) + b + round(100 * lr))
    if batch:
        cfg = cfg.replace(clipping="batch", model_kwargs={"norm": "batch"}, physical_batch_size=2 * b)
    cal = calibrate_final(cfg, n_train=bb.n_final, delta=bb.delta, target_epsilon=eps)  # batch clipping: σ × 2
    assert cal.epsilon_total() <= eps * (1 + 1e-9)
    r = run_trial(cal.config, merged, evaluate_test=True)
    assert r.noise_std is not None and abs(r.noise_std / cal.config.noise_multiplier - 1) < 0.02  # measured
    return float(r.test_accuracy or 0.0)


def run_task(spec: BenchSpec, task: str, plan: Any, eps: float, seed: int) -> dict[str, Any]:
    """One task (``harness.runner.run_tasks``' signature): the search of S or A, or a grid."""
    import torch

    torch.set_num_threads(1)
    t0 = time.time()
    bb = bench(spec)
    data, merged = bb.splits(seed)
    if task in ("flat", "alc"):  # the same draw and noise seeds: alc takes S's key
        out = load_modes()["S" if task == "flat" else "A"].run(bb, None, eps, seed, data, merged)
    else:
        out = {"grid": [_grid_run(bb, eps, seed, merged, b, lr, task == "bc") for b, lr in GRID]}
        out["test"] = max(out["grid"])
    return {"epsilon": eps, "seed": seed, "task": task, "seconds": time.time() - t0, **out}


def paper_epsilon() -> list[str]:
    sigma = 0.01875 / 2  # batch clipping: sensitivity 2C
    q, t = 64 / 50_000, 50_000 // 64
    one = epsilon([trial_event(noise_multiplier=sigma, sampling_rate=q, steps=1, score_noise=None)], bench(SPEC).delta)
    epoch = epsilon([trial_event(noise_multiplier=sigma, sampling_rate=q, steps=t, score_noise=None)], bench(SPEC).delta)
    return [f"The paper's σ = 0.01875 under batch clipping (charged at σ/2), δ = {bench(SPEC).delta:g}: one step at q = 64/50,000 "
            f"costs ε = {one:,.0f}; one epoch of CIFAR-10 at B 64 ({t} steps) costs ε = {epoch:,.0f}."]


def _search_cell(c: dict[str, Any], m: str) -> str:
    if m not in c:
        return "…"
    rel = ", ".join(f"{k} {v:.3g}" for k, v in sorted(c[m]["released"].items()) if k != "layer_clip")
    return f"{rel} → {100 * c[m]['test']:.1f}"


def _grid_cell(c: dict[str, Any], m: str) -> str:
    return " ".join(f"{100 * x:.1f}" for x in c[m]["grid"]) if m in c else "…"


def report(cells: dict[tuple[float, int], dict[str, Any]], cmd: str, elapsed: float) -> str:
    lines = ["# Batch clipping and adaptive layerwise clipping on MNIST (bench/clipping_modes.py, issue 24)", "",
             f"Command: `{cmd}` ({elapsed / 60:.1f} min).", "", (__doc__ or "").split("\n\n", 2)[2].strip(), "",
             "| ε | mode | rows | test acc. % | − (flat) [95 % CI] | paired t p |", "|---|---|---|---|---|---|"]
    for eps in sorted({e for e, _ in cells}):
        rows = [c for (e, _), c in sorted(cells.items()) if e == eps and all(m in c for m in NAMES)]
        if not rows:
            continue
        col = {m: np.array([r[m]["test"] for r in rows]) for m in NAMES}
        for m in NAMES:
            v = col[m]
            sd = f" ± {100 * v.std(ddof=1):.1f}" if len(v) > 1 else ""
            stats = "–"
            if m != "flat" and len(v) > 1:
                mean, lo, hi, p = paired_stats(v - col["flat"])
                stats = f"{100 * mean:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}] | {p:.3g}"
            elif m != "flat":
                stats = f"{100 * float(v[0] - col['flat'][0]):+.1f} | –"
            lines.append(f"| {eps:g} | {NAMES[m]} | {len(v)} | {100 * v.mean():.1f}{sd} | {stats}" +
                         (" | – |" if stats == "–" else " |"))
    lines += ["", "## Per row", "", "| ε | seed | flat | alc | bc grid (GRID order) | gn grid |", "|---|---|---|---|---|---|"]
    for (eps, seed), c in sorted(cells.items()):
        lines.append(f"| {eps:g} | {seed} | {_search_cell(c, 'flat')} | {_search_cell(c, 'alc')} | "
                     f"{_grid_cell(c, 'bc')} | {_grid_cell(c, 'gn')} |")
    lines += ["", f"GRID (B, lr) at 10 epochs: {GRID}.", "", *paper_epsilon(), ""]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="40,41")
    p.add_argument("--epsilons", default="2,4")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--out", default="bench/results/clipping_modes.md")
    args = p.parse_args(argv)
    if not Path(str(bench(SPEC).space.dataset.path)).is_dir():
        print(f"{bench(SPEC).space.dataset.path} is not here: this bench needs the real MNIST test split")
        return 2
    cmd = " ".join(["python", "bench/clipping_modes.py", *argv])
    out, t0 = Path(args.out), time.time()
    cells: dict[tuple[float, int], dict[str, Any]] = {}

    def save() -> None:
        out.write_text(report(cells, cmd, time.time() - t0))
        out.with_suffix(".json").write_text(json.dumps([x for c in cells.values() for x in c.values()], default=str))

    rows = [(float(e), int(s)) for e in args.epsilons.split(",") for s in args.seeds.split(",")]
    run_tasks([(SPEC, t, None, e, s) for e, s in rows for t in NAMES], args.jobs, 1, cells, save, task=run_task)
    print(out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
