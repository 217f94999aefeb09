"""Audit-only instrumentation of one trial, for ``dptune.audit`` (``bench/audit.py``, ``tests/test_audit.py``).

Reachable only through ``run_trial(..., _audit=AuditHooks(...))``: a Python object that no search space,
release, certificate or CLI can construct or name. The search's trainable, final training and every CLI
call ``run_trial`` without it (``tests/test_audit.py`` checks that no other module names it), so none of
this runs in a search or a final training. What it can do:

* **gradient canaries** (white-box audits, Steinke, Nasr & Jagielski 2023): some rows of the training split
  are canaries whose per-example gradient is the fixed vector G·e_j (one coordinate j of the flattened
  parameters, G larger than the clipping bound C) instead of a gradient of the loss. They are ordinary rows:
  Poisson-sampled like every other row, their gradient added *before* the optimizer clips and noises, so the
  audit measures dptune's own sampling, clipping and noise;
  (Feature canaries, ``dptune.audit._features``, need no hook: they are training rows of an audit model whose
  per-example gradient direction is known, so they audit every clipping mode, bookkeeping and ghost included.)
* **observe** the model after every noised step (white-box: every intermediate model is seen);
* **a deliberate bug** (``BUGS``) that makes the trainer add less noise or skip clipping, so that an audit can
  show it catches a trainer whose certificate overstates its privacy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from dptune.dpsgd._engines import Engine
from dptune.dpsgd._optim import ClippingDPOptimizer

__all__ = ["BUGS", "AuditHooks"]

# Deliberate bugs, audit-only: the noise the optimizer adds is σ/10 (or σ/2) instead of σ; per-example gradients
# are not clipped (the clipping bound is raised 10⁶-fold while the noise std stays σ·C).
BUGS = ("noise_x0.1", "noise_x0.5", "no_clip")
_UNCLIPPED = 1e6


@dataclass(frozen=True, eq=False, kw_only=True)
class AuditHooks:
    """Audit-only hooks of one trial (see the module docstring; never set outside an audit).

    ``canary_coordinate``: int64, one entry per row of the training split: the flat parameter coordinate j
    of that row's gradient G·e_j, or −1 for an ordinary row (None: no gradient canaries; they need a
    per-sample-gradient clipping mode, ``hooks`` or ``functorch``). ``canary_gradient_norm``: G.
    ``on_step(model)``: called after every noised step. ``bug``: one of ``BUGS``, or None."""

    canary_coordinate: torch.Tensor | None = None
    canary_gradient_norm: float = 0.0
    on_step: Callable[[nn.Module], None] | None = None
    bug: str | None = None

    def __post_init__(self) -> None:
        if self.bug is not None and self.bug not in BUGS:
            raise ValueError(f"unknown audit bug {self.bug!r}; use one of {BUGS}")
        c = self.canary_coordinate
        if c is not None and (c.dtype != torch.int64 or c.dim() != 1 or not self.canary_gradient_norm > 0):
            raise ValueError("canary_coordinate must be a 1-d int64 tensor and canary_gradient_norm > 0")

    def split(self, idx: list[int]) -> tuple[list[int], torch.Tensor | None]:
        """A physical batch's rows: (ordinary rows, the coordinates of its gradient canaries or None)."""
        if self.canary_coordinate is None or len(idx) == 0:
            return idx, None
        coords = self.canary_coordinate[torch.as_tensor(idx, dtype=torch.int64)]
        canary = coords >= 0
        if not bool(canary.any()):
            return idx, None
        real = [i for i, c in zip(idx, canary.tolist(), strict=True) if not c]
        return real, coords[canary]

    def add_canary_gradients(self, engine: Engine, coords: torch.Tensor) -> None:
        """Append one per-example gradient G·e_j per canary to what the optimizer will clip and sum."""
        if not isinstance(engine.optimizer, ClippingDPOptimizer):
            raise ValueError("gradient canaries need per-sample gradients: clipping mode hooks or functorch (feature "
                             "canaries, dptune.audit.observed_feature_trial, audit every mode)")
        start = 0
        rows = torch.arange(len(coords))
        for p in engine.params:
            block = p.new_zeros((len(coords), p.numel()))
            mine = (coords >= start) & (coords < start + p.numel())
            block[rows[mine], coords[mine] - start] = self.canary_gradient_norm
            block = block.view(len(coords), *p.shape)
            gs = getattr(p, "grad_sample", None)
            p.grad_sample = block if gs is None else torch.cat([gs, block])  # type: ignore[attr-defined]
            start += p.numel()


def apply_bug(engine: Engine, bug: str | None) -> None:
    """Break the trainer as ``bug`` says (audit-only; called by run_trial only when an audit asks)."""
    opt = engine.optimizer
    if bug in ("noise_x0.1", "noise_x0.5"):
        opt.noise_multiplier *= float(bug.removeprefix("noise_x"))
    elif bug == "no_clip":  # clip at 10⁶·C, noise std unchanged at σ·C
        opt.max_grad_norm *= _UNCLIPPED
        opt.noise_multiplier /= _UNCLIPPED
        for holder in (engine, getattr(engine, "gsm", None)):  # bookkeeping and ghost clip in the engine
            for name in ("clip", "max_grad_norm"):
                if holder is not None and isinstance(getattr(holder, name, None), float):
                    setattr(holder, name, getattr(holder, name) * _UNCLIPPED)
