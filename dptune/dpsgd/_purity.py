"""What the clipping guard checks of a model's forward pass besides its gradients: no data kept in state, no
randomness other than dropout masks.

State. A forward pass that writes what it saw into the model (a buffer, a tensor attribute, a number) carries
one batch's data into the next step (an example moves a later step's sum although it is not in that batch),
and what it wrote is an un-noised statistic of private data that ``model_state`` would release. The check:
two fresh copies of the model, one forward each on batches of different values and sizes (training mode, then
evaluation mode, as the score is computed, on the same copies); anything in the model's state that differs between the two
copies afterwards was written by the data, and the model is refused (ConfigError naming it, before any
charge). State that does not depend on the data (a call counter, a shape cache, a power-iteration vector of
the weights) is the same in both copies and allowed.

Randomness. Dropout multiplies by a mask drawn independently of the data, element by element: nothing mixes
examples, so the guard measures the model with the masks off (``ProbeRandomness`` turns torch's dropout
functions into the identity and puts torchvision's ``StochasticDepth`` in evaluation mode). Any other random
draw in forward (``randperm`` to shuffle a batch, a noise tensor) could select or mix examples: it is
refused by name, since neither the reference nor the engine can be compared under it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from dptune.config import ConfigError

__all__ = ["ProbeRandomness", "RandomOp", "check_forward", "masks_off"]

_DROPOUTS = frozenset({F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout,
                       torch.dropout, torch.alpha_dropout, torch.feature_dropout, torch.feature_alpha_dropout})
_RANDOM: dict[Any, str] = {f: f"torch.{f.__name__}" for f in (torch.rand, torch.randn, torch.randint, torch.randperm, torch.rand_like,
                                              torch.randn_like, torch.randint_like, torch.bernoulli, torch.normal,
                                              torch.multinomial, torch.poisson)}
_RANDOM.update({f: f"Tensor.{f.__name__}" for f in (torch.Tensor.bernoulli_, torch.Tensor.normal_,
                                                     torch.Tensor.uniform_, torch.Tensor.random_,
                                                     torch.Tensor.exponential_, torch.Tensor.geometric_,
                                                     torch.Tensor.cauchy_, torch.Tensor.log_normal_,
                                                     torch.Tensor.bernoulli, torch.Tensor.multinomial)})
_MODULE_INTERNALS = frozenset(vars(nn.Module()))


class RandomOp(Exception):
    """A random draw other than a dropout mask in a probed forward pass."""


class ProbeRandomness(TorchFunctionMode):
    """Dropout masks off (the identity, as dropout with p = 0), every other random draw raises ``RandomOp``."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _DROPOUTS:
            x = args[0] if args else kwargs["input"]
            return x if kwargs.get("inplace") or (len(args) > 3 and args[3]) else x.clone()
        if func in _RANDOM:
            raise RandomOp(_RANDOM[func])
        return func(*args, **kwargs)


def masks_off(model: nn.Module) -> nn.Module:
    """torchvision's StochasticDepth (a per-row or per-batch keep mask, independent of the data) in evaluation
    mode, as ``ProbeRandomness`` does for dropout; returns ``model``."""
    for m in model.modules():
        if type(m).__name__ == "StochasticDepth" and type(m).__module__.startswith("torchvision."):
            m.eval()
    return model


def _value(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.detach().clone()
    if isinstance(v, (list, tuple)):
        return tuple(_value(i) for i in v)
    if isinstance(v, dict):
        return tuple((k, _value(i)) for k, i in sorted(v.items(), key=lambda kv: str(kv[0])))
    if v is None or isinstance(v, (bool, int, float, str, complex)):
        return v
    return ("object", type(v).__name__)


def _state(model: nn.Module) -> dict[str, Any]:
    """Everything a module keeps besides its parameters and submodules: buffers and attributes."""
    out: dict[str, Any] = {}
    for name, m in model.named_modules():
        prefix = f"{name}." if name else ""
        for k, b in m._buffers.items():
            out[f"{prefix}{k} (a buffer)"] = _value(b)
        for k, v in vars(m).items():
            if k not in _MODULE_INTERNALS:
                out[f"{prefix}{k} (an attribute)"] = _value(v)
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b) or torch.allclose(
            a.double(), b.double(), rtol=0.0, atol=0.0, equal_nan=True))
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b) if type(a) is type(b) else False


def _written_by_data(models: tuple[nn.Module, nn.Module], batches: tuple[torch.Tensor, torch.Tensor], train: bool
                     ) -> list[str]:
    """The state entries that differ between two copies after one forward pass each on different data."""
    after = []
    for m, x in zip(models, batches, strict=True):
        masks_off(m.train(train))
        with ProbeRandomness(), torch.no_grad():
            m(x)
        after.append(_state(m))
    a, b = after
    return sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not _same(a[k], b[k]))


def check_forward(build: Callable[[], nn.Module], x: torch.Tensor) -> None:
    """ConfigError (field ``model``) when a forward pass keeps what it saw in the model's state, draws random
    numbers other than dropout masks, or uses a batch statistic Opacus' layers carry as an option
    (``Embedding(scale_grad_by_freq=True)``); ``x``: synthetic inputs of the data's shape (>= 6 rows)."""
    for name, m in build().named_modules():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.scale_grad_by_freq:
            raise ConfigError("model", f"layer {name} is {type(m).__name__}(scale_grad_by_freq=True): it scales each "
                              "example's gradient by how often its tokens occur in the whole batch, a statistic "
                              "across examples, so no clipping mode can bound one example's effect",
                              "set scale_grad_by_freq=False")
    batches = (x[:4], torch.flip(x, dims=(0,))[:6] * 1.5)
    models = (build(), build())
    try:
        for train in (True, False):  # the same two copies: what training wrote and evaluation then writes
            written = _written_by_data(models, batches, train)
            if written:
                raise ConfigError("model", f"its {'training' if train else 'evaluation'} forward pass writes "
                                  f"what it saw into the model: {', '.join(written[:3])} differs after a forward "
                                  "pass of other data. It would carry one batch's data into later steps and be "
                                  "released with the model as an un-noised statistic of private data",
                                  "keep no state between forward passes (compute each statistic within the example, "
                                  "or register a fixed, data-independent buffer)")
    except RandomOp as e:
        raise ConfigError("model", f"its forward pass draws random numbers ({e}) other than dropout masks: they "
                          "could select or mix examples, and no clipping mode can be checked under them",
                          "use nn.Dropout / F.dropout for random masks, or make forward deterministic") from e
