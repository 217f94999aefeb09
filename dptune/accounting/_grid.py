"""The charge grid: every charged ε and calibrated σ is rounded *up* to a fixed decimal grid before anyone sees it.

Why: the accounting's floats are the same on every x86-64 CPU (``_strictmath``), but another FFT or C-library build
(arm64, another SciPy) may move a PLD's ε in its tenth digit (measured: ≤ 1.6e-9 with NumPy's FFT in place of
SciPy's, issue 58). A charge, a certificate's ε and the σ in a charged event's hash must not depend on that.

The grid: ε to :data:`EPSILON_DIGITS` significant digits, σ to :data:`SIGMA_DIGITS`, both towards +∞, in exact
decimal arithmetic (the result is the double nearest the grid point at or above the input). Rounding ε up charges
at least the true bound; rounding σ up adds noise, and the privacy cost does not increase in σ, so a σ that met its
target still meets it. Two builds agree unless their values straddle a grid line: with a relative difference d the
chance is about d·10^(digits − 1) per value (≈ 2e-4 for ε at the measured 1.6e-9 on ε ≈ 5); on one build, and on every
x86-64 CPU, they are identical. Rounding is idempotent: a value on the grid stays where it is.

Guarantee: :func:`round_up` returns the smallest double ``g`` with ``g >= x`` that is the nearest double of a
decimal with ``digits`` significant digits; inf and NaN pass through; 0 and negatives are rounded toward +∞ too.
"""

from __future__ import annotations

import math
from decimal import ROUND_CEILING, Decimal

__all__ = ["EPSILON_DIGITS", "SIGMA_DIGITS", "round_up", "round_up_epsilon", "round_up_sigma"]

EPSILON_DIGITS = 6  # ε ≈ 5 → steps of 1e-5: at most 2e-6 of the charge added
SIGMA_DIGITS = 5  # σ ≈ 1 → steps of 1e-4: at most 1e-4 of σ added (the calibration's own tolerance is 2e-3)


def round_up(x: float, digits: int) -> float:
    """``x`` rounded towards +∞ to ``digits`` significant decimal digits (see the module's guarantee)."""
    if not math.isfinite(x) or x == 0.0:
        return float(x)
    exact = Decimal(x)  # the double's exact value
    quantum = Decimal(1).scaleb(exact.adjusted() - digits + 1)
    up = exact.quantize(quantum, rounding=ROUND_CEILING)
    below = up - quantum
    # the grid point under ``up`` may be the one x came from (x is its double, rounded up): idempotence
    return float(below) if float(below) >= x else float(up)


def round_up_epsilon(epsilon: float) -> float:
    """A charged ε on the grid (:data:`EPSILON_DIGITS`)."""
    return round_up(epsilon, EPSILON_DIGITS)


def round_up_sigma(sigma: float) -> float:
    """A calibrated noise multiplier on the grid (:data:`SIGMA_DIGITS`)."""
    return round_up(sigma, SIGMA_DIGITS)
