"""Wall time of one whole trial (``run_trial``), this checkout against another revision, interleaved, each in a fresh
process as a search's worker runs it: only that trial's engine in the process, its steps one after another.

``bench/step_overhead.py`` times single steps of every clipping mode round-robin in one process; what the process
allocated and freed for the other modes then decides what glibc's malloc does for this one (its mmap threshold
moves with the blocks freed), so a cost that depends on the allocator (page faults: ``dptune/dpsgd/_malloc.py``)
shows there differently from a trial. Here each run is one process: a short warm-up trial (imports, the clipping
guard's probes), then the timed trial, with the process's minor page faults counted over it.

Cases (public data only): the embedded default, ``gn_cnn`` on digits at B 256 (20 epochs); the MNIST spaces' model,
``tanh_cnn`` on the real MNIST test split at B 256 (2 epochs; skipped without ``../shared/data/mnist-t10k``).
Same seed for both revisions: the validation accuracy is compared (equal unless the training changed).

    python bench/trial_walltime.py [--before REV] [--repeats 3] [--cases digits mnist] [--quick] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from harness.layouts import MNIST, mnist_t10k
from harness.revisions import checkout, load_average

ROOT = Path(__file__).resolve().parent.parent
CASES = {"digits": ("gn_cnn", 20.0), "mnist": ("tanh_cnn", 2.0)}


def child(case: str, quick: bool) -> None:
    """One case in this process (run with the revision's dptune on PYTHONPATH): prints its JSON line."""
    import resource
    import time

    import torch

    from dptune.config import DatasetSpec, TrialConfig
    from dptune.data import load_dataset
    from dptune.dpsgd import run_trial

    torch.set_num_threads(1)
    model, epochs = CASES[case]
    data = load_dataset(DatasetSpec() if case == "digits" else mnist_t10k())
    config = TrialConfig(model=model, batch_size=256, epochs=1.0 if quick else epochs, noise_multiplier=1.0,
                         learning_rate=0.5, score_noise=None, seed=3)
    run_trial(config.replace(epochs=0.5), data)  # warm-up: imports, the guard's probes
    faults, start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
    result = run_trial(config, data)
    print(json.dumps({"seconds": time.perf_counter() - start, "val_accuracy": result.val_accuracy_raw,
                      "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults}))


def _run(tree: Path, case: str, quick: bool) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    argv = [sys.executable, __file__, "--child", case, *(["--quick"] if quick else [])]
    r = subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        raise SystemExit(f"the {case} trial failed in {tree}:\n{r.stderr}")
    return dict(json.loads(r.stdout.strip().splitlines()[-1]))


def measure(cases: list[str], repeats: int, before: Path | None, quick: bool) -> list[dict[str, Any]]:
    rows = []
    for case in cases:
        if case == "mnist" and not MNIST.is_dir():
            print(f"{case}: skipped, {MNIST} is absent", flush=True)
            continue
        runs: dict[str, list[dict[str, Any]]] = {"after": [], "before": []}
        for _ in range(repeats):
            runs["after"].append(_run(ROOT, case, quick))
            if before is not None:
                runs["before"].append(_run(before, case, quick))
        row: dict[str, Any] = {"case": case, "model": CASES[case][0], **runs}
        if before is not None:
            row["ratio"] = statistics.median(r["seconds"] for r in runs["before"]) / \
                statistics.median(r["seconds"] for r in runs["after"])
            row["same_accuracy"] = len({r["val_accuracy"] for r in runs["after"] + runs["before"]}) == 1
        rows.append(row)
        print(_line(row), flush=True)
    return rows


def _summary(runs: list[dict[str, Any]]) -> str:
    each = ", ".join(f"{r['seconds']:.2f}" for r in runs)
    return (f"{statistics.median(r['seconds'] for r in runs):.2f} s median ({each}), "
            f"{statistics.median(r['faults'] for r in runs):,.0f} page faults")


def _line(row: dict[str, Any]) -> str:
    text = f"{row['case']} ({row['model']}): after {_summary(row['after'])}"
    if row["before"]:
        text += (f" | before {_summary(row['before'])} | before/after {row['ratio']:.2f}x | "
                 f"same validation accuracy: {row['same_accuracy']}")
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--before", metavar="REV", help="also run this git revision's trial, interleaved")
    ap.add_argument("--quick", action="store_true", help="1 epoch per trial (smoke test)")
    ap.add_argument("--out", help="write the measurements as JSON here")
    ap.add_argument("--child", choices=sorted(CASES), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.quick)
        return
    result: dict[str, Any] = {"load_before": load_average(), "before_rev": args.before, "repeats": args.repeats}
    with checkout(args.before) as before:
        result["cases"] = measure(args.cases, args.repeats, before, args.quick)
    result["load_after"] = load_average()
    print(f"load average (1, 5, 15 min) {result['load_before']} before, {result['load_after']} after")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
