"""Models for DP-SGD: GroupNorm everywhere (BatchNorm mixes samples and leaks running statistics); the built-in
CNNs take ``norm: batch`` for batch clipping, the one mode that may train BatchNorm."""

from __future__ import annotations

from typing import Any, cast

from torch import nn

from dptune.config import ConfigError, TrialConfig
from dptune.models._cnn import GNCNN, TanhCNN
from dptune.models._external import factory_model, torchvision_model
from dptune.models._layers import WSConv2d, channels_last, group_norm
from dptune.models._mlp import MLP
from dptune.models._resnets import ResNet9, WideResNet

__all__ = ["WSConv2d", "batch_statistics_only", "build_model", "channels_last", "check_no_batchnorm", "count_parameters", "fix_batchnorm"]

_BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def build_model(config: TrialConfig, num_classes: int, input_shape: tuple[int, int, int]) -> nn.Module:
    """The model named by ``config.model`` for ``num_classes`` classes and C x H x W inputs: a built-in,
    ``torchvision:<name>`` or ``factory:<package.module>:<function>`` (see dptune.config.specs), with
    ``config.model_kwargs``. BatchNorm is left in place here: the trainer refuses or replaces it."""
    if num_classes < 2:
        raise ConfigError("dataset", f"{num_classes} classes", "use a dataset with at least 2 classes")
    shape = (int(input_shape[0]), int(input_shape[1]), int(input_shape[2]))
    kwargs = dict(config.model_kwargs)
    if config.model.startswith("torchvision:"):
        return torchvision_model(config.model.removeprefix("torchvision:"), num_classes, kwargs)
    if config.model.startswith("factory:"):
        return factory_model(config.model.removeprefix("factory:"), num_classes, shape, config.groups, kwargs)
    builders: dict[str, Any] = {"gn_cnn": GNCNN, "tanh_cnn": TanhCNN, "resnet9": ResNet9, "mlp": MLP,
                                "wrn16_4": lambda *a, **kw: WideResNet(*a, **{"depth": 16, "width": 4, **kw})}
    if config.model not in builders:
        raise ConfigError("model", f"unknown model {config.model!r}", "use one of: " + ", ".join(builders))
    if config.model == "resnet9":
        kwargs.setdefault("scale_norm", config.scale_norm)
    try:
        return cast(nn.Module, builders[config.model](num_classes, shape, config.groups, **kwargs))
    except TypeError as e:  # an unknown keyword of a built-in model
        raise ConfigError("model.kwargs", f"{config.model} refused them ({e})",
                          f"give only keyword arguments of the {config.model} model") from e


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def check_no_batchnorm(model: nn.Module) -> None:
    """Refuse BatchNorm: its batch statistics couple samples, so per-sample clipping bounds nothing."""
    for name, module in model.named_modules():
        if isinstance(module, _BATCHNORMS):
            raise ConfigError(
                "model",
                f"{name} is BatchNorm, incompatible with DP-SGD (cross-sample statistics, leaking running stats)",
                "set model.fix_batchnorm: true to replace it with GroupNorm, use GroupNorm, or train with "
                "fixed.clipping: batch (batch clipping, charged at twice the sensitivity)",
            )


def batch_statistics_only(model: nn.Module) -> nn.Module:
    """Every BatchNorm normalises with the statistics of the batch it is given, in training and in evaluation,
    and keeps no running statistics, in place; returns ``model``. Batch clipping bounds what one example does to
    the noised gradient, but a running mean would be an un-noised statistic of the private data carried into
    every checkpoint and release: it is never computed."""
    for module in model.modules():
        if isinstance(module, _BATCHNORMS):
            module.track_running_stats = False
            module.running_mean = None
            module.running_var = None
            module.num_batches_tracked = None
    return model


def fix_batchnorm(model: nn.Module, groups: int) -> nn.Module:
    """Replace every BatchNorm by GroupNorm(min(groups, C), C), in place; returns ``model``."""
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, _BATCHNORMS):
                full = f"{name}.{child_name}" if name else child_name
                setattr(module, child_name, group_norm(child.num_features, groups, full))
    return model
