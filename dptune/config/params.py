"""The privacy parameters of one DP-SGD run: the one definition of q and T.

The trainer runs exactly these numbers and the accountant charges exactly these numbers; both import this
module (and nothing else computes q or T), so they cannot drift. ``basis`` is the *data-independent* size
the rate is defined on: the training split's size n, or f·n when a search tunes on a Poisson subsample of
fraction f (Koskela & Kulkarni 2023) — never the realised, data-dependent subsample size.
"""

from __future__ import annotations

import math

from dptune.errors import ConfigError, check_positive

__all__ = ["sampling_rate", "trial_steps"]


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

