"""A search that stops after its charge was reserved (interrupted, or failed for any reason): what is sealed,
what the curator is told. Every step is best-effort — the failure may be the disk or the ledger itself —
and none may hide the original failure or the charge's state."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dptune.errors import ConfigError
from dptune.ledger import Charge, Ledger, LedgerLocation
from dptune.rundir import RunDir
from dptune.trials import TrialRow, write_trials

__all__ = ["SearchStopped", "Watcher", "charge_status", "is_interrupt", "safely", "stopped", "watch_for_sudden_death"]


class SearchStopped(Exception):
    """A search stopped after its charge was reserved, interrupted or failed: nothing is released and the
    charge stays reserved (it counts against the budget) until ``--resume`` finishes the same draw.

    ``cause`` says what happened without private values; ``charge`` where the charge stands (read back from
    the ledger when it can be); ``rows`` the trials that finished (sealed); ``resume`` the exact call or command
    that continues it, when the caller knows it (:meth:`resumed_by`)."""

    def __init__(self, *, interrupted: bool, cause: str, charge: str, run: Path, ledger: Path | LedgerLocation,
                 rows: list[TrialRow], resume: str | None = None) -> None:
        self.interrupted = interrupted
        self.cause = cause
        self.charge = charge
        self.run = run
        self.ledger = ledger
        self.rows = rows
        self.resume = resume
        super().__init__(self._message())

    def _message(self) -> str:
        what = "was interrupted" if self.interrupted else f"stopped: {self.cause}"
        how = self.resume or (f"the same call (or command) with name={self.run.name!r} and resume=True (--resume)")
        return (f"search {self.run.name!r} {what}. Nothing was released; {self.charge}; the finished trials are "
                f"sealed in {self.run / 'sealed'}. Continue with: {how}")

    def resumed_by(self, call: str) -> SearchStopped:
        """This stop, its message naming ``call`` (the exact call or command that continues the search)."""
        out = SearchStopped(interrupted=self.interrupted, cause=self.cause, charge=self.charge, run=self.run,
                            ledger=self.ledger, rows=self.rows, resume=call)
        out.__traceback__ = self.__traceback__
        return out


def is_interrupt(e: BaseException) -> bool:
    from dptune.tuning.runner import InfrastructureFailure, SearchInterrupted

    return isinstance(e, KeyboardInterrupt) or (isinstance(e, SearchInterrupted)
                                                and not isinstance(e, InfrastructureFailure))


def safely(step: Callable[[], Any]) -> bool:
    """One step of failure handling: it may fail too (a full disk, a read-only folder) and must not hide
    the original failure or the charge's state."""
    try:
        step()
        return True
    except Exception:
        return False


def charge_status(ledger_path: LedgerLocation, charge_id: int) -> str:
    """The charge's status read back from the ledger (read-only if its folder cannot be written)."""
    for read_only in (False, True):
        try:
            return Ledger(ledger_path, read_only=read_only).charge(charge_id).status
        except Exception:
            continue
    return "reserved (as far as dptune knows: the ledger could not be read back)"


def stopped(ledger_path: LedgerLocation, run: RunDir, charge: Charge, e: BaseException, interrupted: bool) -> SearchStopped:
    """Seal what finished, log the traceback (sealed: it can name a trial's config), and say where the
    charge stands — each step best-effort: the failure may be the disk or the ledger itself."""
    import traceback

    from dptune.tuning.runner import SearchFailed, SearchInterrupted

    rows = list(e.rows) if isinstance(e, SearchInterrupted) else []
    if isinstance(e, SearchInterrupted):
        safely(lambda: write_trials(run.trials_file, rows))
    safely(lambda: run.write_state(status="interrupted" if interrupted else "failed"))
    if not interrupted and not isinstance(e, SearchInterrupted | SearchFailed | ConfigError):
        log = run.sealed / "logs" / "driver.log"

        def write_log() -> None:
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            with os.fdopen(fd, "a") as f:
                f.write(traceback.format_exc())

        where = f"the traceback is in {log} (curator only)" if safely(write_log) else \
            "its traceback could not be written to sealed/logs either"
        cause = f"{type(e).__name__} after the charge was reserved ({where})"
    elif isinstance(e, ConfigError | SearchFailed | SearchInterrupted) and not interrupted:
        cause = str(e)
    else:
        cause = "interrupted"
    status = charge_status(ledger_path, charge.id)
    if status.startswith("reserved"):
        what = (f"the charge of epsilon = {charge.epsilon:.4f} in {ledger_path} stays {status} (it counts against "
                "the budget)")
        if not interrupted:  # a release is valid only once its charge is committed: none may be left half-written
            def unrelease() -> None:
                for f in run.release.iterdir():
                    f.unlink()

            safely(unrelease)
    elif status == "committed":  # the release was complete before the failure (e.g. writing the final state)
        what = f"the charge in {ledger_path} is committed and {run.release} is complete"
    else:
        what = f"the charge in {ledger_path} is {status}"
    return SearchStopped(interrupted=interrupted, cause=cause, charge=what, run=run.root, ledger=ledger_path,
                         rows=rows)


def watch_for_sudden_death(run: RunDir, ledger_path: LedgerLocation, epsilon: float, resume_command: str) -> Watcher:
    """Fork a watcher that outlives this process: when Ray's head raylet dies, Ray's driver exits at once
    (status 1, no Python handler runs), as after a SIGKILL of the driver alone. If the search then had not
    ended in a known state, the watcher says where the charge stands and how to resume, and marks the run
    failed. Forked before Ray starts (no Ray threads or sockets in the child); it only reads files.
    Returns the :class:`Watcher` to tell when the search ends in a known state (the watcher then exits without a
    word, whatever the state file says: a full disk may have kept it at "running")."""
    read_end, write_end = os.pipe()
    if os.fork() != 0:
        os.close(read_end)  # the write end stays open in this process until it ends, however it ends
        return Watcher(write_end)
    try:
        os.close(write_end)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the search's to handle, not ours
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        told = b""
        while chunk := os.read(read_end, 1):
            told += chunk
        state = json.loads(run.state_file.read_text()) if run.state_file.exists() else {}
        if _ENDED not in told and state.get("status") in ("reserved", "running"):
            status = charge_status(ledger_path, int(state["charge_id"]))
            safely(lambda: run.write_state(status="failed"))
            print(f"error: the search process ended without finishing (Ray's head raylet died, or the process was "
                  f"killed). Nothing was released; the charge of epsilon = {epsilon:.4f} in {ledger_path} stays "
                  f"{status} (it counts against the budget). Continue with: {resume_command}", file=sys.stderr,
                  flush=True)
    except BaseException:
        pass
    finally:
        os._exit(0)


_ENDED = b"e"


class Watcher:
    """The search's end of the pipe to the watcher of :func:`watch_for_sudden_death`."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def ended(self) -> None:
        """The search ended in a known state (released, or stopped with its failure said): the watcher exits
        without a word, even where the state file could not record it."""
        with contextlib.suppress(OSError):
            os.write(self.fd, _ENDED)
        with contextlib.suppress(OSError):
            os.close(self.fd)
