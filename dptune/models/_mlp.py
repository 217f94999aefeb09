"""A small MLP for tables (and flattened images): Linear, GroupNorm (or none), tanh."""

from __future__ import annotations

import torch
from torch import nn

from dptune.config import ConfigError
from dptune.models._layers import activation, group_norm


class MLP(nn.Module):
    """flatten -> [Linear -> GroupNorm(min(groups, width)) or nothing -> act] per hidden width -> Linear.

    A table's rows arrive as (N, 1, 1, d) (see dptune.data); images as (N, C, H, W): both are flattened.
    GroupNorm normalises each example's hidden units on its own, so per-sample clipping still bounds each
    example's contribution; tanh keeps per-sample gradient norms small (Papernot et al. 2021)."""

    def __init__(self, num_classes: int, input_shape: tuple[int, int, int], groups: int,
                 hidden: list[int] | tuple[int, ...] = (64, 64), norm: str = "group", act: str = "tanh") -> None:
        super().__init__()
        if norm not in ("group", "none"):
            raise ConfigError("model.kwargs.norm", f"unknown norm {norm!r}", "use group or none")
        if act not in ("tanh", "relu", "mish", "silu"):
            raise ConfigError("model.kwargs.act", f"unknown activation {act!r}", "use tanh, relu, mish or silu")
        widths = list(hidden)
        if not all(isinstance(w, int) and not isinstance(w, bool) and w >= 1 for w in widths):
            raise ConfigError("model.kwargs.hidden", f"{hidden!r} is not a list of positive widths",
                              "write e.g. hidden: [64, 64]")
        layers: list[nn.Module] = [nn.Flatten()]
        d = input_shape[0] * input_shape[1] * input_shape[2]
        for w in widths:
            layers.append(nn.Linear(d, w))
            if norm == "group":
                layers.append(group_norm(w, groups, f"layers.{len(layers)}"))
            layers.append(activation(act))
            d = w
        layers.append(nn.Linear(d, num_classes))
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)
