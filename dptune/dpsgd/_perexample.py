"""Per-example rows for book-keeping (``_bookkeeping``): a layer's input patches and output gradients per example,
their per-example weight gradients (batched GEMM or grouped convolution), a stride-1 conv's patch Gram from its pixels,
and the CPU workspace that keeps the step's large temporaries."""

from __future__ import annotations

import math
from typing import Any, cast

import torch
from torch import nn

__all__ = ["Arrange", "Workspace", "arrangement", "conv_per_row", "gradients", "layer_rows", "output_rows", "padded",
           "per_example", "pixel_gram", "pixel_gram_pays", "unfold"]

# How a stored per-example gradient's row, summed, becomes the parameter's gradient: viewed as this shape, then
# permuted (None: already the parameter's shape)
Arrange = tuple[tuple[int, ...], tuple[int, ...]] | None


class Workspace:
    """CPU buffers kept from one backward to the next, one per (layer, use), for the step's large temporaries (the
    patches, the stored per-example gradients). A fresh allocation of that size is mapped anew by glibc every step
    (above its mmap threshold, at most 32 MiB) and its page faults cost about as much as the bmm that fills it.
    Off the CPU the caching allocator already reuses memory: plain allocations there."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[Any, ...], torch.Tensor] = {}

    def take(self, key: tuple[Any, ...], shape: tuple[int, ...], like: torch.Tensor, zeroed: bool = False
             ) -> torch.Tensor:
        """A ``shape`` buffer; ``zeroed``: all zeros when new, and later what its user left there: a padded input
        whose user writes only the interior keeps its zero border (one buffer per row shape, so the border stays
        where it was)."""
        if like.device.type != "cpu":
            return like.new_zeros(shape) if zeroed else like.new_empty(shape)
        if zeroed:
            key = (*key, *shape[1:])
        n, buf = math.prod(shape), self.buffers.get(key)
        if buf is None or buf.numel() < n or buf.dtype != like.dtype:
            buf = self.buffers[key] = like.new_zeros(n) if zeroed else like.new_empty(n)
        return buf[:n].view(shape)


def per_example(t: torch.Tensor, r: int, k: int) -> torch.Tensor:
    """Per row -> per example: each example's K views summed (r examples)."""
    return t.view(r, k, *t.shape[1:]).sum(1) if k > 1 else t


def layer_rows(m: nn.Module, a: torch.Tensor, g: torch.Tensor, r: int, k: int, work: Workspace, i: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per example, its input rows A (r, T, d_in) and output gradients G^T (r, d_out, T): T counts positions and
    views (a Linear's extra dims are positions). A conv's d_in is ordered (kh, kw, C_in): see ``unfold``."""
    if isinstance(m, nn.Conv2d):
        cols = unfold(m, a, work, i)  # (rows, positions, d_in)
        return cols.reshape(r, -1, cols.shape[-1]), output_rows(g, r, k)
    return a.reshape(r, -1, a.shape[-1]), g.reshape(r, -1, g.shape[-1]).transpose(1, 2)


def output_rows(g: torch.Tensor, r: int, k: int) -> torch.Tensor:
    """A conv's output gradients per example, G^T (r, d_out, T): T counts its views' positions, view by view."""
    gt = g.flatten(2)  # (rows, d_out, positions)
    return gt.view(r, k, *gt.shape[1:]).transpose(1, 2).reshape(r, gt.shape[1], -1) if k > 1 else gt


def pixel_gram_pays(m: nn.Conv2d, a: torch.Tensor) -> bool:
    """Whether ``pixel_gram`` applies (stride 1, dilation 1) and its GEMM has no more FLOPs than the patches' Gram:
    (Hp·Wp)²·C_in against T²·kh·kw·C_in per view pair."""
    if m.stride != (1, 1) or m.dilation != (1, 1):
        return False
    pad = cast(tuple[int, int], m.padding)
    (kh, kw), (h, w) = m.kernel_size, a.shape[2:]
    hp, wp = h + 2 * pad[0], w + 2 * pad[1]
    return (hp * wp) ** 2 <= ((hp - kh + 1) * (wp - kw + 1)) ** 2 * kh * kw


def pixel_gram(m: nn.Conv2d, a: torch.Tensor, r: int, k: int, work: Workspace, i: int) -> torch.Tensor:
    """The patches' Gram A A^T (r, T, T) of a stride-1 conv without its patches: each patch is kh x kw padded pixels,
    so <patch(t), patch(t')> is the sum over the kernel's offsets of the padded pixels' Gram at (t + o, t' + o). One
    GEMM of the pixels (Hp·Wp rows, C_in long) and kh + kw shifted sums. The same sums in another order (relative
    difference about 4e-7 in float32; tested against the patches'). gn_cnn's conv3 norms at B 256: 2.10-2.40 against
    3.16-3.79 ms with the patch copy and the patches' Gram (bench/results/step_overhead.md). T counts views and
    positions, in ``output_rows``' order."""
    (kh, kw) = m.kernel_size
    x = padded(m, a, work, i)  # (rows, Hp, Wp, C_in)
    hp, wp = x.shape[1], x.shape[2]
    ho, wo = hp - kh + 1, wp - kw + 1
    px = x.view(r, k * hp * wp, x.shape[3])
    pix = torch.bmm(px, px.transpose(1, 2)).view(r, k, hp, wp, k, hp, wp)
    rows = pix[:, :, :, :wo, :, :, :wo]
    for o in range(1, kw):
        rows = rows + pix[:, :, :, o:o + wo, :, :, o:o + wo]  # (r, k, Hp, Wo, k, Hp, Wo)
    gram = rows[:, :, :ho, :, :, :ho]
    for o in range(1, kh):
        gram = gram + rows[:, :, o:o + ho, :, :, o:o + ho]  # (r, k, Ho, Wo, k, Ho, Wo)
    return gram.reshape(r, k * ho * wo, k * ho * wo)


def gradients(gt: torch.Tensor, cols: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Each example's weight gradient G^T A from (r, d_out, T) and (r, T, d_in): (r, d_out, d_in), or (r, d_in, d_out)
    where d_in < d_out. The same dot products; the batched GEMM's output rows are vectorised along their length, and
    a short row wastes most of each vector (gn_cnn's first conv, d_in 9 against d_out 32: 0.93-0.96 against
    0.25-0.26 ms at B 256, torch 2.14.1 on 1 thread, an AVX-512 CPU; bench/results/step_overhead.md)."""
    r, d_out, d_in = gt.shape[0], gt.shape[1], cols.shape[2]
    if d_in < d_out:
        return torch.bmm(cols.transpose(1, 2), gt.transpose(1, 2),
                         out=None if out is None else out.view(r, d_in, d_out))
    return torch.bmm(gt, cols, out=None if out is None else out.view(r, d_out, d_in))


def arrangement(weight: torch.Tensor, conv: bool, transposed: bool) -> Arrange:
    """The layout of ``gradients``' rows against the weight's: a conv's d_in in (kh, kw, C_in) order (``unfold``),
    d_out first or (``transposed``) last."""
    if not conv:
        return ((weight.shape[1], weight.shape[0]), (1, 0)) if transposed else None
    d_out, c_in, kh, kw = weight.shape
    return ((kh, kw, c_in, d_out), (3, 2, 0, 1)) if transposed else ((d_out, kh, kw, c_in), (0, 3, 1, 2))


def unfold(m: nn.Conv2d, a: torch.Tensor, work: Workspace, i: int) -> torch.Tensor:
    """The conv's input patches (rows, positions, kh·kw·C_in): a channels-last strided view copied once, into the
    workspace (F.unfold's im2col runs example by example on CPU, and its (C_in, kh, kw)-major layout makes the batched
    GEMM slow)."""
    (kh, kw), (sh, sw), (dh, dw) = m.kernel_size, m.stride, m.dilation
    x = padded(m, a, work, i)  # (N, Hp, Wp, C)
    x = x.unfold(1, dh * (kh - 1) + 1, sh).unfold(2, dw * (kw - 1) + 1, sw)[..., ::dh, ::dw]  # (N, Ho, Wo, C, kh, kw)
    x = x.permute(0, 1, 2, 4, 5, 3)
    cols = work.take((i, "patches"), tuple(x.shape), a).copy_(x)
    return cols.view(a.shape[0], x.shape[1] * x.shape[2], -1)


def padded(m: nn.Conv2d, a: torch.Tensor, work: Workspace, i: int) -> torch.Tensor:
    """The conv's input zero-padded, channels-last (rows, Hp, Wp, C_in), in the workspace."""
    pad = cast(tuple[int, int], m.padding)
    n, c, h, w = a.shape
    x = work.take((i, "padded"), (n, h + 2 * pad[0], w + 2 * pad[1], c), a, zeroed=True)
    x[:, pad[0]:pad[0] + h, pad[1]:pad[1] + w].copy_(a.permute(0, 2, 3, 1))
    return x


def conv_per_row(m: nn.Conv2d, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Each row's weight gradient (rows, C_out, C_in·kh·kw): the rows as the groups of one grouped convolution."""
    n, c_in, c_out = a.shape[0], a.shape[1], g.shape[1]
    shape = (n * c_out, c_in, *m.kernel_size)
    _, gw, _ = torch.ops.aten.convolution_backward(
        g.reshape(1, n * c_out, *g.shape[2:]), a.reshape(1, n * c_in, *a.shape[2:]), a.new_empty(shape), None,
        m.stride, m.padding, m.dilation, False, (0, 0), n, (False, True, False))
    return gw.view(n, c_out, -1)
