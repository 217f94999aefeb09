"""A model as every trial and check builds it: BatchNorm fixed (``fix_batchnorm``) or refused, except under batch
clipping (batch statistics only), and Opacus' ``ModuleValidator`` reported by layer name. Below ``_validate``,
``_guard`` and ``_alc``, which all build models this way (no import cycle)."""

from __future__ import annotations

from opacus.utils.module_utils import trainable_modules
from opacus.validators import ModuleValidator
from opacus.validators.errors import IllegalModuleConfigurationError, ShouldReplaceModuleError
from torch import nn

from dptune.config import ConfigError, TrialConfig, clipping
from dptune.dpsgd._capture import capture
from dptune.models import batch_statistics_only, check_no_batchnorm, fix_batchnorm

__all__ = ["checked_model", "first_sentence"]


def checked_model(model: nn.Module, config: TrialConfig) -> nn.Module:
    """``model`` in training mode with BatchNorm fixed (``config.fix_batchnorm``) or refused, accepted by Opacus'
    ModuleValidator, and captured as one program (``_capture``: what trains is the graph, not the user's Python);
    ConfigError naming the offending layer or construct otherwise."""
    if config.fix_batchnorm:
        fix_batchnorm(model, config.groups)
    model.train()  # dptune trains in training mode (Opacus refuses a model in eval mode)
    if not clipping.mode(config.clipping).per_example:  # batch clipping: Opacus' per-sample validators do not apply
        return capture(batch_statistics_only(model))
    check_no_batchnorm(model)
    if ModuleValidator.validate(model, strict=False):
        _raise_by_layer(model)
    return capture(model)


def _raise_by_layer(model: nn.Module) -> None:
    """Opacus' validators, layer by layer, so the error names the layer (its own errors do not)."""
    for name, module in trainable_modules(model):
        validator = ModuleValidator.VALIDATORS.get(type(module))
        errors = validator(module) if validator is not None else []
        if errors:
            reason = first_sentence(errors[0], with_type=False)
            raise ConfigError("model", f"layer {name} ({type(module).__name__}) is refused by Opacus' "
                              f"ModuleValidator: {reason}", _fix(errors[0], type(module).__name__))
    errors = ModuleValidator.validate(model, strict=False)
    raise ConfigError("model", f"refused by Opacus' ModuleValidator: {errors[0]}", "fix the model as Opacus says")


def _fix(error: Exception, layer: str) -> str:
    if isinstance(error, ShouldReplaceModuleError):
        return (f"replace the {layer} by Opacus' drop-in DP layer (opacus.layers: DPLSTM, DPGRU, "
                "DPMultiheadAttention; opacus.validators.ModuleValidator.fix shows the replacement)")
    if isinstance(error, IllegalModuleConfigurationError):
        return f"configure the {layer} as Opacus asks (e.g. track_running_stats=False)"
    return f"replace the {layer} by a layer Opacus supports"


def first_sentence(e: Exception, with_type: bool = True) -> str:
    text = (str(e).splitlines() or [""])[0].split(". ")[0].strip().rstrip(".")
    return f"{type(e).__name__}: {text}" if with_type else text
