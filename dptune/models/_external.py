"""Models from outside dptune: torchvision's classification models by name, and user factories."""

from __future__ import annotations

import importlib
from typing import Any

from torch import nn

from dptune.config import ConfigError

FACTORY_SIGNATURE = "(num_classes, input_shape, groups, **model.kwargs)"


def torchvision_model(name: str, num_classes: int, kwargs: dict[str, Any]) -> nn.Module:
    """``torchvision.models.get_model(name, weights=None, num_classes=...)``: random init, nothing
    downloaded. BatchNorm, if the model has it, is refused or replaced by the caller."""
    import torchvision.models as tvm

    names = tvm.list_models(module=tvm)  # classification models only (not detection, segmentation, ...)
    if name not in names:
        raise ConfigError("model.torchvision", f"{name!r} is not a torchvision classification model",
                          "use a name from torchvision.models.list_models(module=torchvision.models), e.g. resnet18")
    try:
        return tvm.get_model(name, weights=None, num_classes=num_classes, **kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError("model.kwargs", f"torchvision's {name} refused them ({type(e).__name__}: {e})",
                          f"give only keyword arguments of torchvision.models.{name}") from e


def factory_model(target: str, num_classes: int, input_shape: tuple[int, int, int], groups: int,
                  kwargs: dict[str, Any]) -> nn.Module:
    """``package.module:function`` called as ``function(num_classes, input_shape, groups, **kwargs)``."""
    module_name, _, attr = target.partition(":")
    fix = f"model.factory must name a function of an importable module, called as function{FACTORY_SIGNATURE}"
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # a user module's own import error is reported, not raised through
        raise ConfigError("model.factory", f"cannot import {module_name!r} ({type(e).__name__}: {e})",
                          "install the module or put it on PYTHONPATH where the search starts (the search "
                          "ships it to Ray's workers; what it imports must be installed on every node)") from e
    fn = getattr(module, attr, None)
    if fn is None:
        raise ConfigError("model.factory", f"module {module_name!r} has no {attr!r}", fix)
    if not callable(fn):
        raise ConfigError("model.factory", f"{target} is a {type(fn).__name__}, not callable", fix)
    try:
        model = fn(num_classes, input_shape, groups, **kwargs)
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError("model.factory", f"{target}{FACTORY_SIGNATURE} raised {type(e).__name__}: {e}", fix) from e
    if not isinstance(model, nn.Module):
        raise ConfigError("model.factory", f"{target} returned a {type(model).__name__}, not a torch.nn.Module", fix)
    return model
