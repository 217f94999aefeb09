"""Ray Tune execution of a sealed draw (with ``raysession``, the only place that imports Ray).

An interrupted run (SIGINT, or SIGTERM from a cluster scheduler) never releases: Tune stops gracefully and
saves its experiment state, :class:`SearchInterrupted` carries the trials that finished (they are sealed),
and ``--resume`` runs the rest of the same draw. Releasing the best of the trials that happened to finish
would cap K, which random stopping forbids (rule 1).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import threading
import time
import traceback
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import ray
from ray import tune
from ray.tune import Callback, ProgressReporter

from dptune.config import SearchSpace
from dptune.config.searchers import searcher
from dptune.rundir import RunDir
from dptune.trials import TrialRow
from dptune.tuning import asha
from dptune.tuning.draw import Draw
from dptune.tuning.options import RayOptions, gpus_per_trial
from dptune.tuning.raylog import SealedLog, sealed_ray_logs
from dptune.tuning.search_alg import search_alg
from dptune.tuning.trainable import dptune_asha_trial, dptune_group, dptune_trial

__all__ = ["InfrastructureFailure", "SearchFailed", "SearchInterrupted", "make_tuner", "progress", "run_trials",
           "sealed_ray_logs"]

# Tune's default CSV/JSON/TensorBoard loggers hold per-trial metrics and cost time per trial; dptune
# writes its own sealed record. Trials keep the driver's working directory. Mid-trial checkpoint reports
# carry no score: Tune must not insist on the searcher's metric in them.
os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")
os.environ.setdefault("RAY_CHDIR_TO_TRIAL_DIR", "0")
os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # a search forces it while Tune runs (_legacy_output)
os.environ.setdefault("TUNE_DISABLE_STRICT_METRIC_CHECKING", "1")


class _NoProgress(ProgressReporter):
    """Tune's progress reporter in a dptune search: it reports nothing (per-trial lines go to sealed/logs). Without
    one, Tune picks its own even at verbose=0 — in a Jupyter kernel a JupyterNotebookReporter, whose construction
    clears the cell's output (IPython's clear_output), erasing dptune's header and the dashboard line."""

    def should_report(self, trials: list, done: bool = False) -> bool:
        return False

    def report(self, trials: list, done: bool, *sys_info: str) -> None:
        pass


@contextmanager
def _legacy_output() -> Iterator[None]:
    """Tune's old output engine while it runs, whatever the environment says: with RAY_AIR_NEW_OUTPUT=1 (its
    default outside notebooks) Tune ignores the reporter above and prints a table with the number of trials —
    K — even at verbose=0. Restored after, for the rest of the user's process."""
    saved = os.environ.get("RAY_AIR_NEW_OUTPUT")
    os.environ["RAY_AIR_NEW_OUTPUT"] = "0"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("RAY_AIR_NEW_OUTPUT", None)
        else:
            os.environ["RAY_AIR_NEW_OUTPUT"] = saved


class SearchInterrupted(Exception):
    """The run was interrupted: ``rows`` finished (sealed), the rest runs on ``--resume``."""

    def __init__(self, rows: list[TrialRow]) -> None:
        super().__init__("interrupted (Ctrl-C or SIGTERM) before every trial finished")
        self.rows = rows


class InfrastructureFailure(SearchInterrupted):
    """Some trial failed for a reason that does not depend on the data (an import, the model factory, out
    of memory, a lost node) even after Ray's retries: not a result. The search stops like an interrupt:
    ``rows`` finished (sealed), nothing is released, the charge stays reserved, ``--resume`` reruns the rest
    after the fix. Says neither which trial nor how many (that would bound K)."""

    def __init__(self, rows: list[TrialRow], log: Path) -> None:
        super().__init__(rows)
        self.args = (f"a trial failed for a reason that is not a result of the data (an import, the model "
                     f"factory, memory, a lost node); its error is in {log} (curator only)",)


class SearchFailed(Exception):
    """Ray Tune itself failed; the traceback (which may name trial configs) is in sealed/logs only."""


def _gpus(opts: RayOptions) -> float:
    return gpus_per_trial(opts.gpus_per_trial, float(ray.cluster_resources().get("GPU", 0.0)))


def _trial_name(trial: Any) -> str:
    """Tune names trials (and their directories) ``<trainable>_<experiment>_<index>``: Ray's log lines would
    carry the trial's index in the sealed draw, a lower bound on K. A random name carries nothing."""
    return f"trial_{secrets.token_hex(6)}"


def progress(show_trials: bool, every: float = 15.0) -> Any:
    """What the terminal shows while trials run. By default one line and nothing after it: an elapsed time
    (or a line every few seconds) gives the search's duration, and so roughly K, to whoever sees the output
    (a shared notebook, a CI log). With ``--show-trials`` (curator only) a heartbeat with the elapsed time."""
    if show_trials:
        return _Heartbeat(every)
    print("  search running … (no progress or elapsed time is shown: the duration would tell the number of "
          "trials; --show-trials shows it on a curator-only terminal)", flush=True)
    return contextlib.nullcontext()


class _Heartbeat:
    """Curator-only progress (``--show-trials``): the elapsed time."""

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


def make_tuner(trainable: Any, trials: int, storage: Path | str, callbacks: list[Callback], max_failures: int,
               search_alg: Any = None, scheduler: Any = None, name: str = "tune", key: str = "trial_index"
               ) -> tune.Tuner:
    """dptune's Tune settings: all trials in one fit, reused actors (no per-trial process start and
    torch/Opacus import), no per-trial logger files, quiet driver (bench/trial_overhead.py measures this).
    ``key``: what the grid runs over (``trial_index``, or ``group`` for grouped trials)."""
    if search_alg is not None:
        param_space: dict[str, Any] = {}
        tune_config = tune.TuneConfig(num_samples=trials, search_alg=search_alg, scheduler=scheduler,
                                      reuse_actors=True, trial_name_creator=_trial_name,
                                      trial_dirname_creator=_trial_name)
    else:
        param_space = {key: tune.grid_search(list(range(trials)))}
        tune_config = tune.TuneConfig(num_samples=1, scheduler=scheduler, reuse_actors=True,
                                      trial_name_creator=_trial_name, trial_dirname_creator=_trial_name)
    run_config = tune.RunConfig(
        name=name, storage_path=storage if isinstance(storage, str) else str(storage.resolve()), verbose=0,
        callbacks=callbacks, progress_reporter=_NoProgress(),
        failure_config=tune.FailureConfig(max_failures=max_failures),
        checkpoint_config=tune.CheckpointConfig(num_to_keep=2),
    )
    return tune.Tuner(trainable, param_space=param_space, tune_config=tune_config, run_config=run_config)


@contextmanager
def _sigterm_as_sigint() -> Iterator[None]:
    """A cluster scheduler's SIGTERM stops the search like Ctrl-C: gracefully, state saved, no release."""
    previous = signal.signal(signal.SIGTERM, lambda *_: os.kill(os.getpid(), signal.SIGINT))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _tuner(space: SearchSpace, draw: Draw, run: RunDir, trainable: Any, log: SealedLog, opts: RayOptions,
           resume: bool, groups: list[list[int]] | None = None, sched: Any = None) -> tune.Tuner:
    storage: Path | str = opts.storage_path or run.ray_dir.resolve()  # never a relative path (ArrowInvalid)
    name = str(run.read_state().get("tune_experiment", "tune"))
    exp_dir = f"{str(storage).rstrip('/')}/{name}" if isinstance(storage, str) else str(storage / name)
    if resume:
        try:
            if tune.Tuner.can_restore(exp_dir):  # unpickles: only the experiment this search wrote
                return tune.Tuner.restore(exp_dir, trainable=trainable, resume_unfinished=True, resume_errored=True)
        except Exception:  # half-written state (a full disk, a kill mid-save): EOFError, bad JSON, …
            _log_traceback(run)
            # the sealed draw fixes every trial (index, config, seed): a fresh experiment runs the same trials,
            # so the charge reserved for them can still be released; the broken state stays aside, sealed
            name = f"tune-{secrets.token_hex(4)}"
            run.write_state(tune_experiment=name)
            print("  Ray Tune's saved state could not be read: the search continues from its sealed draw (the same "
                  "trials and seeds, no new charge; details in sealed/logs/driver.log)", flush=True)
    if groups is not None:  # one Ray trial per group of the draw's trials (a fixed draw: no search algorithm)
        return make_tuner(trainable, len(groups), storage, [log], opts.max_failures, name=name, key="group")
    alg = search_alg(space, draw)  # seeded from the draw's own sampler stream
    return make_tuner(trainable, draw.k, storage, [log], opts.max_failures, alg, sched, name=name)


def _log_traceback(run: RunDir) -> str:
    """The current traceback into sealed/logs/driver.log (it can name a trial's config); where it went, in
    words. Never raises: the failure being logged may be the disk itself."""
    driver_log = run.sealed / "logs" / "driver.log"
    try:
        driver_log.parent.mkdir(exist_ok=True)
        fd = os.open(driver_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(fd, "a") as f:
            f.write(traceback.format_exc())
        return f"the traceback is in {driver_log} (curator only)"
    except OSError:
        return "its traceback could not be written to sealed/logs either"


def run_trials(space: SearchSpace, draw: Draw, data: Any, run: RunDir, opts: RayOptions, *,
               show_trials: bool = False, resume: bool = False, sampling_basis: float | None = None,
               charged_points: Sequence[Any] = (), transfer: Any = None,
               filter_budget: Sequence[float] | None = None) -> list[TrialRow]:
    """Run the draw's trials on Ray Tune; one sealed row per trial (``transfer``: each trial runs its final-run
    config at the planned cheap σ_c, lr scaled). Raises :class:`SearchInterrupted` (some trials did not
    finish) or :class:`SearchFailed` (Tune itself failed)."""
    resources = {"cpu": opts.cpus_per_trial, "gpu": _gpus(opts)}
    fixed = {k: v for k, v in space.fixed.to_public_dict().items() if k not in space.space}
    adaptive = searcher(space.searcher).adaptive
    state = run.read_state() if resume else {}
    decided = "groups" in state  # written before Tune saves anything
    groups = _stored_groups(state["groups"], opts) if decided else None
    if not decided:  # Tune's saved trials are groups or single trials: a resume must run the same layout
        if opts.group_trials and not adaptive and not opts.save_model and space.scheduler == "fifo":
            basis = sampling_basis if sampling_basis is not None else float(len(data.train[1]))
            groups = _groups(draw, fixed, transfer, basis, _slots(resources))
        run.write_state(groups=groups)
    common = dict(data=data, slots=draw.trials, fixed=fixed, threads=max(1, int(opts.cpus_per_trial)),
                  checkpoint_every=opts.checkpoint_every, sampling_basis=sampling_basis,
                  charged_points=list(charged_points), transfer=transfer)
    sched = None
    if space.scheduler != "fifo":  # rung by rung: ASHA (Tune's scheduler, each segment admitted) or own_curve
        actor = None
        if space.scheduler == "asha":
            assert filter_budget is not None, "an ASHA search runs under its charged filter"
            actor = asha.start_filter(run.sealed / "filter.json", [float(b) for b in filter_budget])
            sched = asha.scheduler(space)
        trainable = tune.with_resources(tune.with_parameters(
            dptune_asha_trial, data=data, slots=draw.trials, fixed=fixed, rungs=space.rungs, filter_actor=actor,
            threads=common["threads"], charged_points=common["charged_points"]), resources)
    elif groups is not None:
        trainable = tune.with_resources(tune.with_parameters(dptune_group, groups=groups, **common), resources)
    else:
        trainable = tune.with_resources(
            tune.with_parameters(dptune_trial, save_model=opts.save_model,
                                 adaptive_seed_base=draw.stream_seed("searcher"), **common), resources)
    log = SealedLog(run.sealed / "logs" / "trials.log", show_trials, groups)
    try:
        with progress(show_trials), _sigterm_as_sigint(), _legacy_output():
            grid = _tuner(space, draw, run, trainable, log, opts, resume, groups, sched).fit()
    except Exception as e:  # a traceback can carry a running trial's config: sealed/logs only
        where = _log_traceback(run)
        raise SearchFailed(f"Ray Tune failed ({type(e).__name__}); {where}") from None
    rows, unfinished, errors = _rows(grid, draw, log, adaptive=adaptive,
                                     checkpoints=run.sealed / "checkpoints" if opts.save_model else None,
                                     groups=groups)
    rows.sort(key=lambda r: r.index)
    if any("ChargeMismatch" in e for e in errors):  # refused before touching data: a dptune bug
        raise SearchFailed("a trial's (q, T, σ, score noise) lay outside the charged points; it refused to run "
                           "and nothing is released (see sealed/logs/trials.log)")
    if errors:
        raise InfrastructureFailure(rows, log.path)
    if unfinished:
        raise SearchInterrupted(rows)
    return rows


def _stored_groups(stored: list[list[int]] | None, opts: RayOptions) -> list[list[int]] | None:
    """The grouping the search's first session chose (``stored``, from the sealed state; None: one trial at a
    time). A resume runs that layout whatever ``--group-trials`` and the resources say now: Tune's saved trials
    are its groups (a different split of the draw would train a member twice or never), and the results are the
    same either way."""
    groups = None if stored is None else [[int(i) for i in g] for g in stored]
    if (groups is not None) != opts.group_trials:
        print(f"  this search started {'with' if groups is not None else 'without'} --group-trials and resumes "
              "that way (its saved trials are laid out so; the results are the same)", flush=True)
    return groups


def _slots(resources: dict[str, float]) -> int:
    """How many trials Ray can run at once on the cluster (public: the curator's resources)."""
    have = ray.cluster_resources()
    slots = int(float(have.get("CPU", 1.0)) // max(resources["cpu"], 1e-9))
    if resources["gpu"] > 0:
        slots = min(slots, int(float(have.get("GPU", 0.0)) // resources["gpu"]))
    return max(slots, 1)


def _groups(draw: Draw, fixed: dict[str, Any], transfer: Any, basis: float, slots: int) -> list[list[int]]:
    """The draw's trials in groups (``tuning.grouping``), from the public space, the sealed draw and the resources."""
    from dptune.config import TrialConfig
    from dptune.tuning.grouping import plan_groups

    configs = []
    for slot in draw.trials:
        cfg = TrialConfig.from_dict({**fixed, **slot["params"]})
        configs.append(transfer.trial_config(cfg) if transfer is not None else cfg)
    return plan_groups(configs, slots, basis)


def _rows(grid: Any, draw: Draw, log: SealedLog, adaptive: bool, checkpoints: Path | None,
          groups: list[list[int]] | None = None) -> tuple[list[TrialRow], int, list[str]]:
    """(finished rows, trials not finished, errors of trials that failed for infrastructure reasons)."""
    rows: list[TrialRow] = []
    unfinished = skipped = 0
    errors: list[str] = []
    for i in range(len(grid)):
        res = grid[i]
        m = dict(res.metrics or {})
        if groups is not None:  # one Ray trial per group: each member's own row, or every member unfinished
            members = groups[int((res.config or {}).get("group", i))]
            if res.error is not None:
                errors.append(str(res.error))
            if res.error is not None or not m.get("final"):
                unfinished += len(members)
                continue
            for row in m.get("trials", []):
                index = int(row["trial_index"])
                rows.append(TrialRow.from_metrics(index, draw.trials[index]["seed"], row,
                                                  1 + log.recoveries.get(index, 0)))
            continue
        index = m.get("trial_index", (res.config or {}).get("trial_index", i))
        index = i if index == -1 else int(index)
        seed = str(m.get("seed", "0")) if adaptive else draw.trials[index]["seed"]
        if res.error is not None:  # retries exhausted: infrastructure, not a result (reruns on --resume)
            errors.append(str(res.error))
            unfinished += 1
        elif m.get("not_run"):  # ASHA: the filter refused its first segment; it touched no data: no row
            skipped += 1
        elif not m.get("final"):
            unfinished += 1  # stopped by an interrupt before its final report
        else:
            ckpt = None
            if checkpoints is not None and res.checkpoint is not None:  # from any storage (local, NFS, s3://)
                ckpt = res.checkpoint.to_directory(str(checkpoints / str(index)))
            rows.append(TrialRow.from_metrics(index, seed, m, 1 + log.recoveries.get(index, 0), ckpt))
    if len(rows) + unfinished + skipped < draw.k:
        unfinished += draw.k - len(rows) - unfinished - skipped  # never started
    return rows, unfinished, errors
