"""A CIFAR-shaped search end to end on one card, grouped trials against one trial per card (issue 61 goal 3;
``bench/gpu_check.sh search``).

    python bench/gpu_search.py --logs $OUT --out $OUT/gpu_search.json              # on a GPU machine
    python bench/gpu_search.py --smoke --logs /tmp/gs --out /tmp/gs/gpu_search.json  # CPU: tiny data, 1 epoch

The ResNet-9 space ``search_spaces/cifar10_resnet9.yaml`` on a synthetic folder in the real CIFAR-10 format
(``harness.synthetic.write_synthetic_cifar``: ``--per-batch`` images in each of the 5 training batches; 10,000 is
CIFAR-10's 50,000; random images, so the accuracies mean nothing and the time per trial is CIFAR-10's), searched
twice through the command a user runs, ``python -m dptune.search`` (a local Ray on loopback, ``--num-cpus``), with
one fixed seed and ``--trials N`` (composed accounting: both arms run the same N trials, configs and seeds):

- **grouped**: ``--group-trials --gpus-per-trial 1``: the trials of one architecture train as one computation;
- **one per card**: ``--gpus-per-trial 1``: one trial at a time on the card.

Each arm's output is ``<logs>/search_cifar_<arm>.log``; the grouped one's ``next:`` line is the final training
command that ``gpu_check.sh`` runs after this script (the space carries ``privacy.target_epsilon``, so the printed
command is complete). Per arm: trials (rows of the run's ``sealed/trials.parquet``), the search's wall time (Ray's
start, the data and the plan included), trials per GPU-hour over it (one GPU: wall time x 1), the trials' makespan
and devices. Without CUDA (``torch.cuda.is_available()`` false) no GPU is asked of Ray: ``--gpus-per-trial 0`` and
``--cpus-per-trial`` = ``--num-cpus`` (the whole machine is the "card": one trial or group at a time), and the
numbers are per machine-hour of CPU. NOT PRIVATE (fixed seed): a throughput bench. Results: a table on stdout,
every field in ``--out`` (JSON, rewritten after each arm). Data, runs and ledgers stay in ``--work`` (default: a
new folder under ``runs/``), which the printed final command reads.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import yaml
from harness.synthetic import synthetic_cifar_space, write_synthetic_cifar

from dptune.trials import read_trials

ROOT = Path(__file__).resolve().parents[1]
SEED = 61  # NOT PRIVATE: the same draw (trials, configs, seeds) in both arms
ARMS = {"grouped": ["--group-trials"], "one_per_card": []}


def write_space(folder: Path, per_batch: int, smoke: bool, target_epsilon: float, path: Path) -> Path:
    """``search_spaces/cifar10_resnet9.yaml`` on the synthetic ``folder``, written to ``path``."""
    space = synthetic_cifar_space(folder, per_batch, smoke)
    space["name"] = "cifar10_resnet9_synthetic"
    space["privacy"]["target_epsilon"] = target_epsilon  # search + final: the printed `next:` is complete
    path.write_text(yaml.safe_dump(space, sort_keys=False))
    return path


def search_command(arm: str, space: Path, work: Path, args: argparse.Namespace, cuda: bool) -> list[str]:
    """``python -m dptune.search`` as a user types it, for ``arm``."""
    gpus, cpus = ("1", "1") if cuda else ("0", str(args.num_cpus))
    return [sys.executable, "-m", "dptune.search", "--space", str(space), "--name", f"gpu-search-{arm}",
            "--runs-dir", str(work), "--ledger", str(work / f"{arm}.sqlite"), "--budget-epsilon", "1000",
            "--trials", str(args.trials), "--epochs", f"{args.epochs:g}", "--seed", str(SEED), "--tune-anyway",
            "--num-cpus", str(args.num_cpus), "--cpus-per-trial", cpus, "--gpus-per-trial", gpus, *ARMS[arm]]


def run_logged(cmd: list[str], log: Path, grace: float = 20.0) -> int:
    """``cmd`` with its output in ``log``, in a session of its own (so that the stage's ``timeout``, which signals
    its whole process group, does not kill the search's Ray under it); its exit status. Stopped here (SIGTERM,
    which ``main`` raises as SystemExit, or Ctrl-C), the search gets SIGTERM, which stops it like Ctrl-C (Ray shut
    down, nothing released); after ``grace`` seconds its whole session is killed: no search outlives the stage."""
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            return proc.wait()
        except BaseException:
            proc.terminate()
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
            raise


def _stop(*_: object) -> None:
    """SIGTERM (the stage's ``timeout``): once, as SystemExit; ``timeout`` sends it to us twice (to its command and
    to the group), and a second one must not cut ``run_logged``'s wait short."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.exit(124)


def run_arm(arm: str, space: Path, work: Path, args: argparse.Namespace, cuda: bool) -> dict[str, Any]:
    """One search through the CLI; its throughput fields (raises if it failed: its log says why)."""
    cmd = search_command(arm, space, work, args, cuda)
    log = args.logs / f"search_cifar_{arm}.log"
    print("+ " + " ".join(cmd[1:]), flush=True)
    t0 = time.perf_counter()
    rc = run_logged(cmd, log)
    wall = time.perf_counter() - t0
    text = log.read_text().splitlines()
    start = next((i for i, ln in enumerate(text) if ln.startswith("released")), max(0, len(text) - 8))
    print("\n".join(ln.rstrip() for ln in text[start:start + 10]), flush=True)
    if rc != 0:
        raise RuntimeError(f"{arm}: dptune.search exited {rc}; see {log}")
    rows = read_trials(work / f"gpu-search-{arm}" / "sealed" / "trials.parquet")
    starts = [float(r.started or 0.0) for r in rows]
    ends = [s + float(r.seconds or 0.0) for s, r in zip(starts, rows)]
    return {"arm": arm, "group_trials": arm == "grouped", "gpus_per_trial": 1.0 if cuda else 0.0,
            "trials": len(rows), "architectures": len({json.dumps(r.params.get("groups")) for r in rows}),
            "devices": sorted({str(r.measured.get("device")) for r in rows}),
            "trial_seconds_mean": sum(float(r.seconds or 0.0) for r in rows) / len(rows),
            "makespan_s": max(ends) - min(starts), "search_wall_s": wall,
            "trials_per_gpu_hour": len(rows) / wall * 3600,
            "makespan_trials_per_gpu_hour": len(rows) / (max(ends) - min(starts)) * 3600,
            "steps": rows[0].steps, "log": str(log), "command": " ".join(cmd[1:])}


def table(results: list[dict[str, Any]], cuda: bool) -> str:
    unit = "GPU-h" if cuda else "CPU-machine-h"
    lines = [f"{'arm':<13} {'trials':>6} {'archs':>5} {'trial s':>8} {'makespan s':>10} {'search s':>8} "
             f"{'trials/' + unit:>19} {'(over makespan)':>15}  devices"]
    for r in results:
        lines.append(f"{r['arm']:<13} {r['trials']:>6} {r['architectures']:>5} {r['trial_seconds_mean']:>8.1f} "
                     f"{r['makespan_s']:>10.1f} {r['search_wall_s']:>8.1f} {r['trials_per_gpu_hour']:>19.0f} "
                     f"{r['makespan_trials_per_gpu_hour']:>15.0f}  {','.join(r['devices'])}")
    arms = {r["arm"]: r for r in results}
    if {"grouped", "one_per_card"} <= set(arms):
        g, one = arms["grouped"], arms["one_per_card"]
        lines.append(f"grouped/one per card = {g['trials_per_gpu_hour'] / one['trials_per_gpu_hour']:.2f}x trials "
                     f"per {unit} over the whole search, "
                     f"{g['makespan_trials_per_gpu_hour'] / one['makespan_trials_per_gpu_hour']:.2f}x over the trials")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--trials", type=int, default=6, help="--trials of each search (composed: exactly N)")
    ap.add_argument("--epochs", type=float, default=0.15, help="--epochs of each trial (and of the final run)")
    ap.add_argument("--per-batch", type=int, default=10000, help="images per training batch file (x5)")
    ap.add_argument("--target-epsilon", type=float, default=8.0, help="the space's total for search + final")
    ap.add_argument("--num-cpus", type=int, default=4, help="CPUs of the local Ray")
    ap.add_argument("--work", type=Path, default=None,
                    help="data, runs and ledgers (default: a new folder under runs/, kept for the final run)")
    ap.add_argument("--logs", type=Path, required=True, help="each search's output: search_cifar_<arm>.log")
    ap.add_argument("--smoke", action="store_true", help="CPU-sized: 2 trials of 1 epoch on 5 x 64 images")
    ap.add_argument("--out", type=Path, required=True, help="JSON results")
    args = ap.parse_args(argv)
    if args.smoke:
        args.trials, args.epochs, args.per_batch, args.num_cpus = 2, 1.0, 64, 2
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _stop)  # `timeout`: stop the running search (run_logged)
    cuda = torch.cuda.is_available()
    (ROOT / "runs").mkdir(exist_ok=True)
    work = (args.work or Path(tempfile.mkdtemp(prefix="gpu-search-", dir=ROOT / "runs"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    args.logs.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    folder = write_synthetic_cifar(work / "cifar-10-batches-py", per_batch=args.per_batch,
                                   n_test=min(10000, args.per_batch))
    print(f"synthetic CIFAR-10 folder: 5 x {args.per_batch} images in {time.perf_counter() - t0:.1f} s; "
          f"{'cuda: ' + torch.cuda.get_device_name(0) if cuda else 'no CUDA: trials on the CPU'}; work {work}",
          flush=True)
    space = write_space(folder, args.per_batch, args.smoke, args.target_epsilon, work / "space.yaml")
    meta = {"smoke": args.smoke, "seed": SEED, "cuda": cuda, "work": str(work),
            "argv": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    results: list[dict[str, Any]] = []
    for arm in args.arms:
        print(f"=== {arm} {time.strftime('%T')}", flush=True)
        results.append(run_arm(arm, space, work, args, cuda))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({**meta, "results": results}, indent=2))
    print(table(results, cuda))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
