"""Is a model fit for DP-SGD? Checked before anything is charged (:func:`validate_model`, called by the
search for every model the space can build) and again at every trial's model init (:func:`checked_model`).

Three checks, each a ConfigError naming field ``model`` (CLIs: exit 2, nothing charged):
1. BatchNorm: refused (dptune's message, naming the layer), or replaced by GroupNorm with ``fix_batchnorm``;
   under batch clipping (``clipping: batch``) it trains, normalising with each batch's own statistics only;
2. Opacus' own ``ModuleValidator`` (e.g. nn.LSTM, InstanceNorm with running stats), reported by layer name;
3. a forward and backward pass of two synthetic, data-independent inputs through the per-sample-gradient
   engine the trial will use: wrong input or output shapes, and ops the engine cannot differentiate per
   sample (in-place ops under Opacus' hooks, opacus issue #828), fail here instead of in a charged trial;
4. the clipping guard (``_guard``): the engine measured against each example alone through autograd, so one
   example provably moves the clipped sum by at most C for this model (ConfigError naming ``clipping``).
"""

from __future__ import annotations

import torch
from torch import nn

from dptune.config import ConfigError, TrialConfig, clipping
from dptune.dpsgd._checked import checked_model, first_sentence
from dptune.dpsgd._engines import make_engine
from dptune.dpsgd._guard import guarded_clipping
from dptune.models import build_model

__all__ = ["checked_model", "validate_model"]

SMOKE_EXAMPLES = 2


def validate_model(config: TrialConfig, num_classes: int, input_shape: tuple[int, int, int]) -> tuple[str, str | None]:
    """Build the model of ``config`` for the data (BatchNorm fix applied), check it (see the module
    docstring), run the smoke step and the clipping guard; ConfigError naming the field otherwise. Returns
    the clipping mode trials will run and a note when ``auto`` fell back to an exact mode. Leaves the
    caller's RNG alone."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = checked_model(build_model(config, num_classes, input_shape), config)
        _smoke_forward(model, config, num_classes, input_shape)
        mode, note = guarded_clipping(config, num_classes, input_shape)
        _smoke_backward(model, config, mode, num_classes, input_shape)  # float32, as the trial runs
        if not clipping.mode(mode).per_example:
            _smoke_score_one(model, config, num_classes, input_shape)
    return mode, note


def _smoke_score_one(model: nn.Module, config: TrialConfig, num_classes: int, shape: tuple[int, int, int]) -> None:
    """Batch clipping's score counts correct predictions one example at a time (each prediction must depend on
    its own example: sensitivity 1), in evaluation mode: a model that cannot predict one example alone would
    fail only after its training was charged."""
    x, _ = _smoke_inputs(config, num_classes, shape)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(x[:1])
    except Exception as e:
        raise ConfigError("model", f"under clipping: batch the released score predicts one example at a time (so "
                          f"that each prediction depends on its own example only), and this model fails on one "
                          f"example ({first_sentence(e)})", "make the model accept a batch of one in evaluation "
                          "mode (GroupNorm, or inputs large enough for its pooling), or use a per-example clipping "
                          "mode") from e
    finally:
        model.train(was_training)


def _smoke_inputs(config: TrialConfig, num_classes: int, shape: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    views = max(config.augmult, 1)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((SMOKE_EXAMPLES * views, *shape), generator=gen)  # synthetic: no data is read
    return x, torch.arange(SMOKE_EXAMPLES) % num_classes


def _smoke_forward(model: nn.Module, config: TrialConfig, num_classes: int, shape: tuple[int, int, int]) -> None:
    x, _ = _smoke_inputs(config, num_classes, shape)
    try:
        with torch.no_grad():
            out = model(x)
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError("model", f"a forward pass of a batch of shape {tuple(x.shape)} fails ({first_sentence(e)})",
                          f"make the model accept the dataset's C x H x W = {shape} inputs") from e
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (len(x), num_classes):
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ConfigError("model", f"its output for a batch of {len(x)} inputs is {got}",
                          f"return logits of shape (batch, {num_classes})")


def _smoke_backward(model: nn.Module, config: TrialConfig, mode: str, num_classes: int,
                    shape: tuple[int, int, int]) -> None:
    x, y = _smoke_inputs(config, num_classes, shape)
    try:
        engine = make_engine(mode, model, config, torch.Generator().manual_seed(0))
        engine.backward(x, y, max(config.augmult, 1))
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError("model", f"Opacus' per-sample gradients ({mode}) fail on it ({first_sentence(e)})",
                          "avoid in-place ops (ReLU(inplace=True), x += y) or choose another fixed.clipping "
                          "(functorch: whole-model vmap; hooks: Opacus' per-layer rules)") from e
