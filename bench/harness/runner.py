"""Tasks and records: one task per (ε, row seed, mode or grid point), run in spawned worker processes (torch at
``threads`` threads each); each finished task is one record in the .json beside the report, written after every
task. ``--resume`` keeps a file's records and runs only the missing tasks; ``--from-json`` pools records (of this
harness or of the benches it replaced: the same record format) without training.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from harness.context import BenchSpec, bench
from harness.modes import MODES

Cells = dict[tuple[float, int], dict[str, dict[str, Any]]]  # (ε, seed) -> task -> record


def load_modes() -> dict[str, Any]:
    """Every registered mode (importing the modules registers them)."""
    import harness.fixed_sigma
    import harness.scaled_rules
    import harness.scheduled
    import harness.searches  # noqa: F401

    return MODES


def grid_tasks(spec: BenchSpec) -> list[str]:
    """``grid0`` (the baseline: mode a) and one task per oracle point (mode o)."""
    return [f"grid{i}" for i in range(len(spec.grid) + 1)]


def _init(threads: int) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    import torch

    torch.set_num_threads(threads)


def run_task(spec: BenchSpec, task: str, plan: Any, eps: float, seed: int) -> dict[str, Any]:
    """One task in a worker: the row's data, then the grid point or the mode."""
    t0 = time.time()
    b = bench(spec)
    data, merged = b.splits(seed)
    if task.startswith("grid"):
        out = b.final_run(b.grid_config(int(task[4:])), [], eps, merged, seed)
    else:
        out = load_modes()[task].run(b, plan, eps, seed, data, merged)
    return {"epsilon": eps, "seed": seed, "task": task, "seconds": time.time() - t0, **out}


def run_tasks(calls: list[tuple[Any, ...]], jobs: int, threads: int, cells: Cells, save: Callable[[], None],
              task: Callable[..., dict[str, Any]] = run_task) -> None:
    """Run ``task`` (a module-level function: the workers import it) on each argument tuple in ``jobs`` workers;
    file each record under cells[(ε, seed)][task], print one line and ``save()`` after every one."""
    t0 = time.time()
    with ProcessPoolExecutor(max_workers=max(1, jobs), mp_context=get_context("spawn"), initializer=_init,
                             initargs=(threads,)) as ex:
        futs: list[Future[dict[str, Any]]] = [ex.submit(task, *c) for c in calls]
        pending = set(futs)
        while pending:
            finished, pending = wait(pending, return_when=FIRST_COMPLETED)
            for fu in finished:
                r = fu.result()
                cells.setdefault((r["epsilon"], r["seed"]), {})[r["task"]] = r
                print(f"[{len(futs) - len(pending)}/{len(futs)}] ε {r['epsilon']:g} seed {r['seed']} {r['task']}: "
                      f"test {100 * r['test']:.1f} ({r['seconds']:.0f} s, {(time.time() - t0) / 60:.1f} min)",
                      flush=True)
                save()


def save_records(path: Path, cells: Cells) -> None:
    path.write_text(json.dumps([r for c in cells.values() for r in c.values()], indent=0, default=str))


def load_records(paths: list[str], rows: list[tuple[float, int]] | None = None) -> Cells:
    """Records of .json files (this harness's or the replaced benches'), for ``rows`` (None: all). A task found
    in two files is taken from the first."""
    cells: Cells = {}
    for path in paths:
        for r in json.loads(Path(path).read_text()):
            key = (float(r["epsilon"]), int(r["seed"]))
            if rows is None or key in rows:
                cells.setdefault(key, {}).setdefault(r["task"], r)
    return cells
