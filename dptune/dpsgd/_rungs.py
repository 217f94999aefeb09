"""One trial of an ASHA search: trained rung segment by rung segment, each admitted first, a noised score at each rung.

A rung segment is the trial's DP-SGD steps from one rung (an epoch of ``rungs``) to the next and the validation
score released there, through the trial's own ``ScoreRelease`` (Gaussian noise on the correct-count, from the
trial's score stream; the scheduler sees nothing else). ``admit(k)`` asks the search's RDP filter for segment
``k`` before any of its steps runs; a refused segment never runs and the trial ends with what it released.
``report(k, result)`` hands the rung's result to the scheduler (Ray Tune: it may stop the trial there). The trainer
has no Ray in it: both are the caller's.

A retried trial (an infrastructure failure) resumes from its checkpoint, which is saved at the end of each epoch
before the rung's score is drawn: its score stream is restored with it, so the rung's score is drawn again with
the same noise on the same model (the same release), and its segments are the same keys for the filter."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from dptune.config import TrialConfig
from dptune.data import Splits
from dptune.dpsgd._trial import PreparedTrial, TrialResult, prepare

__all__ = ["FilterRefused", "run_rungs"]


class FilterRefused(Exception):
    """The filter did not admit the trial's next segment: it ends with what it has released."""


def run_rungs(config: TrialConfig, data: Splits, rungs: tuple[int, ...], *, admit: Callable[[int], bool],
              report: Callable[[int, TrialResult], None], checkpoint_path: Path | None = None,
              device: str | None = None, sampling_basis: float | None = None,
              charged_points: Iterable[Any] | None = None) -> TrialResult | None:
    """Train ``config`` to its last rung, segment by segment (module docstring). Returns the last rung's result, or
    None when the filter refused the first segment (nothing of the data was touched). The trial's epochs must be
    ``rungs[-1]``."""
    if int(config.epochs) != rungs[-1]:
        raise ValueError(f"the trial's epochs ({config.epochs}) are not its last rung ({rungs[-1]})")
    t0 = time.perf_counter()
    dev = torch.device(device or "cpu")
    last: list[TrialResult] = []

    def at_rung(prepared: PreparedTrial, epoch: int) -> None:
        k = rungs.index(epoch)
        result = _rung_result(prepared, data, t0)
        last[:] = [result]
        report(k, result)
        if k + 1 < len(rungs) and not admit(k + 1):
            raise FilterRefused

    prepared = prepare(config, data, dev, sampling_basis=sampling_basis, charged_points=charged_points,
                       checkpoint_path=checkpoint_path)

    def on_epoch(epoch: int, metrics: dict[str, Any]) -> None:  # after the epoch's checkpoint
        if epoch in rungs:
            at_rung(prepared, epoch)

    prepared.on_epoch = on_epoch
    done = prepared.run.state.epochs_done
    first = next((k for k, r in enumerate(rungs) if r > done), len(rungs))
    try:
        if done in rungs:  # resumed at a rung: its release again (the same draw), and the next admission
            at_rung(prepared, done)
        elif not admit(first):
            return None
        chunks = prepared.chunks(data, t0)
        engine = prepared.run.engine
        try:
            chunk = next(chunks)
            while True:
                chunk = chunks.send(engine.backward(chunk.x, chunk.y, chunk.views, chunk.n_real))
        except StopIteration:
            pass
    except FilterRefused:
        pass
    if prepared.run.state.diverged and prepared.run.state.epochs_done not in rungs:  # between rungs: it counts, −∞
        k = max((i for i, r in enumerate(rungs) if r <= prepared.run.state.epochs_done), default=0)
        last[:] = [_rung_result(prepared, data, t0)]
        report(k, last[0])
    return last[0] if last else None


def _rung_result(prepared: PreparedTrial, data: Splits, t0: float) -> TrialResult:
    """The trial's result at this rung: its noised validation score (a release, charged in the segment) and what the
    trainer measured so far."""
    result = prepared.finish(data, evaluate_test=False, return_model=False, t0=t0)
    return replace(result, epochs_done=prepared.run.state.epochs_done)
