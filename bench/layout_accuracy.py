"""The channels-last CNNs against the same CNNs in NCHW: one whole trial per seed each way, in one process, the test
accuracy side by side (issue 44: a change that is not bit for bit is measured over >= 5 seeds).

``gn_cnn`` and ``tanh_cnn`` are built channels-last (``dptune/models/_cnn.py``): the same function, but float sums in
another order, so a trial's trajectory parts from the NCHW one after its first steps. Cases (public data only): the
embedded default, ``gn_cnn`` on digits at B 256 (20 epochs); ``tanh_cnn`` on the real MNIST test split at B 256
(10 epochs, the MNIST spaces' default; skipped without ``../shared/data/mnist-t10k``). Each seed trains both ways
with the same noise and sampling streams (the trial's seed), at 1 thread; the wall time of each is printed too.

    python bench/layout_accuracy.py [--seeds 0 1 2 3 4] [--cases digits mnist] [--epochs E] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from harness.layouts import MNIST, mnist_t10k

CASES = {"digits": ("gn_cnn", 20.0), "mnist": ("tanh_cnn", 10.0)}


def run_case(case: str, seeds: list[int], epochs: float | None) -> list[dict[str, Any]]:
    from dptune.config import DatasetSpec, TrialConfig
    from dptune.data import load_dataset
    from dptune.dpsgd import run_trial

    model, default_epochs = CASES[case]
    data = load_dataset(DatasetSpec() if case == "digits" else mnist_t10k())
    rows = []
    for seed in seeds:
        config = TrialConfig(model=model, batch_size=256, epochs=epochs or default_epochs, noise_multiplier=1.0,
                             learning_rate=0.5, score_noise=None, seed=seed, clipping="bookkeeping")
        layouts = (("nchw", config.replace(model="factory:harness.layouts:nchw_factory", model_kwargs={"name": model})),
                   ("channels_last", config))
        if not rows:  # warm-up: the clipping guard's probes, once per model
            for _, cfg in layouts:
                run_trial(cfg.replace(epochs=0.05), data)
        row: dict[str, Any] = {"case": case, "model": model, "seed": seed}
        for layout, cfg in layouts:
            t = time.perf_counter()
            result = run_trial(cfg, data, evaluate_test=True)
            row[layout] = {"test": result.test_accuracy, "val": result.val_accuracy_raw,
                           "seconds": time.perf_counter() - t}
        print(f"{case} seed {seed}: test NCHW {row['nchw']['test']:.4f} channels-last "
              f"{row['channels_last']['test']:.4f} ({row['nchw']['seconds']:.1f} s / "
              f"{row['channels_last']['seconds']:.1f} s)", flush=True)
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| case | model | seeds | test accuracy NCHW (mean) | channels-last (mean) | mean difference | "
             "largest abs. difference | same in | trial NCHW s (median) | channels-last s (median) | speed-up |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for case in dict.fromkeys(r["case"] for r in rows):
        rs = [r for r in rows if r["case"] == case]
        a = [r["nchw"]["test"] for r in rs]
        b = [r["channels_last"]["test"] for r in rs]
        d = [y - x for x, y in zip(a, b, strict=True)]
        ta = statistics.median(r["nchw"]["seconds"] for r in rs)
        tb = statistics.median(r["channels_last"]["seconds"] for r in rs)
        lines.append(f"| {case} | {rs[0]['model']} | {len(rs)} | {statistics.mean(a):.4f} | {statistics.mean(b):.4f} | "
                     f"{statistics.mean(d):+.4f} | {max(abs(v) for v in d):.4f} | {sum(v == 0 for v in d)} of "
                     f"{len(d)} | {ta:.1f} | {tb:.1f} | {ta / tb:.2f}x |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    ap.add_argument("--epochs", type=float, help="epochs per trial (default: each case's)")
    ap.add_argument("--out", type=Path, help="also write the table (markdown) here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for case in args.cases:
        if case == "mnist" and not MNIST.exists():
            print(f"mnist: skipped ({MNIST} is absent)")
            continue
        rows += run_case(case, args.seeds, args.epochs)
    lines = table(rows)
    print("\n".join(lines))
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
