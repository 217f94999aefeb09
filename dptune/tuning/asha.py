"""ASHA on Ray Tune under an RDP filter: the filter actor, the trial, and Tune's own scheduler.

* :class:`SealedFilter` (as the Ray actor :data:`FilterActor`) holds the search's RDP filter (``dptune.accounting.RdpFilter``; docs/accountant.md, "ASHA
  under an RDP filter") in the driver's Ray session. A trial asks it to admit each rung segment before running it;
  an admission is written to ``sealed/filter.json`` (0600, atomically) before the answer, so a resumed search
  continues the same filter: a segment admitted before is not charged twice, and none runs without admission.
  The ledger holds the filter's whole bound, reserved before any trial touches data.
* ``trainable.dptune_asha_trial`` is the Ray trainable: one configuration of the sealed draw, trained rung by rung
  (``dpsgd.run_rungs``), its noised score reported at each rung. Tune's ``ASHAScheduler`` (:func:`scheduler`) reads
  only that noised score and stops the trials that lag; a trial the filter refuses at its first segment touched no
  data and leaves no row (``not_run``).

What leaves the driver is what the release shows; which trials ran, their rungs and the number promoted stay in
sealed/ like every trial's row (Tune's own experiment state is in sealed/ray)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import ray

__all__ = ["FilterActor", "SealedFilter", "scheduler", "start_filter"]


class SealedFilter:
    """The search's RDP filter, persisted in ``path`` (module docstring): created with its bound, or read back with
    every admission it made (a resumed search), refused if the bound is not this search's."""

    def __init__(self, path: str | Path, budget: list[float]) -> None:
        import numpy as np

        from dptune.accounting import RdpFilter

        self.path = Path(path)
        if self.path.exists():  # a resumed search: the same filter, every admission it made
            self.filter = RdpFilter.from_json(json.loads(self.path.read_text()))
            if [float(b) for b in self.filter.budget] != [float(b) for b in budget]:
                raise ValueError("the sealed filter's bound is not this search's charge")
        else:
            self.filter = RdpFilter(np.asarray(budget, dtype=np.float64))
            self._save()

    def admit(self, key: str, cost: list[float]) -> bool:
        import numpy as np

        known = key in self.filter.admitted
        ok = self.filter.admit(key, np.asarray(cost, dtype=np.float64))
        if ok and not known:
            self._save()  # before the trial hears yes: no segment runs unrecorded
        return ok

    def _save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(self.filter.to_json(), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)


FilterActor = ray.remote(num_cpus=0)(SealedFilter)  # one per search, in the driver's Ray session


def start_filter(path: Path, budget: list[float]) -> Any:
    """The filter actor for a search whose state lives at ``path`` (sealed/), created or resumed."""
    return FilterActor.remote(str(path), budget)  # type: ignore[attr-defined]


def scheduler(space: Any) -> Any:
    """Ray Tune's own ASHAScheduler on dptune's noised rung score: milestones grace·η^k below the trial's epochs
    (the rungs of ``space.rungs``), one bracket."""
    from ray.tune.schedulers import ASHAScheduler

    return ASHAScheduler(time_attr="epoch", metric="score", mode="max", max_t=int(space.fixed.epochs),
                         grace_period=space.grace_period, reduction_factor=space.reduction_factor, brackets=1)
