"""What a group of trials runs (``group_probe``): a diagnostic of ``_group``'s shared computation and its guard, for
``bench/gpu_group.py`` and anyone asking why a group does or does not share its calls."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dptune.config import TrialConfig
from dptune.data import Splits
from dptune.dpsgd._group import _Lanes, call_sizes, default_lanes, group_guard, synthetic_chunk
from dptune.dpsgd._loop import Chunk
from dptune.dpsgd._trial import prepare

__all__ = ["group_probe"]


def group_probe(configs: Sequence[TrialConfig], data: Splits, *, device: str | None = None,
                lanes_per_call: int | None = None, sizes: Sequence[int] | None = None) -> dict[str, Any]:
    """What a group of ``configs`` runs on ``device`` (a diagnostic: ``bench/gpu_group.py``): ``lanes_per_call``
    (``run_group``'s default when None), which trials share their calls (``eligible``, ``shared`` when any;
    ``refused``: the guard's first reason for any that does not: ``group_guard``, as ``run_group`` decides) and,
    at each padded chunk size (``sizes``, default: every size the trials train with), on synthetic inputs with
    the trials' own models, the max |Δ| of a lane's per-example gradients between a call of every trial and a call
    of that trial alone (``count``: why calls have a fixed width), with the lanes rolled by one (``position``) and
    with another lane's examples changed (``company``). 0 is bitwise; the table stops where the group's
    computation raises (a group the guard refuses)."""
    dev = torch.device(device or "cpu")
    per_call = lanes_per_call if lanes_per_call is not None else default_lanes(dev)
    trials = [prepare(c, data, dev) for c in configs]
    eligible, refused = group_guard(trials, data, per_call)
    models = [t.run.model for t in trials]
    views = trials[0].sched.views
    lanes = _Lanes(models[0])
    gen = torch.Generator().manual_seed(7)
    g = len(models)

    def chunk(n: int) -> Chunk:
        return synthetic_chunk(gen, models[0], n, views, tuple(data.input_shape), data.num_classes)

    def diff(a: list[torch.Tensor], i: int, b: list[torch.Tensor], j: int) -> float:
        return max(float((ga[i] - gb[j]).abs().max()) for ga, gb in zip(a, b, strict=True))

    rows: list[dict[str, float]] = []
    try:
        for n in sizes if sizes is not None else call_sizes(trials):
            chunks = [chunk(n) for _ in models]
            together, _ = lanes.gradients(models, chunks)
            rolled, _ = lanes.gradients(models[1:] + models[:1], chunks[1:] + chunks[:1])
            moved, _ = lanes.gradients(models, [chunk(n), *chunks[1:]])
            rows.append({"rows": n,
                         "count": max(diff(together, i, lanes.gradients([models[i]], [chunks[i]])[0], 0)
                                      for i in range(g)),
                         "position": max(diff(together, i, rolled, (i - 1) % g) for i in range(g)),
                         "company": max((diff(together, i, moved, i) for i in range(1, g)), default=0.0)})
    except Exception:
        if refused is None:  # the guard ran this computation: a raise here is the probe's own bug
            raise
    return {"lanes_per_call": per_call, "shared": bool(eligible), "eligible": sorted(eligible), "refused": refused,
            "sizes": rows}
