"""The Opacus 1.6 optimizers as dptune runs them: every noise addition measured.

Measurement: Opacus' ``add_noise`` sets ``p.grad = p.summed_grad + N(0, (σ·C)²)`` for every parameter, and
only then ``scale_grad`` divides by the expected batch size. Right after ``add_noise``, ``p.grad −
p.summed_grad`` is therefore exactly the noise of this step on the *summed* clipped gradient, std σ·C per
coordinate — measured from the tensors, not copied from the config. Costs one subtraction and one
squared-norm per parameter per logical step, accumulated on the device (no synchronisation).
"""

from __future__ import annotations

from typing import Any, cast

import torch
from opacus.optimizers import DPOptimizer, DPOptimizerFastGradientClipping

__all__ = ["ClippingDPOptimizer", "NoiseMeter", "SummedDPOptimizer"]


class NoiseMeter:
    """Sums over the noise additions of a trial: how many, how many coordinates, Σ noise²."""

    def __init__(self) -> None:
        self.additions = 0
        self.coordinates = 0
        self.sum_sq: torch.Tensor | None = None  # on the device, float64

    def record(self, params: list[torch.Tensor]) -> None:
        with torch.no_grad():
            grads = [cast(torch.Tensor, p.grad) for p in params]
            summed = [p.summed_grad.view_as(p) for p in params]  # type: ignore[attr-defined]
            noise = torch._foreach_sub(grads, summed)
            sq = torch.stack(torch._foreach_norm(noise)).double().square().sum()
        self.sum_sq = sq if self.sum_sq is None else self.sum_sq + sq
        self.additions += 1
        self.coordinates += sum(p.numel() for p in params)

    def std(self) -> float | None:
        """Empirical std of all noise added (σ·C expected); None before the first addition."""
        if self.sum_sq is None or self.coordinates == 0:
            return None
        return float((self.sum_sq / self.coordinates).sqrt())

    def state(self) -> dict[str, Any]:
        return {"additions": self.additions, "coordinates": self.coordinates,
                "sum_sq": None if self.sum_sq is None else self.sum_sq.cpu()}

    def load_state(self, state: dict[str, Any], device: torch.device) -> None:
        self.additions, self.coordinates = int(state["additions"]), int(state["coordinates"])
        self.sum_sq = None if state["sum_sq"] is None else state["sum_sq"].to(device)


class ClippingDPOptimizer(DPOptimizer):
    """DPOptimizer for per-sample gradients (hooks, functorch): noise measured."""

    meter: NoiseMeter | None = None

    def add_noise(self) -> None:
        super().add_noise()
        if self.meter is not None:
            self.meter.record(self.params)


class SummedDPOptimizer(DPOptimizerFastGradientClipping):
    """DPOptimizer for engines that leave the clipped sum in p.grad (ghost, bookkeeping): noise measured."""

    meter: NoiseMeter | None = None

    def add_noise(self) -> None:
        super().add_noise()
        if self.meter is not None:
            self.meter.record(self.params)
