"""The Opacus 1.6 optimizers as dptune runs them: noise measured, non-finite examples contributing zero.

Measurement: Opacus' ``add_noise`` sets ``p.grad = p.summed_grad + N(0, (σ·C)²)`` for every parameter, and
only then ``scale_grad`` divides by the expected batch size. Right after ``add_noise``, ``p.grad −
p.summed_grad`` is therefore exactly the noise of this step on the *summed* clipped gradient, std σ·C per
coordinate — measured from the tensors, not copied from the config. Costs one subtraction and one
squared-norm per parameter per logical step, accumulated on the device (no synchronisation).

Non-finite examples: an example whose per-example gradient norm is not finite (an overflow, a NaN) would
make Opacus' clip factor NaN and with it the whole summed gradient, so one example would decide whether a
noised step is NaN. Here it contributes exactly zero instead: a per-example rule, so every contribution
keeps norm <= C (the sensitivity the accountant assumes).
"""

from __future__ import annotations

from typing import Any, cast

import torch
from opacus.grad_sample import GradSampleModuleFastGradientClipping
from opacus.optimizers import DPOptimizer, DPOptimizerFastGradientClipping
from opacus.optimizers.optimizer import _check_processed_flag, _mark_as_processed

__all__ = ["BatchClipDPOptimizer", "ClippingDPOptimizer", "GhostClippingModule", "NoiseMeter", "SummedDPOptimizer",
           "clip_factors", "zero_rows"]


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


def clip_factors(norms: torch.Tensor, max_grad_norm: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Opacus' per-example clip factors min(1, C/(‖g‖+1e-6)), zero where ‖g‖ is not finite; and the rows
    to zero out (None when every norm is finite: the common case, no extra work)."""
    finite = torch.isfinite(norms)
    factors = torch.where(finite, (max_grad_norm / (norms + 1e-6)).clamp(max=1.0), 0.0)
    return factors, None if bool(finite.all()) else ~finite


def zero_rows(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``t`` with the given leading-dimension rows set to 0 (not multiplied: 0 · inf is NaN)."""
    return torch.where(rows.view(-1, *([1] * (t.dim() - 1))), 0.0, t)


def _layer_factors(norms: torch.Tensor, layers: tuple[list[int], list[float]]
                   ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """Per-parameter clip factors for layerwise clipping: ``norms`` (examples x parameters); ``layers``: each
    parameter's layer index and each layer's C_l. A layer's parameters share one factor, from their joint norm."""
    index, clip = layers
    per_layer: list[torch.Tensor] = []
    dropped = torch.zeros(norms.shape[0], dtype=torch.bool, device=norms.device)
    for layer, c in enumerate(clip):
        cols = [j for j, k in enumerate(index) if k == layer]
        factors, drop = clip_factors(norms[:, cols].norm(2, 1), c)
        per_layer.append(factors)
        if drop is not None:
            dropped |= drop
    if bool(dropped.any()):  # an example with any non-finite layer contributes zero, every layer
        per_layer = [torch.where(dropped, 0.0, f) for f in per_layer]
        return [per_layer[k] for k in index], dropped
    return [per_layer[k] for k in index], None


class ClippingDPOptimizer(DPOptimizer):
    """DPOptimizer for per-sample gradients (hooks, functorch): non-finite examples dropped, noise measured."""

    meter: NoiseMeter | None = None
    # adaptive layerwise clipping: each parameter's layer index, each layer's C_l (sqrt(Σ C_l²) = max_grad_norm)
    layer_clip: tuple[list[int], list[float]] | None = None

    def clip_and_accumulate(self) -> None:
        # Opacus 1.6 DPOptimizer.clip_and_accumulate, with clip_factors in place of its factor formula; with
        # layer_clip, one factor per layer (its parameters' joint per-example norm against its C_l), and an example
        # with any non-finite layer contributes zero
        grad_samples = self.grad_samples
        if len(grad_samples[0]) == 0:  # an empty Poisson batch
            per_param = [torch.zeros((0,), device=grad_samples[0].device)] * len(self.params)
            drop = None
        else:
            dev = grad_samples[0].device
            norms = torch.stack([g.reshape(len(g), -1).norm(2, dim=-1).to(dev) for g in grad_samples], 1)
            if self.layer_clip is None:
                factors, drop = clip_factors(norms.norm(2, 1), self.max_grad_norm)
                per_param = [factors] * len(self.params)
            else:
                per_param, drop = _layer_factors(norms, self.layer_clip)
        for p, factors in zip(self.params, per_param, strict=True):
            _check_processed_flag(p.grad_sample)
            gs = self._get_flat_grad_sample(p).to(p.dtype)
            if drop is not None:
                gs = zero_rows(gs, drop.to(gs.device))
            grad = torch.einsum("i,i...", factors.to(gs.device).to(p.dtype), gs)
            if p.summed_grad is not None:
                p.summed_grad += grad
            else:
                p.summed_grad = grad
            _mark_as_processed(p.grad_sample)

    def add_noise(self) -> None:
        super().add_noise()
        if self.meter is not None:
            self.meter.record(self.params)


class SummedDPOptimizer(DPOptimizerFastGradientClipping):
    """DPOptimizer for engines that leave the clipped sum in p.grad (ghost, bookkeeping): noise measured."""

    meter: NoiseMeter | None = None

    def accumulate(self) -> None:
        # Opacus' accumulate, with a clone for its deepcopy of each first gradient (the same tensor, without
        # deepcopy's Python machinery: about 1 ms per step on gn_cnn's 14 parameters)
        for p in self.params:
            if p.summed_grad is not None:  # type: ignore[attr-defined]
                p.summed_grad.add_(p.grad)  # type: ignore[attr-defined]
            else:
                p.summed_grad = p.grad.detach().clone()  # type: ignore[attr-defined,union-attr]

    def add_noise(self) -> None:
        super().add_noise()
        if self.meter is not None:
            self.meter.record(self.params)


class BatchClipDPOptimizer(SummedDPOptimizer):
    """Batch clipping (van Dijk et al. 2023): the engine leaves the *un-clipped* sum of the batch's loss gradients
    in p.grad and counts the batch's examples in ``examples``; each logical step takes their mean, clips it as one
    vector to C (zero if it is not finite, or for an empty batch), adds N(0, (σ·C)²) and steps on that, without
    dividing by the batch size: the noise is on the mean, not on a sum of per-example terms. One example moves the
    clipped mean by up to 2C (``dptune.config.clipping.sensitivity``), which the accountant charges."""

    examples = 0

    def pre_step(self, closure: Any = None) -> bool:
        # Opacus 1.6 DPOptimizerFastGradientClipping.pre_step, with the mean clipped before the noise and no
        # scale_grad (the expected batch size divides nothing here)
        self.accumulate()
        if self._check_skip_next_step():
            self._is_last_step_skipped = True
            return False
        self._clip_mean()
        self.add_noise()
        if self.step_hook:
            self.step_hook(self)
        self._is_last_step_skipped = False
        return True

    def _clip_mean(self) -> None:
        n, self.examples = self.examples, 0
        with torch.no_grad():
            means = [cast(torch.Tensor, p.summed_grad) / max(n, 1) for p in self.params]  # type: ignore[attr-defined]
            norm = torch.stack(torch._foreach_norm(means)).double().square().sum().sqrt() if means else None
            factor = 0.0 if n == 0 or norm is None or not bool(torch.isfinite(norm)) else \
                min(1.0, self.max_grad_norm / (float(norm) + 1e-6))
            for p, m in zip(self.params, means, strict=True):
                p.summed_grad = torch.zeros_like(m) if factor == 0.0 else m * factor  # type: ignore[attr-defined]


class GhostClippingModule(GradSampleModuleFastGradientClipping):
    """Opacus ghost clipping with clip_factors: an example with a non-finite norm gets weight 0 in the
    second backward (exact when its gradient is finite; a NaN gradient stays NaN inside Opacus)."""

    def get_clipping_coef(self) -> torch.Tensor:
        return clip_factors(self.get_norm_sample(), self.max_grad_norm)[0]
