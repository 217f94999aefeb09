"""The clipping guard: proves, for the model at hand and the engine a trial will run, that one example moves the
clipped sum by at most C. Run before anything is charged (``validate_model``) and at every trial start.

Why a probe and not a list of layers. dptune's guarantee rests on one invariant: in every DP-SGD step, each
example's contribution to the summed gradient, over all trainable parameters, has norm <= C. The per-layer
engines (Opacus' hooks, ghost clipping, dptune's book-keeping) compute each example's norm layer by layer and
are exact only for ordinary models. A weight used outside its module's call (a tied head), a Linear over
``(N·P, d)`` rows, a non-zero padding mode, a batch statistic outside a BatchNorm module (``h - h.mean(0)``),
an in-place op after a hooked layer, a module called twice, a subclass that transforms its weight: each made some
mode's per-example norm or sum differ from the true one, some by far more than C. Whole-model functorch (vmap of
each example alone) is exact for all of them. So the guard measures the engine on the model instead:

On a throwaway float64 copy (seed-0 init), with noise σ = 0 and a clip norm C below every example's gradient norm
(so every example is clipped and a wrong norm shows as a wrong scale), on ``EXAMPLES`` synthetic inputs of the
dataset's shape from a fixed generator (no data is read; the guard's answer is a function of the config alone):

1. reference: each example alone through plain autograd (its augmented views as a batch of their own, the
   trainer's mean over views; the batch holds them twice, see ``_reference``), clipped by hand: ``clip(r_i) = r_i · min(1, C / (‖r_i‖ + 1e-6))`` (Opacus' factor);
2. the engine: the clipped sum S(B) the optimizer adds its noise to (``p.summed_grad`` after ``pre_step``) for
   the physical batch B (3 examples padded by a zero row to 4, as the trainer pads), and S(B ∖ {j}) for each j;
3. checks: ‖S(B) − Σ_i clip(r_i)‖ <= TOL·C (each example contributes its own clipped gradient: additivity), and
   ‖S(B) − S(B ∖ {j}) − clip(r_j)‖ <= TOL·C for every j (removing one example moves the sum by exactly its
   clipped gradient, so by at most C); then one full optimizer step of the real optimizer on the copy.

Batch clipping (``clipping: batch``) has no per-example term to compare: its probe checks its own invariant instead
(``_batch_probe``: S(B) is the batch's clipped mean gradient, every S lies in the C-ball, one example moves it by at
most 2C, the sensitivity charged).

A mode that fails is refused (ConfigError naming ``clipping``, the measured error in units of C, and the mode that
works), or, under ``clipping: auto``, replaced by functorch; a model that fails even in functorch (it cannot
process one example alone) is refused in every mode.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dptune import clipping
from dptune.config import ConfigError, TrialConfig
from dptune.dpsgd._alc import layer_clip_norms
from dptune.dpsgd._checked import checked_model
from dptune.dpsgd._engines import Engine, engine_mode, make_engine, quiet_hooks, resolve_clipping
from dptune.dpsgd._loop import padded_size
from dptune.models import build_model

__all__ = ["ProbeResult", "guarded_clipping"]

EXAMPLES = 3  # real examples in the probe batch (plus one padding row)
TOL = 1e-6  # in units of C, float64
EXACT = "functorch"  # whole-model vmap: each example alone, exact for every model the reference accepts

# fields that do not change the model, the engine or the optimizer's kind: left out of the guard's cache key
# (batch sizes only choose between ghost and hooks: the resolved mode is part of the key instead)
_IRRELEVANT = ("seed", "learning_rate", "noise_multiplier", "max_grad_norm", "epochs", "score_noise", "ema_decay",
               "weight_decay", "momentum", "batch_size", "physical_batch_size")


@dataclass(frozen=True)
class ProbeResult:
    """What the probe measured for one mode: ``error`` = max over the checks of the distance to the reference,
    in units of C; ``worst_contribution`` = the largest ‖S(B) − S(B ∖ {j})‖ / C; ``failure``: why not exact."""

    mode: str
    error: float
    worst_contribution: float
    failure: str | None

    @property
    def exact(self) -> bool:
        return self.failure is None


class _Unfit(Exception):
    """The model cannot process one example alone: no mode can give it per-example gradients."""


def _inputs(config: TrialConfig, num_classes: int, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, int]:
    views = max(config.augmult, 1)
    gen = torch.Generator().manual_seed(20261125)  # synthetic inputs: no data is read
    x = torch.randn((EXAMPLES * views, *shape), generator=gen, dtype=torch.float64)
    y = torch.randint(0, num_classes, (EXAMPLES,), generator=gen)
    return x, y, views


Build = Callable[[], nn.Module]  # a fresh float64 copy of the model, same weights each call


def _reference(build: Build, x: torch.Tensor, y: torch.Tensor, views: int) -> list[list[torch.Tensor]]:
    """Each example alone through plain autograd: the gradient of the mean loss over its views. The example
    goes in twice (the mean over two identical copies has the same gradient for a model that treats examples
    separately): PyTorch refuses some batches of one outright (GroupNorm with one channel per group and no
    spatial dims checks its batch as BatchNorm would), although nothing crosses examples there."""
    out = []
    for i in range(len(y)):
        m = build()
        params = [p for p in m.parameters() if p.requires_grad]
        try:
            xi = x[i * views:(i + 1) * views]
            loss = F.cross_entropy(m(torch.cat([xi, xi])), y[i].repeat(2 * views))
            grads = torch.autograd.grad(loss, params, allow_unused=True)
        except Exception as e:
            raise _Unfit(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
        out.append([torch.zeros_like(p) if g is None else g.detach() for p, g in zip(params, grads, strict=True)])
    return out


def _clip_layers(grads: list[torch.Tensor], index: list[int], clip: list[float]) -> list[torch.Tensor]:
    """One example's gradient clipped layer by layer (each layer's parameters jointly to its C_l)."""
    out = list(grads)
    for layer, c in enumerate(clip):
        cols = [j for j, k in enumerate(index) if k == layer]
        n = _norm([grads[j] for j in cols])
        for j in cols:
            out[j] = grads[j] * min(1.0, c / (n + 1e-6))
    return out


def _norm(ts: list[torch.Tensor]) -> float:
    return float(torch.sqrt(sum((t.double() ** 2).sum() for t in ts)))  # type: ignore[arg-type]


def _clipped_sum(mode: str, build: Build, config: TrialConfig, x: torch.Tensor, y: torch.Tensor,
                 views: int, rows: list[int], step: bool = False) -> list[torch.Tensor]:
    """S(rows): the engine's clipped sum for the examples ``rows`` (zero padding rows appended as the trainer pads), as the
    optimizer sees it before its noise; ``step``: then one real optimizer step."""
    m = build()
    engine: Engine = make_engine(mode, m, config, torch.Generator().manual_seed(0), noise_multiplier=0.0)
    if engine_mode(engine) != mode:
        raise RuntimeError(f"the {mode} engine cannot be built for this model (it would run {engine_mode(engine)})")
    idx = torch.as_tensor([r * views + v for r in rows for v in range(views)], dtype=torch.long)
    pad = padded_size(len(rows)) - len(rows)  # zero rows, as the trainer pads its physical batches
    xb = torch.cat([x[idx], x.new_zeros((pad * views, *x.shape[1:]))])
    yb = torch.cat([y[torch.as_tensor(rows, dtype=torch.long)], y.new_zeros(pad)])
    engine.backward(xb, yb, views, len(rows))
    opt = engine.optimizer
    opt.pre_step()
    sums = []
    for p in engine.params:
        s = getattr(p, "summed_grad", None)
        if s is None:
            raise RuntimeError("a trainable parameter received no clipped gradient (and so no noise)")
        sums.append(s.detach().view_as(p).clone())
    if step:
        opt.original_optimizer.step()
        if not all(bool(torch.isfinite(p).all()) for p in engine.params):
            raise RuntimeError("one optimizer step made a parameter non-finite")
    opt.zero_grad(set_to_none=True)
    return sums


class _Probe:
    """One model's per-example reference, computed once (raises ``_Unfit`` when the model cannot process one
    example alone); ``run(mode)`` measures an engine against it (see the module docstring), each mode once."""

    def __init__(self, build: Build, config: TrialConfig, num_classes: int, input_shape: tuple[int, ...]) -> None:
        self.build = build
        self.x, self.y, self.views = _inputs(config, num_classes, input_shape)
        ref = _reference(build, self.x, self.y, self.views)
        norms = [_norm(r) for r in ref]
        positive = [n for n in norms if n > 0]
        self.c = 0.5 * min(positive) if positive else 1.0  # every example clipped
        self.clip = [[g * min(1.0, self.c / (n + 1e-6)) for g in r] for r, n in zip(ref, norms, strict=True)]
        self.config = config.replace(max_grad_norm=self.c)
        if config.layer_clip is not None:  # alc: the reference clips layer by layer, C_l scaled with C
            scaled = {k: v * self.c / config.max_grad_norm for k, v in config.layer_clip.items()}
            index, clip = layer_clip_norms(build(), scaled)
            self.clip = [_clip_layers(r, index, clip) for r in ref]
            self.config = self.config.replace(layer_clip=scaled)
        self._results: dict[str, ProbeResult] = {}

    def run(self, mode: str) -> ProbeResult:
        if mode not in self._results:
            with quiet_hooks():  # the engines' hooks on synthetic inputs that need no gradient (and only that)
                self._results[mode] = self._measure(mode)
        return self._results[mode]

    def _sum(self, mode: str, rows: list[int], step: bool = False) -> list[torch.Tensor]:
        return _clipped_sum(mode, self.build, self.config, self.x, self.y, self.views, rows, step=step)

    def _measure(self, mode: str) -> ProbeResult:
        c, everyone = self.c, list(range(EXAMPLES))
        error = worst = 0.0
        try:
            full = self._sum(mode, everyone, step=True)
            expected = [sum(parts) for parts in zip(*self.clip, strict=True)]
            error = _norm([a - b for a, b in zip(full, expected, strict=True)]) / c
            for j in everyone:
                rest = self._sum(mode, [i for i in everyone if i != j])
                moved = [a - b for a, b in zip(full, rest, strict=True)]
                worst = max(worst, _norm(moved) / c)
                error = max(error, _norm([a - b for a, b in zip(moved, self.clip[j], strict=True)]) / c)
        except ConfigError as e:  # the engine's own refusal (a layer it knows it cannot clip exactly)
            return ProbeResult(mode, float("inf"), float("inf"), e.problem)
        except Exception as e:
            text = str(e).splitlines()[0] if str(e) else ""
            return ProbeResult(mode, float("inf"), float("inf"), f"it fails ({type(e).__name__}: {text})")
        if not error <= TOL:  # also catches NaN
            return ProbeResult(mode, error, worst, f"one example moves the clipped sum by up to {worst:.3g}·C and "
                               f"the sum differs from the per-example reference by {error:.3g}·C")
        return ProbeResult(mode, error, worst, None)


def _batch_probe(build: Build, config: TrialConfig, num_classes: int, input_shape: tuple[int, ...]) -> ProbeResult:
    """Batch clipping's invariant, measured: the engine's S(B) is the batch's mean loss gradient (plain autograd
    over the whole batch, BatchNorm statistics shared) clipped to C, and S(B), S(B ∖ {j}) lie in the ball of
    radius C, so one example moves what the noise is added to by at most 2C (the sensitivity charged)."""
    x, y, views = _inputs(config, num_classes, input_shape)
    everyone = list(range(EXAMPLES))
    m = build()
    params = [p for p in m.parameters() if p.requires_grad]
    loss = F.cross_entropy(m(x), y.repeat_interleave(views), reduction="none").view(EXAMPLES, views).mean(1).mean()
    ref = [torch.zeros_like(p) if g is None else g.detach()
           for p, g in zip(params, torch.autograd.grad(loss, params, allow_unused=True), strict=True)]
    norm = _norm(ref)
    c = 0.5 * norm if norm > 0 else 1.0  # the mean is clipped
    expected = [g * min(1.0, c / (norm + 1e-6)) for g in ref]
    cfg = config.replace(max_grad_norm=c)
    error = worst = 0.0
    try:
        full = _clipped_sum("batch", build, cfg, x, y, views, everyone, step=True)
        error = _norm([a - b for a, b in zip(full, expected, strict=True)]) / c
        largest = _norm(full) / c
        for j in everyone:
            rest = _clipped_sum("batch", build, cfg, x, y, views, [i for i in everyone if i != j])
            largest = max(largest, _norm(rest) / c)
            worst = max(worst, _norm([a - b for a, b in zip(full, rest, strict=True)]) / c)
    except Exception as e:
        text = str(e).splitlines()[0] if str(e) else ""
        return ProbeResult("batch", float("inf"), float("inf"), f"it fails ({type(e).__name__}: {text})")
    if not (error <= TOL and largest <= 1 + TOL and worst <= 2 + TOL):
        return ProbeResult("batch", error, worst, f"the clipped mean differs from the reference by "
                           f"{error:.3g}·C, has norm up to {largest:.3g}·C, and one example moves it by {worst:.3g}·C")
    return ProbeResult("batch", error, worst, None)


def _builder(config: TrialConfig, num_classes: int, input_shape: tuple[int, ...]) -> Build:
    """Fresh float64 models of ``config``, seed-0 init (rebuilt, not deep-copied: legacy weight_norm's computed
    weight cannot be copied)."""

    def build() -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = checked_model(build_model(config, num_classes, input_shape), config)  # type: ignore[arg-type]
        return model.double().train()

    return build


def guarded_clipping(config: TrialConfig, num_classes: int, input_shape: tuple[int, ...]) -> tuple[str, str | None]:
    """The clipping mode a trial of ``config`` runs, proven exact for its model by the probe, and a note when
    ``auto`` fell back to functorch; ConfigError (field ``clipping``, or ``model``) when no mode may train it.
    A function of the config alone (seed-0 model, synthetic inputs): the search's pre-charge check and every
    trial start get the same answer; cached per process."""
    mode = resolve_clipping(config, basis=config.batch_size)  # the basis only bounds B: checked by the trial
    public = {k: v for k, v in config.to_dict().items() if k not in _IRRELEVANT}
    return _guarded(json.dumps(public, sort_keys=True, default=str), mode, num_classes, tuple(input_shape))


@functools.lru_cache(maxsize=256)
def _guarded(key: str, mode: str, num_classes: int, input_shape: tuple[int, ...]) -> tuple[str, str | None]:
    config = TrialConfig.from_dict(json.loads(key))
    if not clipping.mode(mode).per_example:  # its own invariant (batch clipping: the clipped mean, <= 2C)
        with quiet_hooks():
            result = _batch_probe(_builder(config, num_classes, input_shape), config, num_classes, input_shape)
        if not result.exact:
            raise ConfigError("clipping", f"batch clipping is not exact for this model: {result.failure}",
                              "make the forward pass deterministic (no dropout or other randomness in forward)")
        return mode, None
    try:
        probe = _Probe(_builder(config, num_classes, input_shape), config, num_classes, input_shape)
    except _Unfit as e:
        raise ConfigError("model", f"it cannot compute the loss of one example alone ({e}), so no clipping mode "
                          "can bound one example's effect", "make every output depend on its own input only "
                          "(no statistics across the batch: use GroupNorm, not BatchNorm or h - h.mean(0))") from e
    result = probe.run(mode)
    if result.exact:
        return mode, None
    if mode == EXACT or clipping.mode(mode).layerwise:  # alc runs whole-model vmap too: nothing more exact
        raise ConfigError("model", f"even per-example functorch gradients do not match the per-example reference "
                          f"({result.failure})", "make every output depend on its own input only (no statistics "
                          "across the batch, no randomness in forward)")
    exact = probe.run(EXACT).exact
    if config.clipping == "auto" and exact:
        return EXACT, (f"clipping auto: {mode} is not exact for this model ({result.failure}); "
                       f"{EXACT} (each example alone) runs instead")
    fix = (f"set fixed.clipping: {EXACT} (whole-model vmap: exact for this model)" if exact else
           "make every output depend on its own input only (no statistics across the batch: use GroupNorm)")
    raise ConfigError("clipping", f"{mode} clipping is not exact for this model: {result.failure}", fix)
