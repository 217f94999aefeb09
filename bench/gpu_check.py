"""GPU path check: every clipping engine trains a real MNIST trial on CUDA and on the CPU, side by side.

Run on a machine with a GPU (``python bench/gpu_check.py --mnist PATH``); prints, per engine and device, the
measured noise std against σ·C, the steps against T, validation and test accuracy, and the wall time, and the
CUDA/CPU time ratio. It checks that the trial's noise is drawn on the GPU by the trial's own generator (the
measured std is σ·C there too) and that each engine's result is finite and learns. No Ray: the trial function
the search's trainable calls, with the device the trainable would pick when Ray grants it a GPU.
"""

from __future__ import annotations

import argparse
import json
import secrets
import time
from dataclasses import replace

import torch

from dptune.config import TrialConfig, load_space
from dptune.data import load_dataset
from dptune.dpsgd import run_trial

MODES = ("bookkeeping", "hooks", "functorch", "ghost", "batch")


def _config(mode: str, batch: int, epochs: float) -> TrialConfig:
    kwargs = {"norm": "batch"} if mode == "batch" else {}
    sigma = 0.5 if mode == "batch" else 1.0
    return TrialConfig(model="tanh_cnn", groups=8, learning_rate=1.0 if mode != "batch" else 0.1,
                       batch_size=batch, epochs=epochs, noise_multiplier=sigma, max_grad_norm=1.0,
                       optimizer="sgd", momentum=0.0, clipping=mode, physical_batch_size=min(batch, 512),
                       score_noise=None, seed=secrets.randbits(128), model_kwargs=kwargs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mnist", required=True, help="folder with the MNIST t10k IDX files")
    ap.add_argument("--epochs", type=float, default=2.0)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--devices", default="cuda,cpu")
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args()
    space = load_space("search_spaces/mnist.yaml")
    data = load_dataset(replace(space.dataset, path=args.mnist))
    print(f"torch {torch.__version__}, cuda {torch.cuda.is_available()}"
          + (f" ({torch.cuda.get_device_name(0)})" if torch.cuda.is_available() else "")
          + f", cpu threads {torch.get_num_threads()}, train {len(data.train[1])}")
    rows = []
    for mode in MODES:
        times: dict[str, float] = {}
        for dev in args.devices.split(","):
            cfg = _config(mode, args.batch, args.epochs)
            if dev == "cuda":  # warm-up: CUDA context and kernels, not counted
                run_trial(cfg.replace(epochs=0.2), data, device=dev)
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            r = run_trial(cfg, data, device=dev, evaluate_test=True)
            if dev == "cuda":
                torch.cuda.synchronize()
            sec = time.perf_counter() - t0
            times[dev] = sec
            sens = 2.0 if mode == "batch" else 1.0
            row = {"mode": mode, "device": dev, "seconds": round(sec, 2), "steps": r.steps,
                   "noise_additions": r.noise_additions, "noise_std": r.noise_std,
                   "sigma_C": cfg.noise_multiplier * cfg.max_grad_norm, "sensitivity": sens,
                   "val": r.val_accuracy_raw, "test": r.test_accuracy, "diverged": r.diverged,
                   "mean_batch": r.mean_batch_size, "engine": r.clipping_mode}
            rows.append(row)
            print(json.dumps(row), flush=True)
        if "cuda" in times and "cpu" in times:
            print(f"{mode}: cpu/cuda time ratio {times['cpu'] / times['cuda']:.2f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
