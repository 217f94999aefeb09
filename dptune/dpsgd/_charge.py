"""A trial refuses to run what was not charged.

The accountant charges the worst case over the reachable trials (``dptune.accounting.TrialPoint``: σ, q, T,
score noise). A trial is covered by a charged point p when p is at least as costly in every coordinate:
σ_p <= σ, q_p >= q, T_p >= T, and for the score release either both are None (public validation, nothing
released privately) or both are set with p's noise <= the trial's. The RDP of a Poisson-subsampled Gaussian
grows as σ falls, as q grows and linearly in T, and the Gaussian score release's as its noise falls, so p's
event dominates the trial's order by order. The points are duck-typed: this module must not import
``dptune.accounting`` (layer rules).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["ChargeMismatch", "check_charged"]

_REL = 1e-12  # float slack for values computed by the same formula on both sides


class ChargeMismatch(RuntimeError):
    """A trial's privacy parameters are not covered by any charged point: it must not start."""


def _covers(p: Any, sigma: float, q: float, steps: int, score_noise: float | None) -> bool:
    if (p.score_noise is None) != (score_noise is None):
        return False
    if p.score_noise is not None and not p.score_noise <= score_noise * (1 + _REL):  # type: ignore[operator]
        return False
    return (p.noise_multiplier <= sigma * (1 + _REL) and p.sampling_rate >= q * (1 - _REL)
            and int(p.steps) >= steps)


def check_charged(points: Iterable[Any], *, noise_multiplier: float, sampling_rate: float, steps: int,
                  score_noise: float | None) -> None:
    """Raise :class:`ChargeMismatch` unless some charged point covers (σ, q, T, score noise)."""
    points = list(points)
    if any(_covers(p, noise_multiplier, sampling_rate, steps, score_noise) for p in points):
        return
    charged = "; ".join(f"(σ {p.noise_multiplier:g}, q {p.sampling_rate:g}, T {p.steps}, score noise "
                        f"{p.score_noise})" for p in points[:5]) or "none"
    more = f" and {len(points) - 5} more" if len(points) > 5 else ""
    raise ChargeMismatch(
        f"refusing to start a trial with σ {noise_multiplier:g}, q {sampling_rate:g}, T {steps}, score noise "
        f"{score_noise}: no charged point covers it (needs σ_p <= σ, q_p >= q, T_p >= T, score noise_p <= the "
        f"trial's, both or neither None). Charged: {charged}{more}. The search space, the data size or q's "
        "basis differs from what the planner charged: re-plan and charge this search.")
