"""Per-trial overhead of dptune's Ray Tune path vs plain Ray Tune, side by side in one run.

Both run the same trivial function trainable (it only reports a number), on one local Ray instance:
- plain: Tune defaults (a new actor process per trial, default CSV/JSON/TensorBoard loggers);
- dptune: `dptune.tuning.runner.make_tuner` (reused actors, no per-trial logger files, data shipped once
  with `tune.with_parameters`).
Overhead per trial = (wall(N_big) − wall(N_small)) / (N_big − N_small); the fixed cost per fit is the rest.
Then one real dptune digits trial (1 epoch) measured the same way shows what a real search pays.

    .venv/bin/python bench/trial_overhead.py [--small 2] [--big 10] [--cpus 2]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


_COMPUTE: list[float] = []


def trivial(config: dict[str, Any], data: Any = None) -> None:
    from ray import tune

    tune.report({"score": float(config.get("trial_index", 0)), "final": True})


def _plain(n: int, storage: Path) -> float:
    from ray import tune

    t0 = time.perf_counter()
    tuner = tune.Tuner(tune.with_resources(trivial, {"cpu": 1}),
                       param_space={"trial_index": tune.grid_search(list(range(n)))},
                       tune_config=tune.TuneConfig(reuse_actors=False),
                       run_config=tune.RunConfig(storage_path=str(storage), name=f"plain{n}", verbose=0))
    tuner.fit()
    return time.perf_counter() - t0


def _dptune(n: int, storage: Path, trainable: Any = None, seconds: list[float] | None = None) -> float:
    from ray import tune

    from dptune.tuning.runner import make_tuner

    payload = trainable or tune.with_resources(tune.with_parameters(trivial, data=list(range(1000))), {"cpu": 1})
    t0 = time.perf_counter()
    grid = make_tuner(payload, n, storage / f"dptune{n}-{time.time_ns()}", [], max_failures=0).fit()
    wall = time.perf_counter() - t0
    if seconds is not None:
        seconds.extend(float(grid[i].metrics.get("seconds", 0.0)) for i in range(len(grid)))
    return wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", type=int, default=2)
    ap.add_argument("--big", type=int, default=20)
    ap.add_argument("--cpus", type=int, default=2)
    ap.add_argument("--no-real", action="store_true", help="skip the real digits trials")
    args = ap.parse_args()
    os.environ.setdefault("HOME", tempfile.mkdtemp())
    import ray

    from dptune.tuning import runner  # sets dptune's Tune environment (loggers off) for the dptune path

    ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)
    storage = Path(tempfile.mkdtemp(prefix="dptune-bench-"))
    rows = []
    try:
        # plain first with the default loggers switched back on (the environment flag is process-wide)
        os.environ["TUNE_DISABLE_AUTO_CALLBACK_LOGGERS"] = "0"
        plain = {n: _plain(n, storage) for n in (args.small, args.big)}
        os.environ["TUNE_DISABLE_AUTO_CALLBACK_LOGGERS"] = "1"
        ours = {n: _dptune(n, storage) for n in (args.small, args.big)}
        for name, wall in (("plain Ray Tune", plain), ("dptune", ours)):
            per = (wall[args.big] - wall[args.small]) / (args.big - args.small)
            rows.append((name, per, wall[args.small] - args.small * per))
        if not args.no_real:
            rows.append(_real_trials(args, storage))
    finally:
        ray.shutdown()
    print(f"\ntrivial trainable, {args.small} vs {args.big} trials, {args.cpus} CPUs, 1 CPU per trial")
    print(f"{'path':<34}{'s per extra trial':>18}{'fixed s per fit':>17}")
    for name, per, fixed in rows:
        print(f"{name:<34}{per:>18.3f}{fixed:>17.2f}")
    floor = 0.01  # below the resolution of this measurement
    print(f"ratio plain / dptune per-trial overhead: {'>= ' if rows[1][1] < floor else ''}"
          f"{rows[0][1] / max(rows[1][1], floor):.0f}x")
    if len(rows) > 2:
        print(f"real trials: {rows[2][1]:.3f} s per extra trial of which training compute "
              f"{_COMPUTE[0]:.3f} s / {args.cpus} parallel = {_COMPUTE[0] / args.cpus:.3f} s; "
              f"overhead ≈ {rows[2][1] - _COMPUTE[0] / args.cpus:.3f} s per trial")
    del runner


def _real_trials(args: argparse.Namespace, storage: Path) -> tuple[str, float, float]:
    """dptune_trial on digits, 1 epoch: per extra trial = overhead + ~compute (reported separately)."""
    from ray import tune

    from dptune.config import DatasetSpec, TrialConfig
    from dptune.data import load_dataset
    from dptune.tuning.trainable import dptune_trial

    data = load_dataset(DatasetSpec())
    fixed = TrialConfig(epochs=1, score_noise=None).to_public_dict()

    seconds: list[float] = []

    def wall(n: int) -> float:
        slots = [{"index": i, "params": {}, "seed": i} for i in range(n)]
        t = tune.with_resources(tune.with_parameters(dptune_trial, data=data, slots=slots, fixed=fixed), {"cpu": 1})
        return _dptune(n, storage, t, seconds)

    w_small, w_big = wall(args.small), wall(args.big)
    _COMPUTE.append(sum(seconds) / max(len(seconds), 1))
    per = (w_big - w_small) / (args.big - args.small)
    return ("dptune, real digits trial (1 ep)", per, w_small - args.small * per)


if __name__ == "__main__":
    main()
