"""Building blocks shared by the models: validated GroupNorm, weight-standardized conv, the channels-last layout."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dptune.config import ConfigError


def group_norm(channels: int, groups: int, name: str) -> nn.GroupNorm:
    """GroupNorm with min(groups, channels) groups; refuses groups that do not divide the channels."""
    g = min(groups, channels)
    if channels % g:
        raise ConfigError(
            "groups",
            f"{groups} groups do not divide the channels: layer {name} has {channels} channels",
            f"choose a number of groups that divides {channels} (e.g. a power of two)",
        )
    return nn.GroupNorm(g, channels, affine=True)


class WSConv2d(nn.Module):
    """Conv2d with weight standardization (Qiao et al. 2019), as used for DP WideResNets (De et al. 2022).

    Deliberately *not* a subclass of nn.Conv2d: Opacus picks per-sample-gradient rules by exact type, and
    the plain conv rule would ignore the standardization; as its own module Opacus falls back to functorch.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1,
                 padding: int = 0, bias: bool = False, eps: float = 1e-5) -> None:
        super().__init__()
        self.stride, self.padding, self.eps = stride, padding, eps
        self.weight = nn.Parameter(torch.empty(out_channels, in_channels, kernel_size, kernel_size))
        nn.init.kaiming_normal_(self.weight, mode="fan_out", nonlinearity="relu")
        self.bias = nn.Parameter(torch.zeros(out_channels)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = self.weight.mean(dim=(1, 2, 3), keepdim=True)
        var = self.weight.var(dim=(1, 2, 3), keepdim=True, unbiased=False)
        w = (self.weight - mean) / torch.sqrt(var + self.eps)
        return F.conv2d(x, w, self.bias, self.stride, self.padding)


def channels_last(x: torch.Tensor) -> torch.Tensor:
    """A model's 4-D input in channels-last layout, for a model whose conv weights are channels-last too (both are
    needed: a 1-channel input is both layouts at once, and the weight then decides the conv's output layout). Not
    under vmap (functorch refuses the layout there; each lane is one example, and the result is the same function)."""
    if x.dim() == 4 and not torch._C._functorch.is_functorch_wrapped_tensor(x):
        return x.contiguous(memory_format=torch.channels_last)
    return x


def activation(name: str) -> nn.Module:
    # never inplace: Opacus >= 1.5.4 full backward hooks crash on in-place ops (opacus issue #828)
    return {"mish": nn.Mish(), "relu": nn.ReLU(), "tanh": nn.Tanh(), "silu": nn.SiLU()}[name]
