"""Does the public proxy rank fixed configs the way the target does? (issue 21: why a rehearsal misjudges).

The verdict rehearses a space's whole search on a public proxy (``bench/proxy_priors.py --rehearse``). Where the
rehearsal and the target disagree, the cause is either the configs' final runs (the proxy trains a config worse or
better, relative to the baseline, than the target does) or the search's selection. This bench isolates the first:
it trains the baseline and the oracle grid's points (``--grid B:lr,...``, the baseline's other settings kept; the
same points ``bench/tuning_value.py --grid`` trains on the target) once with the whole ε on the proxy, carried as
the rehearsal carries every run (the target's q, steps and update noise σ·C/B, the space's own model), and prints
each point's mean difference to the baseline beside the target's, read from ``tuning_value`` records
(``--target-json``: rows already measured; nothing on the target runs here).

    python bench/proxy_fidelity.py --space search_spaces/mnist.yaml --proxy mnist-public \
        --grid 256:0.4,256:1.6,1024:3.2 --seeds 100-107 --epsilons 1,2,4 --target-json A.json,B.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

from harness.context import parse_grid, parse_seeds
from harness.proxy import merged, proxy_data, whole_budget

from dptune.config import load_space, nominal_train_size

RESULTS = Path(__file__).resolve().parent / "results"


def point(space_path: str, proxy: str, grid: tuple[tuple[int, float], ...], i: int, eps: float, seed: int) -> float:
    """Test accuracy on the proxy's split ``seed`` of grid point ``i`` (0: the baseline) trained once with ``eps``."""
    import torch

    torch.set_num_threads(1)
    space = load_space(space_path)
    n_final_s = (nominal_train_size(space.dataset) or 0) + space.dataset.validation_size
    cfg = space.baseline
    if i > 0:
        cfg = cfg.replace(batch_size=grid[i - 1][0], learning_rate=grid[i - 1][1])
    return whole_budget(cfg, eps, merged(proxy_data(proxy, seed)), n_final_s, space.privacy.delta, seed,
                        own_model=proxy != "digits")


def target_rows(paths: str) -> dict[tuple[float, str], dict[int, float]]:
    """(ε, task) → {seed: test accuracy} from ``bench/tuning_value.py`` records (tasks grid0, grid1, …)."""
    out: dict[tuple[float, str], dict[int, float]] = {}
    for f in filter(None, paths.split(",")):
        for r in json.loads(Path(f).read_text()):
            if str(r["task"]).startswith("grid"):
                out.setdefault((float(r["epsilon"]), r["task"]), {})[int(r["seed"])] = float(r["test"])
    return out


def _diff(acc: dict[int, float], base: dict[int, float]) -> str:
    d = [100 * (acc[s] - base[s]) for s in sorted(acc) if s in base]
    if len(d) < 2:
        return "–"
    return f"{statistics.mean(d):+.2f} ± {statistics.stdev(d) / len(d) ** 0.5:.2f} ({len(d)})"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--space", required=True)
    p.add_argument("--proxy", default="mnist-public", choices=["mnist-public", "digits"])
    p.add_argument("--grid", required=True, help="B:lr points, e.g. 256:0.4,1024:3.2")
    p.add_argument("--seeds", default="100-107")
    p.add_argument("--epsilons", default="1,2,4")
    p.add_argument("--target-json", default="", help="tuning_value records (comma-separated) with the same grid")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--out", help="the report (default bench/results/proxy_fidelity_<space>.md)")
    args = p.parse_args(argv)
    grid = parse_grid(args.grid)
    seeds, epsilons = parse_seeds(args.seeds), [float(e) for e in args.epsilons.split(",")]
    space = load_space(args.space)
    t0 = time.time()
    with ProcessPoolExecutor(max_workers=args.jobs, mp_context=get_context("spawn")) as ex:
        futs = {(e, i, s): ex.submit(point, args.space, args.proxy, grid, i, e, s)
                for e in epsilons for i in range(len(grid) + 1) for s in seeds}
        acc = {k: f.result() for k, f in futs.items()}
    target = target_rows(args.target_json)
    b = space.baseline
    lines = [f"# Does the proxy ({args.proxy}) rank fixed configs as {space.name}'s target does? "
             "(bench/proxy_fidelity.py)", "",
             f"Command: `python bench/proxy_fidelity.py {' '.join(argv)}` ({(time.time() - t0) / 60:.1f} min). "
             f"Each point trained once with the whole ε on train ∪ validation; baseline (a): B {b.batch_size}, "
             f"lr {b.learning_rate:g}, {b.epochs:g} epochs, groups {b.groups}; the grid keeps its other settings. "
             f"Proxy seeds {seeds}. Cells: mean difference to (a) in points ± std error (rows).", "",
             "| ε | (a) proxy % | (a) target % | " + " | ".join(f"B {g[0]} lr {g[1]:g}: proxy | target" for g in grid)
             + " |", "|---|---|---|" + "---|---|" * len(grid)]
    for e in epsilons:
        base = {s: acc[e, 0, s] for s in seeds}
        tbase = target.get((e, "grid0"), {})
        tb = f"{100 * statistics.mean(tbase.values()):.1f}" if tbase else "–"
        cells = [f"{_diff({s: acc[e, i, s] for s in seeds}, base)} | {_diff(target.get((e, f'grid{i}'), {}), tbase)}"
                 for i in range(1, len(grid) + 1)]
        lines.append(f"| {e:g} | {100 * statistics.mean(base.values()):.1f} | {tb} | " + " | ".join(cells) + " |")
    text = "\n".join([*lines, ""])
    out = Path(args.out) if args.out else RESULTS / f"proxy_fidelity_{space.name}.md"
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps([{"epsilon": e, "point": i, "seed": s, "test": a}
                                                    for (e, i, s), a in sorted(acc.items())], indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
