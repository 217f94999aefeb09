"""Batch clipping's engine (``clipping: batch``; the mode's charge and capabilities: ``dptune.config.clipping``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dptune.dpsgd._engines import Engine, engine
from dptune.dpsgd._optim import BatchClipDPOptimizer

__all__ = ["BatchClipEngine"]


@engine("batch")
class BatchClipEngine(Engine):
    """Batch clipping: the plain model (BatchNorm allowed, in batch-statistics mode) on the real rows of the batch,
    the sum of their losses (each averaged over its views) differentiated once; the optimizer clips the batch mean
    (:class:`BatchClipDPOptimizer`). No per-example gradient exists, so nothing here bounds one example's effect
    by C: the 2C bound on the clipped mean does, and the charge uses it."""

    optimizer: BatchClipDPOptimizer
    optimizer_class = BatchClipDPOptimizer

    def backward(self, x: torch.Tensor, y: torch.Tensor, views: int, n_real: int | None = None) -> torch.Tensor:
        k = max(views, 1)
        n = len(y) if n_real is None else n_real
        if n == 0:
            self.empty()
            return x.new_zeros(())
        # padding rows are dropped before the forward: under BatchNorm they would shift the batch's statistics
        losses = F.cross_entropy(self.model(x[:n * k]), y[:n].repeat_interleave(k), reduction="none")
        total = losses.view(n, k).mean(1).sum()
        total.backward()
        self.optimizer.examples += n
        return total.detach()

    def empty(self) -> None:
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
