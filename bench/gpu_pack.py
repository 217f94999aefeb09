"""Trials per GPU-hour: one trial per GPU against trials packed on it (issue 44; ``bench/gpu_check.sh pack``).

    python bench/gpu_pack.py --mnist .gpu --out $OUT/gpu_pack.json      # on a GPU machine
    python bench/gpu_pack.py --smoke --out /tmp/gpu_pack.json           # CPU: tiny data, 2 trials, Ray told of 1 GPU

Each space is searched twice through ``dptune.search`` (the public API: Ray Tune, the real trainable, the
charged plan), once per ``--gpus-per-trial`` value, with one fixed seed, so both arms run the same N trials
(configs and seeds); composed accounting runs exactly N. NOT PRIVATE (fixed seed): a throughput bench.

- **mnist**: ``search_spaces/mnist.yaml`` on the MNIST t10k IDX files (``--mnist``), epochs fixed (``--mnist-epochs``).
- **cifar10_resnet9**: ``search_spaces/cifar10_resnet9.yaml`` on a synthetic folder in the real CIFAR-10 format
  (``--cifar-per-batch`` images in each of the 5 training batches: 10,000 is CIFAR-10's 50,000), epochs
  ``--cifar-epochs``. Random images: the accuracies mean nothing, the time per trial is CIFAR-10's.

Per arm: the trials' makespan (first start to last end, from the sealed trial rows), trials per GPU-hour over it
(one machine, one GPU) and over the whole search's wall time (Ray's start, the data and the plan included), the
most trials seen running at once, the trials' devices, and from ``nvidia-smi`` (every second) the most GPU
memory one trial's process held, the most held in all, and the mean GPU utilisation. ``--smoke`` starts Ray with
one logical GPU (``num_gpus=1``) on a machine without one: the scheduling is Ray's real one, the trials run on
the CPU. Results: a table on stdout, every field in ``--out`` (JSON, rewritten after each arm).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml
from harness.synthetic import synthetic_cifar_space, write_synthetic_cifar

import dptune
from dptune.trials import read_trials

ROOT = Path(__file__).resolve().parents[1]
SEED = 44  # NOT PRIVATE: the same draw (trials, configs, seeds) in both arms


def _yaml(name: str) -> dict[str, Any]:
    return dict(yaml.safe_load((ROOT / "search_spaces" / f"{name}.yaml").read_text()))


def _composed(space: dict[str, Any], trials: int, epochs: float) -> dict[str, Any]:
    """``space`` running exactly ``trials`` trials (composed accounting) of ``epochs`` epochs each."""
    space["space"].pop("epochs", None)
    space["fixed"]["epochs"] = space["default"]["epochs"] = epochs
    privacy = {k: v for k, v in space["privacy"].items() if k not in ("eta", "stopping_settings")}
    space["privacy"] = {**privacy, "stopping": "composed", "mean": trials}
    return space


def mnist_space(folder: Path, trials: int, epochs: float) -> dict[str, Any]:
    space = _composed(_yaml("mnist"), trials, epochs)
    space["dataset"]["path"] = str(folder.resolve())
    space.pop("planner", None)  # its rehearsal is of the real search: this one is judged analytically
    return space


def cifar_space(folder: Path, per_batch: int, trials: int, epochs: float, smoke: bool) -> dict[str, Any]:
    return _composed(synthetic_cifar_space(folder, per_batch, smoke), trials, epochs)


class GpuSampler:
    """``nvidia-smi`` every ``every`` seconds while inside: each process's most GPU memory (MiB), the most in all,
    the utilisation. Without nvidia-smi (``--smoke``) nothing is sampled and every field is None."""

    def __init__(self, every: float = 1.0) -> None:
        self.every = every
        self.per_pid: dict[str, float] = {}
        self.total: list[float] = []
        self.util: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _query(*args: str) -> list[list[str]]:
        try:
            out = subprocess.run(["nvidia-smi", *args, "--format=csv,noheader,nounits"], capture_output=True,
                                 text=True, timeout=10).stdout
        except (OSError, subprocess.TimeoutExpired):
            return []
        return [[c.strip() for c in line.split(",")] for line in out.splitlines() if line.strip()]

    def _run(self) -> None:
        while not self._stop.is_set():
            for pid, mib in self._query("--query-compute-apps=pid,used_memory"):
                if mib.replace(".", "", 1).isdigit():
                    self.per_pid[pid] = max(self.per_pid.get(pid, 0.0), float(mib))
            for util, used in self._query("--query-gpu=utilization.gpu,memory.used"):
                if util.isdigit() and used.replace(".", "", 1).isdigit():
                    self.util.append(float(util))
                    self.total.append(float(used))
            self._stop.wait(self.every)

    def __enter__(self) -> GpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=15)

    def fields(self) -> dict[str, Any]:
        return {"gpu_mib_per_trial_max": max(self.per_pid.values(), default=None),
                "gpu_processes": len(self.per_pid) or None,
                "gpu_mib_total_max": max(self.total, default=None),
                "gpu_util_mean": sum(self.util) / len(self.util) if self.util else None}


def max_concurrent(intervals: list[tuple[float, float]]) -> int:
    """The most intervals open at one instant (an end at the same instant as a start does not overlap it)."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals], key=lambda x: (x[0], x[1]))
    running = most = 0
    for _, step in events:
        running += step
        most = max(most, running)
    return most


def run_arm(name: str, space: dict[str, Any], gpus: str, work: Path, *, num_cpus: int | None,
            num_gpus: int | None) -> dict[str, Any]:
    """One search of ``space`` with ``gpus`` GPUs per trial; its throughput fields."""
    tag = f"{name}-g{gpus.replace('.', '')}"
    t0 = time.perf_counter()
    with GpuSampler() as smi:
        found = dptune.search(space, budget_epsilon=1000.0, ledger=work / f"{tag}.sqlite", runs_dir=work, name=tag,
                              seed=SEED, num_cpus=num_cpus, num_gpus=num_gpus, gpus_per_trial=gpus,
                              tune_anyway=True)
    wall = time.perf_counter() - t0
    rows = read_trials(found.run / "sealed" / "trials.parquet")
    intervals = [(float(r.started or 0.0), float(r.started or 0.0) + float(r.seconds or 0.0)) for r in rows]
    makespan = max(e for _, e in intervals) - min(s for s, _ in intervals)
    return {"space": name, "gpus_per_trial": float(gpus), "trials": len(rows),
            "devices": sorted({str(r.measured.get("device")) for r in rows}),
            "trial_seconds_mean": sum(e - s for s, e in intervals) / len(rows),
            "makespan_s": makespan, "search_wall_s": wall,
            "trials_per_gpu_hour": len(rows) / makespan * 3600, "search_trials_per_gpu_hour": len(rows) / wall * 3600,
            "max_concurrent": max_concurrent(intervals), "steps": rows[0].steps, **smi.fields()}


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def table(results: list[dict[str, Any]]) -> str:
    head = (f"{'space':<16} {'gpu/trial':>9} {'trials':>6} {'at once':>7} {'trial s':>8} {'makespan s':>10} "
            f"{'trials/GPU-h':>12} {'search s':>8} {'search trials/GPU-h':>19} {'MiB/trial':>9} {'MiB all':>8} "
            f"{'util %':>6}  devices")
    lines = [head]
    for r in results:
        lines.append(f"{r['space']:<16} {r['gpus_per_trial']:>9g} {r['trials']:>6} {r['max_concurrent']:>7} "
                     f"{r['trial_seconds_mean']:>8.1f} {r['makespan_s']:>10.1f} {r['trials_per_gpu_hour']:>12.0f} "
                     f"{r['search_wall_s']:>8.1f} {r['search_trials_per_gpu_hour']:>19.0f} "
                     f"{_fmt(r['gpu_mib_per_trial_max'], '.0f'):>9} {_fmt(r['gpu_mib_total_max'], '.0f'):>8} "
                     f"{_fmt(r['gpu_util_mean'], '.0f'):>6}  {','.join(r['devices'])}")
    for space in dict.fromkeys(r["space"] for r in results):
        arms = {r["gpus_per_trial"]: r for r in results if r["space"] == space}
        one = arms.get(1.0)
        for g, r in arms.items():
            if one is not None and g != 1.0:
                lines.append(f"{space}: packed {g:g}/one = {r['trials_per_gpu_hour'] / one['trials_per_gpu_hour']:.2f}x"
                             f" trials per GPU-hour over the trials, "
                             f"{r['search_trials_per_gpu_hour'] / one['search_trials_per_gpu_hour']:.2f}x over the "
                             "whole search")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spaces", nargs="+", default=["mnist", "cifar10_resnet9"], choices=["mnist", "cifar10_resnet9"])
    ap.add_argument("--mnist", type=Path, default=ROOT.parent / "shared" / "data" / "mnist-t10k",
                    help="folder with the MNIST t10k IDX files (.gz)")
    ap.add_argument("--gpus", nargs="+", default=["1", "0.25"], help="--gpus-per-trial of each arm")
    ap.add_argument("--mnist-trials", type=int, default=8)
    ap.add_argument("--mnist-epochs", type=float, default=2.0)
    ap.add_argument("--cifar-trials", type=int, default=4)
    ap.add_argument("--cifar-epochs", type=float, default=0.5)
    ap.add_argument("--cifar-per-batch", type=int, default=10000, help="images per training batch file (x5)")
    ap.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray (default: all)")
    ap.add_argument("--smoke", action="store_true", help="CPU: tiny data, 2 trials, Ray told of 1 (logical) GPU")
    ap.add_argument("--out", type=Path, required=True, help="JSON results")
    args = ap.parse_args(argv)
    if args.smoke:
        args.mnist_trials = args.cifar_trials = 2
        args.mnist_epochs, args.cifar_epochs, args.cifar_per_batch = 0.1, 1.0, 64
        args.num_cpus = args.num_cpus or 2
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results: list[dict[str, Any]] = []
    meta = {"smoke": args.smoke, "seed": SEED, "gpus": args.gpus, "argv": vars(args) | {"mnist": str(args.mnist),
                                                                                       "out": str(args.out)}}
    with tempfile.TemporaryDirectory(prefix="dptune-gpu-pack-") as tmp:
        work = Path(tmp)
        spaces: dict[str, dict[str, Any]] = {}
        if "mnist" in args.spaces:
            spaces["mnist"] = mnist_space(args.mnist, args.mnist_trials, args.mnist_epochs)
        if "cifar10_resnet9" in args.spaces:
            t0 = time.perf_counter()
            folder = write_synthetic_cifar(work / "cifar-10-batches-py", per_batch=args.cifar_per_batch,
                                           n_test=min(10000, args.cifar_per_batch))
            print(f"synthetic CIFAR-10 folder: 5 x {args.cifar_per_batch} images in {time.perf_counter() - t0:.1f} s",
                  flush=True)
            spaces["cifar10_resnet9"] = cifar_space(folder, args.cifar_per_batch, args.cifar_trials, args.cifar_epochs,
                                                    args.smoke)
        for name, space in spaces.items():
            for gpus in args.gpus:
                print(f"=== {name}, --gpus-per-trial {gpus} {time.strftime('%T')}", flush=True)
                results.append(run_arm(name, json.loads(json.dumps(space)), gpus, work, num_cpus=args.num_cpus,
                                       num_gpus=1 if args.smoke else None))
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps({**meta, "results": results}, indent=2))
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
