"""What Ray and Tune print during a search, and where it goes: Ray's and Tune's log records, the error lines
Ray's driver prints for the cluster and what its C++ core worker writes to file descriptor 2 go to the sealed
``logs/ray.log``; per-trial lines to ``logs/trials.log`` (the terminal only with ``--show-trials``); a retried
trial is said once, in fixed words that name neither the trial nor the error."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ray.tune import Callback

__all__ = ["LOST_WORKER", "TRIAL_FAILED", "TRIAL_RAISED", "SealedLog", "recovery_line", "sealed_ray_logs"]


LOST_WORKER = "  a worker was lost; the trial was retried as the same trial (details in sealed/logs only)"
TRIAL_RAISED = ("  a trial raised an error that is not a result of the data (the model factory, an import, memory); "
                "Ray retries it as the same trial (the error: sealed/logs/trials.log, curator only)")
TRIAL_FAILED = "  a trial failed (infrastructure); it was retried as the same trial (details in sealed/logs only)"


def recovery_line(error: BaseException | None) -> str:
    """The one fixed line said when Ray retries a trial: a lost worker process or node (an actor that died, a
    crashed worker, a dead node), or an error the trial raised (a RayTaskError whose cause is not a lost actor, an
    actor whose creation raised). Never the error's text: that stays in sealed/logs."""
    from ray import exceptions as rex

    if error is None:  # Tune recorded none that can be read back
        return TRIAL_FAILED
    if isinstance(error, rex.RayTaskError):
        error = error.cause if isinstance(error.cause, BaseException) else None
    if isinstance(error, rex.RayActorError) and not error.actor_init_failed:
        return LOST_WORKER
    if isinstance(error, rex.WorkerCrashedError | rex.NodeDiedError | rex.ObjectLostError):
        return LOST_WORKER
    return TRIAL_RAISED


class _BestEffortHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A sealed log that cannot be written (a full disk) drops the record without a word: logging's default
    prints a ``--- Logging error ---`` traceback to stderr, with the record (a trial's name) in it."""

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        pass


@contextmanager
def sealed_ray_logs(path: Path) -> Iterator[None]:
    """Ray's and Tune's log records, and the error messages Ray's driver prints for the cluster (a raylet's
    death banner, "a worker died"), go to a sealed file, not the terminal: Tune's ERROR lines name trials
    and count them, one banner per lost worker counts the trials running at a node's death."""
    import ray._private.worker as ray_worker

    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    stream = os.fdopen(fd, "a")
    handler = _BestEffortHandler(stream)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    names = ["ray", *(n for n in logging.root.manager.loggerDict if n.startswith("ray."))]
    loggers = [logging.getLogger(n) for n in names]
    loggers = [lg for lg in loggers if lg.name == "ray" or lg.handlers]
    saved = [(lg, lg.handlers[:], lg.propagate) for lg in loggers]
    for lg in loggers:
        lg.handlers = [handler]
        lg.propagate = False
    printer = ray_worker.print_to_stdstream  # Ray's error-message thread calls it by this module name

    def to_sealed(data: dict[str, Any], ignore_prefix: bool = False) -> None:
        try:
            stream.write("".join(f"({data.get('pid', 'ray')}) {line}\n" for line in data.get("lines", [])))
            stream.flush()
        except (OSError, ValueError):
            pass

    ray_worker.print_to_stdstream = to_sealed
    try:
        with _fd2_sealed(fd):
            yield
    finally:
        ray_worker.print_to_stdstream = printer
        for lg, handlers, propagate in saved:
            lg.handlers = handlers
            lg.propagate = propagate
        handler.close()
        with contextlib.suppress(OSError):  # a full disk: what is left unwritten is dropped, without a word
            stream.close()  # a StreamHandler leaves its stream open: one file per search in a notebook's process


@contextmanager
def _fd2_sealed(sealed_fd: int) -> Iterator[None]:
    """File descriptor 2 into the sealed log: Ray's C++ core worker writes its ERROR lines there itself (a killed
    head raylet: "Attempting to recover N lost objects", N the driver's objects pinned on it), past Python's
    logging. Python's ``sys.stderr``, when it wrote to descriptor 2, keeps writing to the terminal (dptune's own
    lines); a notebook's ``sys.stderr`` is not descriptor 2 and stays as it is."""
    with contextlib.suppress(AttributeError, OSError, ValueError):
        sys.stderr.flush()
    terminal = os.dup(2)
    before = sys.stderr
    try:
        on_fd2 = before.fileno() == 2
    except (AttributeError, OSError, ValueError):
        on_fd2 = False
    os.dup2(sealed_fd, 2)
    if on_fd2:
        sys.stderr = os.fdopen(os.dup(terminal), "w", buffering=1, errors="backslashreplace")
    try:
        yield
    finally:
        if on_fd2:
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.close()
            sys.stderr = before
        os.dup2(terminal, 2)
        os.close(terminal)


def _last_error(trial: Any) -> BaseException | None:
    """The error Tune just recorded for ``trial`` (its pickle in the trial's sealed folder, written by this
    process a moment ago), or None when there is none to read."""
    from ray import cloudpickle

    path = getattr(trial, "pickled_error_file", None)
    try:
        with open(path, "rb") as f:  # type: ignore[arg-type]
            error = cloudpickle.load(f)
    except Exception:  # no file (an error Tune could not pickle), or a class this process cannot import
        return None
    return error if isinstance(error, BaseException) else None


class SealedLog(Callback):
    """Per-trial lines go to sealed/logs/trials.log; to the terminal only with --show-trials. A lost worker
    is said once, in a fixed line (one line per loss would count the trials running at a node's death).
    ``groups``: with grouped trials, each Ray trial's members (the lines name the members, never the group)."""

    def __init__(self, path: Path, show: bool, groups: list[list[int]] | None = None) -> None:
        self.path = path
        self.show = show
        self.groups = groups
        self.recoveries: dict[int, int] = {}
        self.said: set[str] = set()  # each fixed line once (one per loss would count the trials running)

    def _write(self, line: str) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(fd, "a") as f:
            f.write(line + "\n")
        if self.show:
            print(f"[curator] {line}", flush=True)

    def _members(self, trial: Any) -> list[int]:
        if self.groups is not None and "group" in trial.config:
            return list(self.groups[int(trial.config["group"])])
        return [int(trial.config.get("trial_index", -1))]

    def on_trial_recover(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        line = recovery_line(_last_error(trial))
        what = {LOST_WORKER: "lost its worker", TRIAL_RAISED: "raised an error"}.get(line, "failed")
        for index in self._members(trial):
            self.recoveries[index] = self.recoveries.get(index, 0) + 1
            self._write(f"trial {index} {what} (infrastructure); retried as the same trial")
        if line not in self.said:
            self.said.add(line)
            print(line, flush=True)

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        for r in (trial.last_result or {}).get("trials") or [trial.last_result or {}]:
            self._write(f"trial {r.get('trial_index')} done: score={r.get('score')} diverged={r.get('diverged')} "
                        f"crashed={r.get('crashed')} params={r.get('params')} seconds={r.get('seconds')}")

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        error = ""
        if getattr(trial, "error_file", None) and os.path.exists(trial.error_file):
            error = Path(trial.error_file).read_text(errors="replace")[-4000:]
        self._write(f"trial {', '.join(map(str, self._members(trial)))} failed after retries (infrastructure):\n{error}")
