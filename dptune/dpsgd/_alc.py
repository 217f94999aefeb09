"""Adaptive layerwise clipping (``clipping: alc``; van Dijk et al. 2023, arXiv 2307.11939): one clip norm per layer.

A layer is a module owning trainable parameters (its weight and bias clip together). Each layer's clip norm C_l
comes from a **public** dataset only: the model of the config at its seed-0 initialisation (no data involved),
each public example's gradient alone (whole-model vmap), the ``quantile`` of each layer's per-example norms, then
all scaled so that sqrt(Σ C_l²) = max_grad_norm. The engine rescales them to each trial's own C (a searched
``max_grad_norm``, the final run's C), so sqrt(Σ C_l²) = C wherever they are used. During training each example's
gradient is clipped layer by layer (factor min(1, C_l / ‖g_l‖) per layer), so the whole clipped gradient has norm <= sqrt(Σ C_l²) = C: the
sensitivity, noise and charge of flat clipping at C. Nothing here reads the private data.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dptune.config import ConfigError, TrialConfig
from dptune.dpsgd._checked import checked_model
from dptune.dpsgd._engines import Engine, VmapEngine, engine
from dptune.dpsgd._optim import ClippingDPOptimizer

__all__ = ["LayerwiseEngine", "layer_clip_norms", "layer_constants", "layer_of", "public_examples", "resized"]


def layer_of(name: str) -> str:
    """The layer (owning module) of parameter ``name``: ``features.0.weight`` -> ``features.0``."""
    return name.rsplit(".", 1)[0] if "." in name else name


def layer_clip_norms(model: nn.Module, layer_clip: dict[str, float], max_grad_norm: float
                     ) -> tuple[list[int], list[float]]:
    """Each trainable parameter's layer index (``model.parameters()`` order) and each layer's C_l, scaled so that
    sqrt(Σ C_l²) = ``max_grad_norm``: the trial's own C, whatever C the constants were computed for (a searched
    C would otherwise keep the C_l of another C while the noise follows its own); ConfigError when the constants
    were computed for another model."""
    names = [layer_of(n) for n, p in model.named_parameters() if p.requires_grad]
    missing = sorted(set(names) - set(layer_clip))
    extra = sorted(set(layer_clip) - set(names))
    if missing or extra:
        raise ConfigError("layer_clip", f"the per-layer clip norms name other layers than the model's "
                          f"(missing {missing[:3]}, unknown {extra[:3]})", "let alc compute them for this model")
    layers = list(dict.fromkeys(names))
    shares = [float(layer_clip[n]) for n in layers]
    total = math.sqrt(sum(v * v for v in shares))
    if not (math.isfinite(total) and total > 0 and all(v > 0 for v in shares)):
        raise ConfigError("layer_clip", "the per-layer clip norms must be positive and finite",
                          "let alc compute them for this model")
    return [layers.index(n) for n in names], [v * max_grad_norm / total for v in shares]


def layer_constants(config: TrialConfig, public: tuple[torch.Tensor, torch.Tensor], num_classes: int,
                    quantile: float, examples: int) -> dict[str, float]:
    """Per-layer clip norms for ``config``'s model from the public examples ``public`` (inputs already of the
    private data's shape), scaled to sqrt(Σ C_l²) = ``config.max_grad_norm``."""
    from dptune.models import build_model

    x, y = public
    keep = y < num_classes  # a public example's label must be one of the model's outputs
    x, y = x[keep][:examples].float(), y[keep][:examples].long()
    if len(y) < 2:
        raise ConfigError("alc.public", f"has {len(y)} examples with one of the model's {num_classes} labels",
                          "use a public dataset with at least 2 examples labelled like the private data")
    flat = config.replace(clipping="functorch", layer_clip=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = checked_model(build_model(flat, num_classes, tuple(x.shape[1:])), flat)  # type: ignore[arg-type]
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = {n: p.detach() for n, p in named}
    buffers = dict(model.named_buffers())

    def loss_one(ps: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        out = torch.func.functional_call(model, ({**ps, **buffers},), (xi.unsqueeze(0),))
        return F.cross_entropy(out, yi.unsqueeze(0))

    per_example = torch.func.vmap(torch.func.grad(loss_one), in_dims=(None, 0, 0), randomness="different")
    sq: dict[str, list[torch.Tensor]] = {}
    with torch.no_grad():
        for i in range(0, len(y), 128):
            grads = per_example(params, x[i:i + 128], y[i:i + 128])
            rows: dict[str, torch.Tensor] = {}
            for n, g in grads.items():
                rows[layer_of(n)] = rows.get(layer_of(n), 0) + g.reshape(len(g), -1).double().square().sum(1)
            for layer, r in rows.items():
                sq.setdefault(layer, []).append(r)
    med = {layer: float(torch.quantile(torch.cat(r).sqrt(), quantile)) for layer, r in sq.items()}
    floor = 1e-6 * max(max(med.values()), 1e-12)  # a layer with zero gradients still gets a (tiny) share
    med = {k: max(v, floor) for k, v in med.items()}
    scale = config.max_grad_norm / math.sqrt(sum(v * v for v in med.values()))
    return {k: v * scale for k, v in med.items()}


def resized(x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Public images resized (bilinear) and channel-matched to the private data's C x H x W."""
    if tuple(x.shape[1:]) == tuple(shape):
        return x
    c, h, w = shape
    out = F.interpolate(x.float(), size=(h, w), mode="bilinear", align_corners=False)
    if out.shape[1] != c:
        out = out.mean(1, keepdim=True).expand(-1, c, -1, -1).contiguous()
    return out


def public_examples(spec: Any, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The public dataset's training split, resized to ``shape``."""
    from dptune.data import load_dataset

    data = load_dataset(spec)
    return resized(data.train[0], shape), data.train[1]


@engine("alc")
class LayerwiseEngine(VmapEngine):
    """Adaptive layerwise clipping: whole-model vmap per-example gradients (exact for any model), each example's
    gradient clipped layer by layer to the config's C_l (``ClippingDPOptimizer.layer_clip``; see ``_alc``)."""

    @classmethod
    def build(cls, model: nn.Module, base: torch.optim.Optimizer, kw: dict[str, Any], config: TrialConfig) -> Engine:
        if config.layer_clip is None:
            raise ConfigError("layer_clip", "clipping alc has no per-layer clip norms", "give the space an alc: "
                              "section (dptune.search computes them from its public data before anything runs)")
        opt = ClippingDPOptimizer(base, **kw)
        opt.layer_clip = layer_clip_norms(model, config.layer_clip, config.max_grad_norm)
        return cls(model, opt)
