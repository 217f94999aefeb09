"""Feature canaries: white-box canaries that are ordinary training examples, so the audit runs a clipping engine's
own code path (bookkeeping, ghost, hooks, functorch: its forward, per-example norms, clipping and noise) instead of
a hook that writes per-sample gradients beside it (the Dirac canaries of ``_canaries``).

The audited model (``FeatureCanaryModel``, built by the trial itself from ``AUDIT_MODEL``) is the trial's model
("base") plus a bias-free linear head from m canary features to the K logits, initialised to zero:

    logits(x) = base(image(x)) + W · G e_{j(x)},    W ∈ R^{K×m}, e_0 = 0.

Every input carries one extra number, its canary index j (0: none): a real example is (its image, 0); canary j is
(the all-zero image, j) with a fixed random label y_j. Then, exactly:

* column j of W has input G for canary j and 0 for every other example (real or canary): only canary j ever has a
  gradient there, so the column sees canary j's clipped gradient plus the noise and nothing else;
* canary j's per-example gradient is G δ_j on column j and Jᵀ δ_j on the base's parameters, with
  δ_j = softmax(ℓ_j) − e_{y_j}, ℓ_j = base(0) + G W_j and J = ∂base(0)/∂θ_base (the same for every canary: same
  input). Its norm² is G²‖δ_j‖² + δ_jᵀ (J Jᵀ) δ_j, so its clipped contribution to column j is c_j G δ_j with Opacus'
  factor c_j = min(1, C / (‖g_j‖ + 1e-6)): of norm a_j C, a_j = c_j G ‖δ_j‖ / C, in direction u_j = δ_j / ‖δ_j‖.
  When clipped, a_j is the column's share of the norm, at least G / √(G² + ‖J‖²) (gn_cnn at init: ‖J‖ ≈ 25, so
  ≥ 0.9997 with G = 1000); the score uses the exact a_j, not the bound.

The auditor knows every canary's input and label, so from each observed model θ_t it computes u and a per canary
(``column_directions``); the observed change of column j, in units of C and projected on u, is
x_t = b_t a_t + N(0, σ²) (b_t ∈ {0, 1}: canary j sampled at step t; the noise, σC per coordinate, is drawn after
θ_t, so its projection on a unit vector fixed by θ_t is N(0, σ²C²)); ``_observe.feature_white_box_scores`` turns
that into each canary's log-likelihood ratio. Measured (``bench/results/audit_engines.md``, ``tests/
test_audit_engines.py``): the same column sums in bookkeeping, ghost, hooks and functorch, equal to c_j G δ_j to
float32 rounding; a ≥ 0.9997 through a whole trial; projected noise 0.994σ–1.004σ, in and out.

The one-hot G e_j is built in the forward pass from the index, so a row of the training split is d + 1 numbers, not
d + m; G is large against ‖J‖ but small enough that the canary's logits G·W_j move by O(1) over a trial (column
updates are lr·(signal + noise)/B: at q = 1, B ≈ 8k, about 0.06σ per step), so softmax does not saturate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from dptune.config import TrialConfig
from dptune.data import Splits
from dptune.models import build_model

__all__ = ["AUDIT_MODEL", "FEATURE_VALUE", "FeatureCanaries", "FeatureCanaryModel", "column_directions",
           "draw_feature_canaries", "feature_audit_basis", "feature_audit_config", "feature_audit_splits",
           "feature_canary_model"]

AUDIT_MODEL = "factory:dptune.audit._features:feature_canary_model"
FEATURE_VALUE = 1000.0  # G: large against ‖J‖ (the column's share of the norm), small enough that G·ΔW stays O(1)


class FeatureCanaryModel(nn.Module):
    """``base`` plus the canary head (module docstring). Inputs: (N, 1, 1, d + 1), an image of ``image_shape``
    flattened to d features, then the canary index (rounded; 1..m: that canary; 0 or out of range: none)."""

    def __init__(self, base: nn.Module, image_shape: tuple[int, int, int], canaries: int, value: float,
                 num_classes: int) -> None:
        super().__init__()
        if canaries < 1 or not (math.isfinite(value) and value > 0):
            raise ValueError(f"need canaries >= 1 and a finite value > 0, got {canaries}, {value}")
        self.base = base
        self.canary = nn.Linear(canaries, num_classes, bias=False)
        nn.init.zeros_(self.canary.weight)  # logits of canary j start at base(0): no saturation to begin with
        self.image_shape = image_shape
        self.value = float(value)
        self.features = math.prod(image_shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.flatten(1)
        image = flat[:, :self.features].reshape(-1, *self.image_shape)
        index = flat[:, self.features].round()
        columns = torch.arange(1, self.canary.in_features + 1, device=x.device, dtype=flat.dtype)
        onehot = (index[:, None] == columns).to(flat.dtype) * self.value  # no gradient flows through the index
        return self.base(image) + self.canary(onehot)


def feature_canary_model(num_classes: int, input_shape: tuple[int, int, int], groups: int, *, base: str,
                         image_shape: list[int], canaries: int, value: float = FEATURE_VALUE,
                         base_kwargs: dict[str, Any] | None = None) -> FeatureCanaryModel:
    """The model factory of ``AUDIT_MODEL`` (dptune's ``factory:`` signature): ``base`` (a model name as in
    ``TrialConfig.model``, with ``base_kwargs``) on images of ``image_shape``, with ``canaries`` canary features."""
    shape = (int(image_shape[0]), int(image_shape[1]), int(image_shape[2]))
    if tuple(input_shape) != (1, 1, math.prod(shape) + 1):
        raise ValueError(f"inputs of shape {tuple(input_shape)} do not carry {shape} images and a canary index")
    inner = build_model(TrialConfig(model=base, groups=groups, model_kwargs=dict(base_kwargs or {})), num_classes,
                        shape)
    return FeatureCanaryModel(inner, shape, int(canaries), float(value), num_classes)


@dataclass(frozen=True, eq=False)
class FeatureCanaries:
    """m canaries: canary j (1-based in the inputs) has label ``labels[j-1]`` and is in the training split when
    ``included[j-1]``; ``value``: G."""

    labels: np.ndarray  # int64 [m]
    included: np.ndarray  # bool [m]
    value: float = FEATURE_VALUE

    @property
    def m(self) -> int:
        return len(self.labels)


def draw_feature_canaries(rng: np.random.Generator, *, canaries: int, num_classes: int,
                          value: float = FEATURE_VALUE) -> FeatureCanaries:
    """``canaries`` canaries with uniform random labels, each included by a fair coin from ``rng`` (a bench: a
    seeded or OS-entropy generator)."""
    if canaries < 1:
        raise ValueError(f"need at least one canary, got {canaries}")
    labels = rng.integers(num_classes, size=canaries).astype(np.int64)
    return FeatureCanaries(labels=labels, included=rng.random(canaries) < 0.5, value=float(value))


def feature_audit_basis(n_train: int, canaries: FeatureCanaries) -> int:
    """The data-independent size q is defined on: n + ⌊m / 2⌋ (never the realised number of included canaries)."""
    return n_train + canaries.m // 2


def feature_audit_config(config: TrialConfig, data: Splits, canaries: FeatureCanaries) -> TrialConfig:
    """``config`` with its model wrapped in the canary head (everything else, the clipping mode included, as is)."""
    if config.augmult > 0:
        raise ValueError("feature canaries need augmult 0: augmented views of a canary would move its index")
    base_kwargs = dict(config.model_kwargs)
    if config.scale_norm:
        base_kwargs.setdefault("scale_norm", True)
    return config.replace(model=AUDIT_MODEL, scale_norm=False, model_kwargs={
        "base": config.model, "image_shape": list(data.input_shape), "canaries": canaries.m,
        "value": canaries.value, "base_kwargs": base_kwargs})


def _pack(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    d = math.prod(x.shape[1:])
    return torch.cat([x.reshape(len(x), d), index.to(x.dtype)[:, None]], 1).view(len(x), 1, 1, d + 1)


def feature_audit_splits(data: Splits, canaries: FeatureCanaries) -> Splits:
    """``data`` in the audited model's input format (images flattened, canary index 0) with the included canaries
    (zero image, their index, their label) appended to the training split."""
    x, y = data.train
    chosen = np.flatnonzero(canaries.included)
    canary_x = _pack(x.new_zeros((len(chosen), *x.shape[1:])), torch.from_numpy(chosen + 1))
    train = (torch.cat([_pack(x, torch.zeros(len(y))), canary_x]),
             torch.cat([y, torch.from_numpy(canaries.labels[chosen])]))

    def plain(pair: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return _pack(pair[0], torch.zeros(len(pair[1]))), pair[1]

    shape = (1, 1, math.prod(data.input_shape) + 1)
    return Splits(train, plain(data.val), plain(data.test), data.num_classes, shape)


@torch.no_grad()
def column_directions(model: FeatureCanaryModel, labels: np.ndarray, max_grad_norm: float
                      ) -> tuple[np.ndarray, np.ndarray]:
    """At the model's parameters θ: every canary's direction u_j on its column ([m, K], unit rows) and the size
    a_j of its clipped contribution there in units of C ([m]), both float64 (module docstring)."""
    base = model.base
    names = [n for n, p in base.named_parameters() if p.requires_grad]
    params = {n: p.detach().double() for n, p in base.named_parameters()}
    buffers = {n: b.double() if b.is_floating_point() else b for n, b in base.named_buffers()}
    zero = torch.zeros((1, *model.image_shape), dtype=torch.float64)

    def logits(trained: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.func.functional_call(base, ({**params, **buffers, **trained},), (zero,))[0]

    trained = {n: params[n] for n in names}
    with torch.enable_grad():
        jac = torch.func.jacrev(logits)(trained)  # J: ∂base(0)/∂θ_base, one [K, *shape] block per parameter
    k = model.canary.out_features
    gram = sum((j.reshape(k, -1) @ j.reshape(k, -1).T for j in jac.values()), torch.zeros(k, k, dtype=torch.float64))
    g = model.value
    ell = logits(trained)[None, :] + g * model.canary.weight.detach().double().T  # [m, K]
    delta = torch.softmax(ell, 1) - F.one_hot(torch.from_numpy(labels), k).double()
    size = delta.norm(dim=1)
    norm = torch.sqrt(g**2 * size**2 + ((delta @ gram) * delta).sum(1))
    factor = (max_grad_norm / (norm + 1e-6)).clamp(max=1.0)  # Opacus' clip factor on the whole gradient
    return (delta / size[:, None]).numpy(), (factor * g * size / max_grad_norm).numpy()
