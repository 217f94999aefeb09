"""Ray Tune execution of a sealed draw (the only place that starts or joins Ray)."""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray import tune
from ray.tune import Callback

from dptune._search.draw import Draw
from dptune._search.sealed import RunDir
from dptune._search.trainable import dptune_trial
from dptune.config import ConfigError, SearchSpace

__all__ = ["RayOptions", "make_tuner", "run_trials", "start_ray"]

# Tune's default CSV/JSON/TensorBoard loggers hold per-trial metrics and cost time per trial; dptune
# writes its own sealed record. Trials keep the driver's working directory.
os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")
os.environ.setdefault("RAY_CHDIR_TO_TRIAL_DIR", "0")
os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")


@dataclass(frozen=True)
class RayOptions:
    address: str | None = None
    num_cpus: int | None = None
    cpus_per_trial: float = 1.0
    gpus_per_trial: str = "auto"
    dashboard_host: str = "127.0.0.1"
    dashboard_port: int | None = None
    max_failures: int = 3
    checkpoint_every: int = 0
    save_model: bool = False
    job_metadata: dict[str, str] = field(default_factory=dict)


def start_ray(opts: RayOptions) -> str | None:
    """Join ``opts.address`` or start a local Ray with its dashboard on ``opts.dashboard_host``.

    Returns the dashboard URL (None if unknown). Worker output is not forwarded to this terminal: it
    would carry per-trial details.
    """
    job_config = ray.job_config.JobConfig(metadata=opts.job_metadata)
    if opts.address:
        ctx = ray.init(address=opts.address, log_to_driver=False, job_config=job_config,
                       configure_logging=True, logging_level=logging.WARNING)
    else:
        kwargs: dict[str, Any] = {}
        if opts.dashboard_port is not None:
            kwargs["dashboard_port"] = opts.dashboard_port
        # address="local": always a new private instance, never a Ray someone else advertised on this machine
        ctx = ray.init(address="local", num_cpus=opts.num_cpus, include_dashboard=True, dashboard_host=opts.dashboard_host,
                       log_to_driver=False, job_config=job_config, logging_level=logging.WARNING, **kwargs)
    for name in ("ray.tune", "ray.train", "ray.air"):  # their warnings can count trials
        logging.getLogger(name).setLevel(logging.ERROR)
    url = getattr(ctx, "dashboard_url", None)
    if url and not str(url).startswith("http"):
        url = "http://" + str(url)
    return url


def _gpus(opts: RayOptions) -> float:
    have = float(ray.cluster_resources().get("GPU", 0.0))
    if opts.gpus_per_trial == "auto":
        return 1.0 if have >= 1 else 0.0
    try:
        g = float(opts.gpus_per_trial)
    except ValueError as e:
        raise ConfigError("--gpus-per-trial", f"{opts.gpus_per_trial!r} is not a number",
                          "give auto, 0, a fraction like 0.5, or a whole number") from e
    if g < 0:
        raise ConfigError("--gpus-per-trial", f"{g} is negative", "give auto, 0, or a positive number")
    if g > 0 and have == 0:
        raise ConfigError("--gpus-per-trial", f"{g:g} GPU(s) requested but the Ray cluster has none",
                          "use --gpus-per-trial 0 (CPU) or auto, or join a cluster with GPUs")
    return g


class _SealedLog(Callback):
    """Per-trial lines go to sealed/logs/trials.log; to the terminal only with --show-trials."""

    def __init__(self, path: Path, show: bool) -> None:
        self.path = path
        self.show = show
        self.recoveries: dict[int, int] = {}

    def on_trial_recover(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        index = int(trial.config.get("trial_index", -1))
        self.recoveries[index] = self.recoveries.get(index, 0) + 1
        self._write(f"trial {index} lost its worker (infrastructure); retried as the same trial")

    def _write(self, line: str) -> None:
        with open(self.path, "a") as f:
            f.write(line + "\n")
        if self.show:
            print(f"[curator] {line}", flush=True)

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        r = trial.last_result or {}
        self._write(f"trial {r.get('trial_index')} done: score={r.get('score')} diverged={r.get('diverged')} "
                    f"crashed={r.get('crashed')} params={r.get('params')} seconds={r.get('seconds')}")

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._write(f"trial {trial.config.get('trial_index')} failed after retries (infrastructure)")


class _Heartbeat:
    """Private-mode progress: elapsed time only (counts would reveal K)."""

    def __init__(self, every: float = 15.0) -> None:
        self.every = every
        self._stop = threading.Event()
        self._t0 = time.time()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            print(f"  search running … {time.time() - self._t0:5.0f} s elapsed (per-trial results are sealed)",
                  flush=True)

    def __enter__(self) -> _Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()


def make_tuner(trainable: Any, trials: int, storage: Path, callbacks: list[Callback], max_failures: int,
               search_alg: Any = None) -> tune.Tuner:
    """dptune's Tune settings: all trials in one fit, reused actors (no per-trial process start and
    torch/Opacus import), no per-trial logger files, quiet driver (bench/trial_overhead.py measures this)."""
    if search_alg is not None:
        param_space: dict[str, Any] = {}
        tune_config = tune.TuneConfig(num_samples=trials, search_alg=search_alg, reuse_actors=True)
    else:
        param_space = {"trial_index": tune.grid_search(list(range(trials)))}
        tune_config = tune.TuneConfig(num_samples=1, reuse_actors=True)
    run_config = tune.RunConfig(
        name="tune", storage_path=str(storage.resolve()), verbose=0, callbacks=callbacks,
        failure_config=tune.FailureConfig(max_failures=max_failures),
        checkpoint_config=tune.CheckpointConfig(num_to_keep=2),
    )
    return tune.Tuner(trainable, param_space=param_space, tune_config=tune_config, run_config=run_config)


def run_trials(space: SearchSpace, draw: Draw, data: Any, run: RunDir, opts: RayOptions,
               show_trials: bool = False, resume: bool = False,
               sampling_basis: float | None = None) -> list[dict[str, Any]]:
    """Run the draw's trials on Ray Tune; return one row per trial (sealed data)."""
    gpus = _gpus(opts)
    resources = {"cpu": opts.cpus_per_trial, "gpu": gpus}
    fixed = {k: v for k, v in space.fixed.to_public_dict().items() if k not in space.space}
    adaptive = space.searcher != "random"
    trainable = tune.with_resources(
        tune.with_parameters(dptune_trial, data=data, slots=draw.trials, fixed=fixed,
                             threads=max(1, int(opts.cpus_per_trial)), save_model=opts.save_model,
                             checkpoint_every=opts.checkpoint_every, adaptive_seed_base=draw.draw_seed,
                             sampling_basis=sampling_basis),
        resources)
    exp_dir = run.ray_dir / "tune"
    log = _SealedLog(run.sealed / "logs" / "trials.log", show_trials)
    callbacks: list[Callback] = [log]
    if resume and tune.Tuner.can_restore(str(exp_dir)):
        tuner = tune.Tuner.restore(str(exp_dir), trainable=trainable, resume_unfinished=True,
                                   resume_errored=True)
    else:
        search_alg = None
        if adaptive:
            from optuna.samplers import TPESampler
            from ray.tune.search.optuna import OptunaSearch

            search_alg = OptunaSearch(space=dict(space.space), metric="score", mode="max",
                                      sampler=TPESampler(seed=draw.draw_seed % (2**31)))  # seed the sampler
        tuner = make_tuner(trainable, draw.k, run.ray_dir, callbacks, opts.max_failures, search_alg)
    with _Heartbeat():
        grid = tuner.fit()
    rows = []
    for i in range(len(grid)):
        res = grid[i]
        m = dict(res.metrics or {})
        index = m.get("trial_index", res.config.get("trial_index", i) if res.config else i)
        if index == -1:
            index = i
        if res.error is not None or not m.get("final"):
            # retries exhausted on infrastructure failures: the trial still counts, with score −∞
            m = {"score": -math.inf, "crashed": True, "diverged": False,
                 "error": f"infrastructure: {str(res.error)[:300]}", "params": m.get("params", res.config)}
        slot_seed = draw.trials[index]["seed"] if not adaptive and index < len(draw.trials) else m.get("seed")
        rows.append({
            "index": int(index), "params": m.get("params", {}), "seed": slot_seed, "score": m.get("score"),
            "val_accuracy_raw": m.get("val_accuracy_raw"), "diverged": bool(m.get("diverged", False)),
            "crashed": bool(m.get("crashed", False)), "error": m.get("error", ""), "steps": m.get("steps"),
            "sampling_rate": m.get("sampling_rate"), "noise_multiplier": m.get("noise_multiplier"),
            "seconds": m.get("seconds"), "started": m.get("started"), "node": m.get("node_id", ""),
            "attempts": max(int(m.get("attempts", 1)), 1 + log.recoveries.get(int(index), 0)),
            "checkpoint": res.checkpoint.path if res.checkpoint is not None and m.get("final") else None,
        })
    rows.sort(key=lambda r: r["index"])
    return rows


def shutdown() -> None:
    if ray.is_initialized():
        ray.shutdown()
