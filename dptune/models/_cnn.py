"""Small GroupNorm CNNs: the embedded default (digits, 8x8) and the tanh CNN of the DP-SGD MNIST
literature; both fast on CPU."""

from __future__ import annotations

import torch
from torch import nn

from dptune.config import ConfigError
from dptune.models._layers import activation, channels_last, group_norm


def _norm(norm: str, channels: int, groups: int, where: str) -> nn.Module:
    """GroupNorm (default), or BatchNorm for batch clipping (``norm: batch``; every other mode refuses it)."""
    if norm == "group":
        return group_norm(channels, groups, where)
    if norm == "batch":
        return nn.BatchNorm2d(channels)
    raise ConfigError("model.kwargs.norm", f"{norm!r} is not a normalisation", "use group or batch")


torch.fx.wrap("channels_last")  # one call in a captured program (its branch is on vmap, not on the data)

class GNCNN(nn.Module):
    """conv-GN-act x2, pool, conv-GN-act, adaptive pool, linear. Tanh: bounded activations keep
    per-sample gradient norms small, which helps DP-SGD (Papernot et al. 2021)."""

    def __init__(self, num_classes: int, input_shape: tuple[int, int, int], groups: int,
                 width: int = 32, act: str = "tanh", norm: str = "group") -> None:
        super().__init__()
        c_in = input_shape[0]
        w1, w2 = width, 2 * width
        self.features = nn.Sequential(
            nn.Conv2d(c_in, w1, 3, padding=1), _norm(norm, w1, groups, "features.1"), activation(act),
            nn.Conv2d(w1, w2, 3, padding=1), _norm(norm, w2, groups, "features.4"), activation(act),
            nn.AvgPool2d(2),
            nn.Conv2d(w2, w2, 3, padding=1), _norm(norm, w2, groups, "features.8"), activation(act),
            nn.AdaptiveAvgPool2d(2),
        )
        self.classifier = nn.Linear(4 * w2, num_classes)
        self.to(memory_format=torch.channels_last)  # see TanhCNN: a digits trial 1.14x faster

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(channels_last(x)), 1))


class TanhCNN(nn.Module):
    """The tanh CNN used for DP-SGD on MNIST by Papernot et al. (2021, "Tempered sigmoid activations")
    and Tramèr & Boneh (2021, end-to-end baseline), with a GroupNorm after each conv: conv 16 8x8 stride 2
    pad 2, max-pool 2 stride 1, conv 32 4x4 stride 2, max-pool 2 stride 1, linear 32, linear. About 26k
    parameters (28x28 inputs): one DP-SGD epoch over MNIST-sized data takes seconds on a CPU core."""

    def __init__(self, num_classes: int, input_shape: tuple[int, int, int], groups: int, hidden: int = 32,
                 norm: str = "group") -> None:
        super().__init__()
        c, h, w = input_shape
        sizes = []
        for side in (h, w):
            side = (side + 4 - 8) // 2 + 1 - 1  # conv 8x8 stride 2 pad 2, then max-pool 2 stride 1
            sizes.append((side - 4) // 2 + 1 - 1)  # conv 4x4 stride 2, then max-pool 2 stride 1
        if min(sizes) < 1:
            raise ConfigError("model", f"tanh_cnn needs inputs of at least 16x16, the data's are {h}x{w}",
                              "use gn_cnn or mlp for small inputs")
        self.features = nn.Sequential(
            nn.Conv2d(c, 16, 8, stride=2, padding=2), _norm(norm, 16, groups, "features.1"), nn.Tanh(),
            nn.MaxPool2d(2, stride=1),
            nn.Conv2d(16, 32, 4, stride=2), _norm(norm, 32, groups, "features.5"), nn.Tanh(),
            nn.MaxPool2d(2, stride=1),
        )
        self.classifier = nn.Sequential(nn.Linear(32 * sizes[0] * sizes[1], hidden), nn.Tanh(),
                                        nn.Linear(hidden, num_classes))
        # Channels-last: the 2x2 stride-1 max-pools' NCHW CPU kernel is the slowest op of the step (torch 2.14.1, 1
        # thread, B 256 on MNIST: 9 ms of a 24 ms non-private step, 3 ms channels-last). A whole trial measured 1.64x
        # faster (bench/results/trial_walltime.md). The same function; float sums differ in the last bits.
        self.to(memory_format=torch.channels_last)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(channels_last(x)), 1))
