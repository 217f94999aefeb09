"""The clipping guard: proves, for the model at hand and the engine a trial will run, that one example moves the
clipped sum by at most C in the conditions training really runs. Run before anything is charged
(``validate_model``) and at every trial start.

Why a probe and not a list of layers. dptune's guarantee rests on one invariant: in every DP-SGD step, each
example's contribution to the summed gradient, over all trainable parameters, has norm <= C. The per-layer
engines (Opacus' hooks, ghost clipping, dptune's book-keeping) compute each example's norm layer by layer and
are exact only for ordinary models. A weight used outside its module's call (a tied head), a Linear over
``(N·P, d)`` rows, a non-zero padding mode, a batch statistic outside a BatchNorm module (``h - h.mean(0)``),
an in-place op after a hooked layer, a module called twice, a subclass that transforms its weight, a batch
statistic used only from 8 rows on, a gradient rescaled by the number of rows, state kept between forward
passes: each made some mode's per-example norm or sum differ from the true one, some by far more than C.
Whole-model functorch (vmap of each example alone) is exact for the stateless ones. So the guard measures the
engine on the model instead:

First the forward pass itself (``_purity.check_forward``): a model whose forward pass writes what it saw into
its state (a buffer, an attribute: carried into the next step and released with the model), or draws random
numbers other than dropout masks, is refused. Then, on a throwaway float64 copy (seed-0 init), with noise σ = 0,
on ``EXAMPLES`` synthetic inputs of the dataset's shape from a fixed generator (no data is read; the guard's
answer is a function of the config alone), dropout masks off (``_purity.ProbeRandomness``):

1. reference: each example alone through plain autograd (its augmented views as a batch of their own, the
   trainer's mean over views; the batch holds them twice, see ``_reference``), clipped by hand at the probe's C:
   ``clip(r_i) = r_i · min(1, C / (‖r_i‖ + 1e-6))`` (Opacus' factor; alc: layer by layer at the C_l scaled to C).
   C lies between the examples' norms (some clipped, some not: a wrong norm shows as a wrong scale on the clipped
   ones, a wrong gradient on the others) and differs from the config's C (the engine must follow its own C);
2. the engine, ONE instance across every pass (as a trial runs its steps, so state kept between calls shows):
   the clipped sum S the optimizer adds its noise to (``p.summed_grad`` after ``pre_step``) for the ``EXAMPLES``
   examples (padded as the loop pads), each with one example removed, and, where the model sees the batch (every
   engine but vmap's, whose lanes each run one example), with one example added (5 rows pad to 8, 4 to 4: two
   padded sizes, so a model that changes with its batch's size shows);
3. checks, on every pass: ‖S − Σ_i count_i · clip(r_i)‖ <= TOL·C (each example contributes its own clipped
   gradient: additivity), and for each removed example ‖S(B) − S(B ∖ {j}) − clip(r_j)‖ <= TOL·C and, in
   absolute terms, ‖S(B) − S(B ∖ {j})‖ <= (1 + TOL)·C; then one full optimizer step of the real optimizer;
4. where the model sees the batch: the trial's own
   largest physical batch (``probe_rows`` examples, repeated, padded as the loop pads them), in float32 as
   training runs, on a fresh instance: S within TOL_PHYSICAL of the reference sum (relative to C + the sum of
   its terms' norms, the scale of float32's rounding).

Batch clipping (``clipping: batch``) has no per-example term to compare: its probe checks its own invariant instead
(``_batch_probe``: S(B) is the batch's clipped mean gradient, every S lies in the C-ball, one example moves it by at
most 2C, the sensitivity charged), on one engine instance across its passes too.

A mode that fails is refused (ConfigError naming ``clipping``, the measured error in units of C, and the mode that
works), or, under ``clipping: auto``, replaced by functorch; a model that fails even in functorch (it cannot
process one example alone, or keeps state between calls) is refused in every mode.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dptune.config import ConfigError, TrialConfig, clipping
from dptune.dpsgd._alc import layer_clip_norms
from dptune.dpsgd._checked import checked_model
from dptune.dpsgd._engines import ENGINES, Engine, engine_mode, make_engine, quiet_hooks, resolve_clipping
from dptune.dpsgd._loop import padded_size, physical_chunk
from dptune.dpsgd._purity import ProbeRandomness, check_forward, masks_off
from dptune.dpsgd._rows import check_program
from dptune.models import build_model

__all__ = ["ProbeResult", "guarded_clipping", "probe_rows"]

EXAMPLES = 4  # distinct synthetic examples in the probe (the large batches repeat them)
TOL = 1e-6  # in units of C, float64
# the pass at the trial's physical batch runs in float32, as training does: within TOL_PHYSICAL of the summed norms
# of its terms (plus C), the scale float32's rounding grows with (a structural error of 0.1·C per example is ~1e-3)
TOL_PHYSICAL = 1e-4
EXACT = "functorch"  # whole-model vmap: each example alone, exact for every model the reference accepts

# fields that do not change the model, the engine or the optimizer's kind: left out of the guard's cache key
# (the batch sizes enter as the probe's row count and the resolved mode; the probe picks its own C)
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


def probe_rows(config: TrialConfig, mode: str) -> int:
    """The most real examples one physical batch of a trial of ``config`` holds: the physical chunk (accumulating
    modes) or the whole logical batch, at most B + 4 sqrt(B) (the Poisson tail bound ``resolve_clipping`` uses);
    the loop pads it to ``padded_size`` rows. Data-independent."""
    b = config.batch_size
    high = math.ceil(b + 4 * math.sqrt(b))
    if clipping.mode(mode).accumulates:
        high = min(high, physical_chunk(config.physical_batch_size, config.augmult))
    return max(high, 1)


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
            with ProbeRandomness():
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


def _between(norms: list[float]) -> float:
    """A clip norm between the examples' norms (about half clipped), or below them all when they coincide."""
    positive = sorted(n for n in norms if n > 0)
    if not positive:
        return 1.0
    lo, hi = positive[(len(positive) - 1) // 2], positive[len(positive) // 2 + (len(positive) + 1) % 2]
    return math.sqrt(lo * hi) if hi > lo * (1 + 1e-3) else 0.5 * positive[0]


def _engine(mode: str, build: Build, config: TrialConfig, dtype: torch.dtype = torch.float64) -> Engine:
    engine = make_engine(mode, build().to(dtype), config, torch.Generator().manual_seed(0), noise_multiplier=0.0)
    if engine_mode(engine) != mode:
        raise RuntimeError(f"the {mode} engine cannot be built for this model (it would run {engine_mode(engine)})")
    return engine


def _clipped_sum(engine: Engine, x: torch.Tensor, y: torch.Tensor, views: int, rows: list[int],
                 step: bool = False) -> list[torch.Tensor]:
    """S(rows): the engine's clipped sum for the examples ``rows`` (indices into the probe's examples; zero padding
    rows appended as the trainer pads), as the optimizer sees it before its noise; ``step``: then one real
    optimizer step. The engine's model is the same across calls: what it keeps between passes shows."""
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

    def __init__(self, build: Build, config: TrialConfig, num_classes: int, input_shape: tuple[int, ...],
                 rows: int) -> None:
        self.build, self.rows = build, rows
        self.x, self.y, self.views = _inputs(config, num_classes, input_shape)
        ref = _reference(build, self.x, self.y, self.views)
        norms = [_norm(r) for r in ref]
        self.c = _between(norms)
        if config.max_grad_norm == self.c:  # never the config's own C: the engine must follow the C it is given
            self.c *= 1.5
        self.config = config.replace(max_grad_norm=self.c)
        if config.layer_clip is not None:  # alc: the reference clips layer by layer, C_l scaled to this C
            index, clip = layer_clip_norms(build(), config.layer_clip, self.c)
            self.clip = [_clip_layers(r, index, clip) for r in ref]
        else:
            self.clip = [[g * min(1.0, self.c / (n + 1e-6)) for g in r] for r, n in zip(ref, norms, strict=True)]
        self._results: dict[str, ProbeResult] = {}

    def run(self, mode: str) -> ProbeResult:
        if mode not in self._results:
            with quiet_hooks():  # the engines' hooks on synthetic inputs that need no gradient (and only that)
                self._results[mode] = self._measure(mode)
        return self._results[mode]

    def _pairs(self, sees_batch: bool) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
        """(B, B ∖ {j}, j): each example removed from the ``EXAMPLES`` examples, and, where the model sees the
        batch, one example added to them, which doubles the padded batch (5 rows pad to 8, 4 to 4)."""
        everyone = tuple(range(EXAMPLES))
        out = [(everyone, tuple(i for i in everyone if i != j), j) for j in everyone]
        return [*out, ((*everyone, 0), everyone, 0)] if sees_batch else out

    def _expected(self, rows: tuple[int, ...]) -> list[torch.Tensor]:
        return [sum((self.clip[r][k] for r in rows), torch.zeros_like(self.clip[0][k]))
                for k in range(len(self.clip[0]))]

    def _error(self, got: list[torch.Tensor], rows: tuple[int, ...]) -> float:
        return _norm([a - b for a, b in zip(got, self._expected(rows), strict=True)]) / self.c

    def _measure(self, mode: str) -> ProbeResult:
        c = self.c
        error = worst = large = 0.0
        try:
            engine = _engine(mode, self.build, self.config)  # one instance for every pass, as a trial runs
            sums: dict[tuple[int, ...], list[torch.Tensor]] = {}
            pairs = self._pairs(engine.sees_batch)
            order = list(dict.fromkeys(rows for full, rest, _ in pairs for rows in (full, rest)))
            for k, rows in enumerate(order):  # each pass against the stateless reference: additivity
                with ProbeRandomness():  # dropout masks off, any other random draw refused
                    # the last pass then takes one real optimizer step
                    sums[rows] = _clipped_sum(engine, self.x, self.y, self.views, list(rows), step=k == len(order) - 1)
                error = max(error, self._error(sums[rows], rows))
            for full, rest, j in pairs:  # removing one example moves the sum by its clipped gradient <= C
                moved = [a - b for a, b in zip(sums[full], sums[rest], strict=True)]
                worst = max(worst, _norm(moved) / c)
                error = max(error, _norm([a - b for a, b in zip(moved, self.clip[j], strict=True)]) / c)
            if engine.sees_batch and padded_size(self.rows) > padded_size(EXAMPLES + 1):
                large = self._physical(mode)
        except ConfigError as e:  # the engine's own refusal (a layer it knows it cannot clip exactly)
            return ProbeResult(mode, float("inf"), float("inf"), e.problem)
        except Exception as e:
            text = str(e).splitlines()[0] if str(e) else ""
            return ProbeResult(mode, float("inf"), float("inf"), f"it fails ({type(e).__name__}: {text})")
        if not (error <= TOL and worst <= 1 + TOL and large <= TOL_PHYSICAL):  # also catches NaN
            return ProbeResult(mode, error, worst, f"one example moves the clipped sum by up to "
                               f"{worst:.3g}·C and the sum differs from the per-example reference by "
                               f"{error:.3g}·C" + (f", and at the trial's physical batch of {self.rows} examples by "
                                                   f"{large:.3g} of its terms' norms" if large > TOL_PHYSICAL else ""))
        return ProbeResult(mode, error, worst, None)

    def _physical(self, mode: str) -> float:
        """The trial's largest physical batch (``rows`` examples, repeated, padded as the loop pads them) in the
        trial's own float32, on a fresh instance: the distance of its clipped sum to the reference, relative to
        C + the sum of its terms' norms."""
        engine = _engine(mode, self.build, self.config, torch.float32)
        rows = tuple(r % EXAMPLES for r in range(self.rows))
        with ProbeRandomness():
            got = _clipped_sum(engine, self.x.float(), self.y, self.views, list(rows))
        error = _norm([a.double() - b for a, b in zip(got, self._expected(rows), strict=True)])
        return error / (self.c + sum(_norm(self.clip[r]) for r in rows))  # float32 error grows with the terms


def _batch_probe(build: Build, config: TrialConfig, num_classes: int, input_shape: tuple[int, ...]) -> ProbeResult:
    """Batch clipping's invariant, measured: the engine's S(B) is the batch's mean loss gradient (plain autograd
    over the whole batch, BatchNorm statistics shared) clipped to C, and S(B), S(B ∖ {j}) lie in the ball of
    radius C, so one example moves what the noise is added to by at most 2C (the sensitivity charged)."""
    x, y, views = _inputs(config, num_classes, input_shape)
    everyone = list(range(EXAMPLES))
    m = build()
    params = [p for p in m.parameters() if p.requires_grad]
    with ProbeRandomness():
        out = m(x)
    loss = F.cross_entropy(out, y.repeat_interleave(views), reduction="none").view(EXAMPLES, views).mean(1).mean()
    ref = [torch.zeros_like(p) if g is None else g.detach()
           for p, g in zip(params, torch.autograd.grad(loss, params, allow_unused=True), strict=True)]
    norm = _norm(ref)
    c = 0.5 * norm if norm > 0 else 1.0  # the mean is clipped
    expected = [g * min(1.0, c / (norm + 1e-6)) for g in ref]
    cfg = config.replace(max_grad_norm=c)
    error = worst = 0.0
    try:
        engine = _engine("batch", build, cfg)  # one instance across the passes, as a trial runs
        with ProbeRandomness():
            full = _clipped_sum(engine, x, y, views, everyone)
        error = _norm([a - b for a, b in zip(full, expected, strict=True)]) / c
        largest = _norm(full) / c
        for j in everyone:
            with ProbeRandomness():
                rest = _clipped_sum(engine, x, y, views, [i for i in everyone if i != j])
            largest = max(largest, _norm(rest) / c)
            worst = max(worst, _norm([a - b for a, b in zip(full, rest, strict=True)]) / c)
        with ProbeRandomness():
            again = _clipped_sum(engine, x, y, views, everyone, step=True)  # the same batch again: nothing kept
        error = max(error, _norm([a - b for a, b in zip(again, expected, strict=True)]) / c)
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
        return masks_off(model.double().train())

    return build


def guarded_clipping(config: TrialConfig, num_classes: int, input_shape: tuple[int, ...]) -> tuple[str, str | None]:
    """The clipping mode a trial of ``config`` runs, proven exact for its model by the probe, and a note when
    ``auto`` fell back to functorch; ConfigError (field ``clipping``, or ``model``) when no mode may train it.
    A function of the config alone (seed-0 model, synthetic inputs): the search's pre-charge check and every
    trial start get the same answer; cached per process."""
    mode = resolve_clipping(config, basis=config.batch_size)  # the basis only bounds B: checked by the trial
    public = {k: v for k, v in config.to_dict().items() if k not in _IRRELEVANT}
    return _guarded(json.dumps(public, sort_keys=True, default=str), mode, probe_rows(config, mode), num_classes,
                    tuple(input_shape))


@functools.lru_cache(maxsize=256)
def _guarded(key: str, mode: str, rows: int, num_classes: int, input_shape: tuple[int, ...]) -> tuple[str, str | None]:
    config = TrialConfig.from_dict(json.loads(key))
    build = _builder(config, num_classes, input_shape)
    gen = torch.Generator().manual_seed(20261127)  # synthetic inputs: no data is read
    check_forward(build, torch.randn((6 * max(config.augmult, 1), *input_shape), generator=gen, dtype=torch.float64))
    sees = ENGINES[mode].sees_batch if mode in ENGINES else True
    mixing = check_program(build(), input_shape, mode, sees, refuse=config.clipping != "auto")
    note = None
    if mixing is not None and sees:  # auto: the graph does not prove row independence, so each example alone
        mode, note = EXACT, (f"clipping auto: {mode} needs a model graph that keeps the rows of a batch apart, and "
                             f"this one does not ({mixing}); {EXACT} (each example alone) runs instead")
    if not clipping.mode(mode).per_example:  # its own invariant (batch clipping: the clipped mean, <= 2C)
        with quiet_hooks():
            result = _batch_probe(build, config, num_classes, input_shape)
        if not result.exact:
            raise ConfigError("clipping", f"batch clipping is not exact for this model: {result.failure}",
                              "make the forward pass deterministic (no randomness in forward other than dropout)")
        return mode, None
    try:
        probe = _Probe(build, config, num_classes, input_shape, rows)
    except _Unfit as e:
        raise ConfigError("model", f"it cannot compute the loss of one example alone ({e}), so no clipping mode "
                          "can bound one example's effect", "make every output depend on its own input only "
                          "(no statistics across the batch: use GroupNorm, not BatchNorm or h - h.mean(0))") from e
    result = probe.run(mode)
    if result.exact:
        return mode, note
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
