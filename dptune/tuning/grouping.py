"""Which of a sealed draw's trials train together (``--group-trials``): a function of the public space, the sealed
draw and the resources only, decided in the driver, never printed (the number and sizes of groups would bound K).

Trials group when their configs share an architecture (``dpsgd.architecture_key``: model, groups, model kwargs,
augmentation, clipping, physical batch size); each group is one Ray trial that trains its members as one computation
(``dpsgd.run_group``), each member exactly as if it ran alone. The members of one architecture are spread over as
many groups as Ray can run at once (``slots``), longest first onto the least loaded group (a public cost: T steps ×
physical chunks per step), so grouping never leaves a CPU idle that one-at-a-time trials would have used.

On an accelerator, under ``clipping: auto``, a grouped trial runs whole-model vmap (``functorch``, the group's
engine: vmapped calls over the members' chunks, each ``dpsgd._group.ACCELERATOR_LANES`` wide) where the clipping
guard proves it exact for the model (``group_clipping``), the mode ``auto`` falls back to anyway; the sensitivity
(C per example) and so the charge are the same. On a CPU a group runs each member's own engine (``run_group``'s
``lanes_per_call`` 1: one call over several trials measured slower there), so ``auto`` stays what the trial alone
runs (book-keeping for the shipped CNNs, 1.3-1.6x faster than functorch on CPU: ``dptune.dpsgd.AUTO_CLIPPING``)
and a member equals its trial alone bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from dptune.config import ConfigError, TrialConfig
from dptune.config.params import trial_steps

__all__ = ["group_clipping", "plan_groups"]


def plan_groups(configs: Sequence[TrialConfig], slots: int, basis: float) -> list[list[int]]:
    """The draw's trial indices (positions in ``configs``, each config as its trial runs) in groups: one
    architecture per group, each architecture over at most ``slots`` groups balanced by public cost."""
    from dptune.dpsgd import architecture_key

    by_key: dict[Any, list[int]] = {}
    for i, c in enumerate(configs):
        by_key.setdefault(architecture_key(c), []).append(i)
    groups: list[list[int]] = []
    for members in by_key.values():
        parts: list[list[int]] = [[] for _ in range(min(max(slots, 1), len(members)))]
        load = [0.0] * len(parts)
        for i in sorted(members, key=lambda i: (-_cost(configs[i], basis), i)):
            j = min(range(len(parts)), key=lambda j: (load[j], j))
            parts[j].append(i)
            load[j] += _cost(configs[i], basis)
        groups.extend(sorted(p) for p in parts)
    return groups


def _cost(config: TrialConfig, basis: float) -> float:
    chunks = max(1, math.ceil(config.batch_size / max(config.physical_batch_size // max(config.augmult, 1), 1)))
    return float(trial_steps(epochs=config.epochs, batch_size=config.batch_size, basis=basis) * chunks)


def group_clipping(config: TrialConfig, guarded: Callable[[TrialConfig], Any], device: str) -> TrialConfig:
    """``config`` as a grouped trial runs it on ``device``: on an accelerator ``auto`` becomes ``functorch`` when
    ``guarded`` (the clipping guard for a config: ``dpsgd.guarded_clipping`` with the data's public shape) proves it
    exact; otherwise, and on a CPU, unchanged (each member then runs its own engine, as it would alone)."""
    if config.clipping != "auto" or device == "cpu":
        return config
    vmapped = config.replace(clipping="functorch")
    try:
        guarded(vmapped)
    except ConfigError:
        return config
    return vmapped
