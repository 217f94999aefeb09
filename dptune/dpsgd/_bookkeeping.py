"""Book-keeping clipping (Bu et al. 2023, "Differentially private optimization on large model at small cost"): one
backward to each layer's outputs, never to its weights; per-example gradient norms layer by layer; each layer's
clipped sum from what the norm pass computed.

Per layer (a: its input rows, g: the loss gradient at its output rows, T positions per example, d_in x d_out weight):

* **stored**: the per-example weight gradients G_i^T A_i, materialised (cost T·d_in·d_out per example, one grouped
  convolution or a batched GEMM), give the norms and, kept until every layer's norm is known, the clipped sum
  Σ_i c_i G_i^T A_i as one matrix-vector product with the clip factors c: no second weight-gradient GEMM. Kept
  while the physical batch's stored gradients fit ``STORED_FLOATS``, where T·d_in·d_out is at most
  ``STORED_OVER_GHOST`` times the ghost norm's T²·(d_in + d_out): Bu et al.'s rule weighs the norms alone, but a
  ghost-norm layer also pays the clipped sum's GEMM, which a kept gradient spares.
* **ghost / recomputed**: otherwise (past that budget or that cost), the norm by the cheaper of ghost norm
  <A_i A_i^T, G_i G_i^T> (T²·(d_in + d_out), Bu et al.'s mixed ghost clipping) and the materialised gradient; the
  clipped sum is then one ordinary weight-gradient GEMM with the outputs' gradients scaled by the clip factors. A
  stride-1 conv's A_i A_i^T comes from its padded pixels' Gram where that GEMM is no larger (``pixel_gram``: no
  patches).
* **streamed**: the kept weight with the most per-example floats is computed last, once every other layer's norms
  are summed, in blocks of rows (``STREAM_FLOATS``): a block's gradients give its rows' last norms, hence their clip
  factors, and its share of the clipped sum while it is still in cache. That layer's gradients are never all in
  memory, and they are read once instead of three times (the GEMM's output, the norm, the sum).

GroupNorm's per-example gradients are C numbers per parameter: always stored, and taken from its own backward
(``_GroupNormRows``: the batch as one row of N·C channels, whose weight gradient is each row's). Padding rows (from
``n_real`` on) carry zero loss weight and are left out of both. Ghost-optimizer API: p.grad holds the sum of clipped
gradients.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.grad import conv2d_weight

from dptune.config import ConfigError, TrialConfig
from dptune.dpsgd._engines import Engine, _real_mask, engine
from dptune.dpsgd._optim import SummedDPOptimizer, clip_factors, zero_rows
from dptune.dpsgd._perexample import (
    Arrange,
    Workspace,
    arrangement,
    conv_per_row,
    gradients,
    layer_rows,
    output_rows,
    per_example,
    pixel_gram,
    pixel_gram_pays,
)

__all__ = ["STORED_FLOATS", "BookKeepingEngine"]

# per-example weight gradients kept between the norm pass and the clipped sum, per physical batch: 256 MiB of
# float32 (ResNet-9's 2.4M parameters at 32 rows need 78M; hooks and functorch hold all of them at every batch size)
STORED_FLOATS = 1 << 26
# a kept gradient's GEMM against the ghost norm's cost, up to which the gradient is kept: tanh_cnn's conv2 (1.14x) kept,
# its step 4 % faster; gn_cnn's conv3 (3.6x) kept, its step 12 % slower (paired, bench/results/step_overhead.md)
STORED_OVER_GHOST = 2.0
GROUPED_MIN_POSITIONS = 1024  # conv per-example gradients by grouped convolution from this many output positions
# floats (patches and per-example gradients) of one block of the streamed layer's rows: a block stays in cache from its
# GEMM to its norm and its share of the clipped sum (gn_cnn's conv2: 28 rows; the engine's step about 4 % faster)
STREAM_FLOATS = 1 << 20


_Kept = tuple[int, nn.Module, torch.Tensor, torch.Tensor]  # a kept weight's layer index, layer, input and output rows


@dataclass
class _Layer:
    """A layer's share of one backward: per-example gradients kept (param -> r rows, laid out as ``Arrange`` says),
    or its rows to redo."""

    stored: list[tuple[nn.Parameter, torch.Tensor, Arrange]]  # (param, per-example gradients, their layout)
    redo: tuple[torch.Tensor, torch.Tensor] | None = None  # (input rows, output-gradient rows) for the second GEMM
    kept: _Kept | None = None  # a weight whose per-example gradients are kept: computed by ``_keep``
    floats: int = 0  # their floats, against the budget


def _sq_norms(each: torch.Tensor) -> torch.Tensor:
    """Each row's squared norm (one row per example, flattened): a materialised weight's share of ``sq``."""
    return torch.linalg.vector_norm(each.reshape(len(each), -1), dim=1).square()


def _weighted_rows(coef: torch.Tensor, each: torch.Tensor, drop: torch.Tensor | None) -> torch.Tensor:
    """Σ_i coef_i · each_i over the rows of ``each`` (one per example, flattened), a dropped row zeroed first (its
    coefficient is 0, and 0 · inf would be NaN)."""
    return coef @ (each if drop is None else zero_rows(each, drop)).reshape(len(coef), -1)


def _laid_out(summed: torch.Tensor, p: torch.Tensor, arrange: Arrange) -> torch.Tensor:
    """A summed row of per-example gradients in the parameter's own layout (``Arrange``)."""
    return summed.view_as(p) if arrange is None else summed.view(arrange[0]).permute(arrange[1]).contiguous()


@engine("bookkeeping")
class BookKeepingEngine(Engine):
    """Book-keeping clipping for exactly Conv2d/Linear/GroupNorm models (module docstring)."""

    SUPPORTED = (nn.Conv2d, nn.Linear, nn.GroupNorm)  # exact types: a subclass may transform its weight

    @classmethod
    def build(cls, model: nn.Module, base: torch.optim.Optimizer, kw: dict[str, Any], config: TrialConfig) -> Engine:
        return cls(model, SummedDPOptimizer(base, **kw), config.max_grad_norm)

    def __init__(self, model: nn.Module, optimizer: Any, max_grad_norm: float) -> None:
        super().__init__(model, optimizer)
        self.clip = max_grad_norm
        self.layers = [m for m in model.modules() if any(p.requires_grad for p in m.parameters(recurse=False))]
        self.acts: dict[nn.Module, tuple[torch.Tensor, torch.Tensor, int]] = {}
        self.norm_rows: dict[nn.Module, tuple[torch.Tensor, torch.Tensor]] = {}  # GroupNorm -> (dγ, dβ) per row
        self.work = Workspace()
        for m in self.layers:
            m.register_forward_hook(self._save)

    @classmethod
    def supports(cls, model: nn.Module) -> bool:
        """Only the exact layer types whose rules are written here, each with nothing but its own ``weight``
        and ``bias`` (no extra parameter, no weight computed by a pre-forward hook as legacy weight_norm does)."""
        return all(cls._supported(m) for m in model.modules() if list(m.parameters(recurse=False)))

    @classmethod
    def _supported(cls, m: nn.Module) -> bool:
        names = {n for n, _ in m.named_parameters(recurse=False)}
        if type(m) not in cls.SUPPORTED or not names <= {"weight", "bias"} or m._forward_pre_hooks:
            return False
        if not isinstance(getattr(m, "weight", None), nn.Parameter):
            return False
        return not isinstance(m, nn.Conv2d) or (m.groups == 1 and m.padding_mode == "zeros"
                                                and isinstance(m.padding, tuple))

    def _save(self, m: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        if torch.is_grad_enabled():  # training forward only, not evaluation
            if m in self.acts:  # its rule sees one call per forward; a second call's gradient would be lost
                raise ConfigError("clipping", f"bookkeeping: a {type(m).__name__} layer is called twice in one "
                                  "forward pass", "set fixed.clipping: functorch (whole-model vmap: each example alone)")
            self.acts[m] = (inputs[0].detach(), output, output._version)

    def backward(self, x: torch.Tensor, y: torch.Tensor, views: int, n_real: int | None = None) -> torch.Tensor:
        k, n = max(views, 1), len(y)
        r = n if n_real is None else n_real
        self.acts, self.norm_rows = {}, {}
        with self._group_norms_keep_rows():
            logits = self.model(x)
        losses = F.cross_entropy(logits, y.repeat_interleave(k), reduction="none")
        losses = losses * _real_mask(n, n_real, y.device).repeat_interleave(k) / k
        if len(self.acts) != len(self.layers):
            raise ConfigError("clipping", "bookkeeping: a layer with trainable parameters is not called in the "
                              "forward pass", "set fixed.clipping: functorch, or freeze the unused layer")
        for m in self.layers:  # the saved output must be the tensor the loss was computed from
            if self.acts[m][1]._version != self.acts[m][2]:
                raise ConfigError("clipping", f"bookkeeping: the output of a {type(m).__name__} layer is modified "
                                  "in place (e.g. ReLU(inplace=True), out += identity)",
                                  "use out-of-place ops (ReLU(), out = out + identity) or fixed.clipping: functorch")
        grads = torch.autograd.grad(losses.sum(), [self.acts[m][1] for m in self.layers])
        with torch.no_grad():
            sq, budget, plans = x.new_zeros(r), STORED_FLOATS, []
            for i, (m, g) in enumerate(zip(self.layers, grads, strict=True)):  # padding rows: zero weight, left out
                plan = self._norms(i, m, self.acts[m][0][:r * k], g[:r * k], r, k, sq, budget)
                budget -= sum(t.numel() for _, t, _ in plan.stored) + plan.floats
                plans.append(plan)
            self._keep(plans, r, k, sq)
            # An example whose gradient norm is not finite (an overflow, a NaN) contributes exactly zero: a
            # per-example rule, so the sum stays a sum of contributions of norm <= C (0 * inf would be NaN and
            # one example would decide whether the whole noised step is NaN).
            coef, drop = clip_factors(sq.sqrt(), self.clip)
            for m, plan in zip(self.layers, plans, strict=True):
                for p, each, arrange in plan.stored:  # each example's gradient of p
                    p.grad = _laid_out(_weighted_rows(coef, each, drop), p, arrange)
                if plan.redo is not None:
                    self._clipped_sum(m, *plan.redo, coef, drop, k)
        self.acts, self.norm_rows = {}, {}
        return losses.detach().sum()

    @contextmanager
    def _group_norms_keep_rows(self) -> Iterator[None]:
        """For one forward pass, each GroupNorm (exactly nn.GroupNorm, whose forward is this one call) runs as
        ``_GroupNormRows``, which leaves its per-row weight and bias gradients in ``norm_rows`` during the backward."""
        patched = [m for m in self.layers if isinstance(m, nn.GroupNorm) and "forward" not in m.__dict__]
        for m in patched:
            m.forward = self._group_norm_forward(m)  # type: ignore[method-assign]
        try:
            yield
        finally:
            for m in patched:
                del m.forward

    def _group_norm_forward(self, m: nn.GroupNorm) -> Any:
        def forward(x: torch.Tensor) -> torch.Tensor:
            if not (torch.is_grad_enabled() and x.dim() >= 2 and x.shape[0] > 0):
                return F.group_norm(x, m.num_groups, m.weight, m.bias, m.eps)

            def keep(rows: tuple[torch.Tensor, torch.Tensor]) -> None:
                self.norm_rows[m] = rows
            # a channels-last input (the CNNs' layout on CPU) keeps it; CUDA's GroupNorm copies any other input to
            # contiguous itself, and so does this
            if (x.device.type == "cpu" and x.dim() == 4 and not x.is_contiguous()
                    and x.is_contiguous(memory_format=torch.channels_last)):
                return cast(torch.Tensor, _GroupNormRowsChannelsLast.apply(x, m.weight, m.bias, m.num_groups, m.eps,
                                                                           keep))
            return cast(torch.Tensor, _GroupNormRows.apply(x.contiguous(), m.weight, m.bias, m.num_groups, m.eps, keep))
        return forward

    @staticmethod
    def _trains(p: object) -> bool:
        return isinstance(p, torch.Tensor) and p.requires_grad

    def _norms(self, i: int, m: nn.Module, a: torch.Tensor, g: torch.Tensor, r: int, k: int, sq: torch.Tensor,
               budget: int) -> _Layer:
        """Adds the layer's per-example squared gradient norms to ``sq`` (a frozen weight adds none); a weight whose
        per-example gradients are kept adds them later (``_keep``)."""
        if isinstance(m, nn.GroupNorm):
            return self._group_norm_rows(m, a, g, r, k, sq)
        stored: list[tuple[nn.Parameter, torch.Tensor, Arrange]] = []
        weight, bias = cast(nn.Parameter, m.weight), cast("nn.Parameter | None", m.bias)
        if self._trains(bias):
            gb = per_example(g.reshape(g.shape[0], g.shape[1], -1).sum(2) if not isinstance(m, nn.Linear)
                             else g.reshape(g.shape[0], -1, g.shape[-1]).sum(1), r, k)
            sq += gb.square().sum(1)
            stored.append((cast(nn.Parameter, bias), gb, None))
        if not self._trains(weight):
            return _Layer(stored)
        if isinstance(m, nn.Conv2d):
            d_in, d_out, t = weight[0].numel(), weight.shape[0], k * g.shape[2] * g.shape[3]
        else:
            d_in, d_out, t = a.shape[-1], g.shape[-1], a[:1].numel() // a.shape[-1] * k
        # Bu et al.'s choice for the norm: the materialised gradient where it costs less than the ghost norm. A kept
        # gradient also spares the clipped sum's GEMM (a GEMV instead), so it is kept up to STORED_OVER_GHOST times
        # the ghost norm's cost while the budget lasts; else the clipped sum is recomputed
        materialised, ghost = t * d_in * d_out, t * t * (d_in + d_out)
        explicit = materialised <= ghost
        if materialised <= STORED_OVER_GHOST * ghost and r * weight.numel() <= budget:
            return _Layer(stored, kept=(i, m, a, g), floats=r * weight.numel())  # computed by _keep
        if not explicit and isinstance(m, nn.Conv2d) and pixel_gram_pays(m, a):
            gram, gt = pixel_gram(m, a, r, k, self.work, i), output_rows(g, r, k)
        else:
            cols, gt = layer_rows(m, a, g, r, k, self.work, i)
            if explicit:
                sq += _sq_norms(gradients(gt, cols))
                return _Layer(stored, (a, g))
            gram = torch.bmm(cols, cols.transpose(1, 2))
        sq += (gram * torch.bmm(gt.transpose(1, 2), gt)).sum((1, 2))  # ghost norm: <A A^T, G G^T>
        return _Layer(stored, (a, g))

    def _keep(self, plans: list[_Layer], r: int, k: int, sq: torch.Tensor) -> None:
        """The kept weights' per-example gradients, once every other layer's norms are in ``sq``: each kept whole for
        its clipped sum, but the largest, streamed (``_stream``)."""
        kept = [plan for plan in plans if plan.kept is not None]
        streamed = max(kept, key=lambda plan: plan.floats, default=None)
        for plan in kept:
            if plan is not streamed:
                i, m, a, g = cast(_Kept, plan.kept)
                gw, arrange = self._kept_rows(i, m, a, g, r, k)
                sq += _sq_norms(gw)
                plan.stored.append((cast(nn.Parameter, m.weight), gw, arrange))
        if streamed is not None:
            self._stream(*cast(_Kept, streamed.kept), r, k, sq)

    def _stream(self, i: int, m: nn.Module, a: torch.Tensor, g: torch.Tensor, r: int, k: int, sq: torch.Tensor
                ) -> None:
        """The last kept weight, block by block of rows, every other layer's norms already in ``sq``: each block's
        per-example gradients give its rows' last norms, so their clip factors, and the block's share of the clipped
        sum at once, while the block is in cache (the same factors as ``clip_factors`` of the whole ``sq``, elementwise).
        Never the whole layer's gradients in memory; the sum's terms added up block by block. On CPU only: a GPU's
        bandwidth makes the round trips cheap and its steps are launch-bound, so there the layer is one block."""
        weight = cast(nn.Parameter, m.weight)
        per_row = weight.numel() + g[:k].numel() // weight.shape[0] * weight[0].numel()  # gradient and patches
        rows = max(1, STREAM_FLOATS // per_row) if g.device.type == "cpu" else max(r, 1)
        total, arrange = None, None
        for s in range(0, r, rows):
            e = min(s + rows, r)
            gw, arrange = self._kept_rows(i, m, a[s * k:e * k], g[s * k:e * k], e - s, k)
            part = sq[s:e]
            part += _sq_norms(gw)
            coef, drop = clip_factors(part.sqrt(), self.clip)
            summed = _weighted_rows(coef, gw, drop)
            total = summed if total is None else total.add_(summed)
        weight.grad = torch.zeros_like(weight) if total is None else _laid_out(total, weight, arrange)

    def _kept_rows(self, i: int, m: nn.Module, a: torch.Tensor, g: torch.Tensor, r: int, k: int
                   ) -> tuple[torch.Tensor, Arrange]:
        """The r examples' weight gradients (r, ...) and their layout: by oneDNN's grouped weight-gradient convolution
        for a conv of many positions, else a batched GEMM of the layer's rows (into the workspace)."""
        weight = cast(nn.Parameter, m.weight)
        if isinstance(m, nn.Conv2d) and g.shape[2] * g.shape[3] >= GROUPED_MIN_POSITIONS:
            return per_example(conv_per_row(m, a, g), r, k), None
        d_in, d_out = weight[0].numel(), weight.shape[0]
        cols, gt = layer_rows(m, a, g, r, k, self.work, i)
        gw = gradients(gt, cols, self.work.take((i, "stored"), (r, d_in * d_out), g))
        return gw, arrangement(weight, isinstance(m, nn.Conv2d), d_in < d_out)

    def _group_norm_rows(self, m: nn.GroupNorm, a: torch.Tensor, g: torch.Tensor, r: int, k: int, sq: torch.Tensor
                         ) -> _Layer:
        """A GroupNorm's per-example gradients: from its backward (``norm_rows``), or, where its backward did not run
        (nothing before it needs a gradient: a first layer), from its recomputed normalised input."""
        rows = self.norm_rows.get(m)
        if rows is None:
            xhat = F.group_norm(a, m.num_groups, eps=m.eps)  # each channel's <g, x_hat>: a batched GEMM of 1-row
            dots = torch.bmm(g.reshape(-1, 1, g[0, 0].numel()), xhat.reshape(-1, xhat[0, 0].numel(), 1))  # matrices
            rows = dots.view(g.shape[0], g.shape[1]), g.reshape(g.shape[0], g.shape[1], -1).sum(2)
        stored: list[tuple[nn.Parameter, torch.Tensor, Arrange]] = []
        for p, per_row in ((m.bias, rows[1]), (m.weight, rows[0])):
            if self._trains(p):
                t = per_example(per_row[:r * k], r, k)
                sq += t.square().sum(1)
                stored.append((cast(nn.Parameter, p), t, None))
        return _Layer(stored)

    def _clipped_sum(self, m: nn.Module, a: torch.Tensor, g: torch.Tensor, coef: torch.Tensor,
                     drop: torch.Tensor | None, k: int) -> None:
        """The weight's clipped sum as one ordinary weight-gradient GEMM of the clip-factor-scaled output gradients."""
        c = coef.repeat_interleave(k)
        if drop is not None:
            a, g = zero_rows(a, drop.repeat_interleave(k)), zero_rows(g, drop.repeat_interleave(k))
        g = g * c.view(-1, *([1] * (g.dim() - 1)))
        weight = cast(nn.Parameter, m.weight)
        if isinstance(m, nn.Conv2d):
            weight.grad = conv2d_weight(a, weight.shape, g, m.stride, m.padding, m.dilation)
        else:
            weight.grad = g.reshape(-1, g.shape[-1]).t() @ a.reshape(-1, a.shape[-1])

    def empty(self) -> None:
        for p in self.params:
            p.grad = torch.zeros_like(p)


class _GroupNormRows(torch.autograd.Function):
    """GroupNorm over N rows computed as GroupNorm of one row of N·C channels in N·G groups, the weight and bias
    repeated N times: the same groups of the same numbers through the same kernels, so the output and the input's
    gradient are the ones nn.GroupNorm gives (bit for bit on CPU, tested), and the backward's weight and bias
    gradients, one per channel of the one row, are each row's own: Σ g·x̂ and Σ g per (row, channel), which the
    kernel computes anyway on its way to the input's gradient. ``keep`` receives them, (N, C) each. The weight and
    bias get no autograd gradient: the engine sums the clipped per-example ones itself."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, groups: int, eps: float,
                keep: Any) -> torch.Tensor:
        n, c = x.shape[0], x.shape[1]
        hw = x[0, 0].numel()
        w, b = weight.detach().repeat(n), bias.detach().repeat(n)
        y, mean, rstd = torch.ops.aten.native_group_norm(x, w, b, 1, n * c, hw, n * groups, eps)
        ctx.save_for_backward(x, w, mean, rstd)
        ctx.sizes, ctx.keep = (n, c, hw, groups), keep
        return cast(torch.Tensor, y)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w, mean, rstd = ctx.saved_tensors
        n, c, hw, groups = ctx.sizes
        dx, dw, db = torch.ops.aten.native_group_norm_backward(grad.contiguous(), x, mean, rstd, w, 1, n * c, hw,
                                                               n * groups, [True, True, True])
        ctx.keep((dw.view(n, c), db.view(n, c)))
        return dx, None, None, None, None, None


class _GroupNormRowsChannelsLast(torch.autograd.Function):
    """``_GroupNormRows`` for a channels-last input (the built-in CNNs' layout), which cannot be viewed as one row
    of N·C channels: nn.GroupNorm's own kernels (output and input gradient bit for bit), and each row's weight and
    bias gradients from the forward's group statistics, Σ g·x̂ = rstd·(Σ g·x − mean·Σ g) and Σ g per (row, channel),
    the sums the kernel forms for the input's gradient, taken here by two reductions."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, groups: int, eps: float,
                keep: Any) -> torch.Tensor:
        n, c = x.shape[0], x.shape[1]
        y, mean, rstd = torch.ops.aten.native_group_norm(x, weight.detach(), bias.detach(), n, c, x[0, 0].numel(),
                                                         groups, eps)
        ctx.save_for_backward(x, weight.detach(), mean, rstd)
        ctx.sizes, ctx.keep = (n, c, groups), keep
        return cast(torch.Tensor, y)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w, mean, rstd = ctx.saved_tensors
        n, c, groups = ctx.sizes
        grad = grad.contiguous(memory_format=torch.channels_last)
        dx, _, _ = torch.ops.aten.native_group_norm_backward(grad, x, mean, rstd, w, n, c, x[0, 0].numel(), groups,
                                                             [True, False, False])
        db = grad.sum((2, 3))
        ds = (grad * x).sum((2, 3))
        dw = (ds.view(n, groups, -1) - db.view(n, groups, -1) * mean.view(n, groups, 1)) * rstd.view(n, groups, 1)
        ctx.keep((dw.view(n, c), db))
        return dx, None, None, None, None, None
