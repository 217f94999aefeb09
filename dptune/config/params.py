"""The privacy parameters of one DP-SGD run: the one definition of q and T.

The trainer runs exactly these numbers and the accountant charges exactly these numbers; both import this
module (and nothing else computes q or T), so they cannot drift. ``basis`` is the *data-independent* size
the rate is defined on: the training split's size n, or f·n when a search tunes on a Poisson subsample of
fraction f (Koskela & Kulkarni 2023) — never the realised, data-dependent subsample size.
"""

from __future__ import annotations

import math

from dptune.errors import ConfigError, check_positive

__all__ = ["asha_rungs", "rung_steps", "sampling_rate", "trial_steps"]


def sampling_rate(*, batch_size: int, basis: float) -> float:
    """Poisson sampling rate q = B / basis of one DP-SGD step (expected batch size B)."""
    if not basis >= 1:
        raise ConfigError("dataset", f"the training split has {basis:g} examples", "use a non-empty dataset")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or not 1 <= batch_size <= basis:
        raise ConfigError(
            "batch_size",
            f"{batch_size!r} is outside 1..{basis:g} (the training split has {basis:g} examples)",
            f"choose a batch size between 1 and {int(basis)}",
        )
    return batch_size / basis


def trial_steps(*, epochs: float, batch_size: int, basis: float) -> int:
    """Number of DP-SGD steps T = ⌈epochs · basis / B⌉ = ⌈epochs / q⌉ (at least 1)."""
    check_positive("epochs", epochs, "choose epochs > 0")
    sampling_rate(batch_size=batch_size, basis=basis)
    return max(1, math.ceil(epochs * basis / batch_size - 1e-9))



def asha_rungs(*, epochs: float, grace_period: int, reduction_factor: int) -> tuple[int, ...]:
    """ASHA's milestones in epochs (Li et al., MLSys 2020; Ray Tune's ``ASHAScheduler`` with one bracket): grace·η^k
    below the trial's epochs, then its last epoch. A trial releases one noised score at each (its rung scores)."""
    rungs: list[int] = []
    r = int(grace_period)
    while r < epochs:
        rungs.append(r)
        r *= int(reduction_factor)
    return (*rungs, int(math.ceil(epochs)))


def rung_steps(*, epochs: float, batch_size: int, basis: float, rungs: tuple[int, ...]) -> tuple[int, ...]:
    """The DP-SGD steps a trial has run when it reaches each rung: each epoch runs ⌈basis / B⌉ steps, and the trial
    T in all (the trainer's loop); the last rung's is T."""
    per_epoch = max(1, math.ceil(basis / batch_size))
    total = trial_steps(epochs=epochs, batch_size=batch_size, basis=basis)
    return tuple(min(total, r * per_epoch) for r in rungs)
