"""Several trials of one architecture trained as one computation, each exactly as if it ran alone.

A group is G trials whose model computes the same function of (parameters, input) at the same shapes — same model,
groups, model kwargs, augmentation multiplicity, physical batch size, and whole-model vmap as their clipping engine
(``functorch``, or ``alc``'s layerwise clipping on top of it); batch size, learning rate, epochs, σ, C and the
optimizer may differ. Each
trial keeps everything that makes it a trial (``_trial.prepare``): its own model, DPOptimizer, noise meter, EMA,
Poisson sampler and every other random stream from its own entropy, its schedule (q, T), its checkpoint. Only
the expensive part, each physical chunk's per-example gradients, is one function for the whole group: ``vmap``
over trials (parameters stacked) of ``vmap`` over examples of ``grad`` — the functorch engine's own per-example
function with the trials' parameters as one more batch dimension. How many trials one call takes is a performance
choice made from public constants (``lanes_per_call``, ``default_lanes``): ``ACCELERATOR_LANES`` on an accelerator;
on a CPU one, and then each trial's own engine, since there a call over several trials' chunks measured slower than
each trial's engine alone (``bench/search_walltime.py``): the group then shares the process, the data, the guard's
probes and the Ray trial, not the arithmetic.

Why a trial's numbers are its own. Each vmap lane computes one example's gradient under one trial's parameters;
nothing in it sees another lane (no batch statistic, no random draw: ``randomness="error"``). The lanes' results are
handed to each trial's own engine (``p.grad_sample`` of its parameters, its real examples only), whose own optimizer
clips, sums, noises and steps exactly as in ``run_trial``. Every shared call has the same number of lanes
(``lanes_per_call``, a public constant: ``ACCELERATOR_LANES`` on an accelerator), a call with fewer trials filled
with copies of its first, so the shape of every computation a trial takes part in depends on its own chunk sizes
alone, never on how many trials share its group: a batched kernel may sum in another order when the lane count
changes (measured on a CPU: ResNet-9, up to 8e-2 between calls of 1 and 3 lanes; bench/gpu_group.py). What is left
to a kernel, the lane a trial occupies and what the other lanes hold, is the guard's (``isolation``, at every
padded chunk size the trials can produce): a trial's per-example gradients must be bitwise the same in every lane,
beside copies of itself (a group of one) and beside other trials, or the group trains its trials one at a time
with their own engines. So a trial's result never depends on which other trials share its group (nothing about K
or their configs gets into it), and every trial of a grouped search runs this one function (a group of one
included) where calls take several trials, or its own engine where they take one (a CPU). Against the trial alone
(``run_trial`` with ``clipping: functorch``): bitwise where the batched-parameter kernels are the per-example
engine's (the MLP and the MNIST tanh CNN: the same parameters, score and measurements); within float32 rounding
elsewhere (a 3x3 convolution with padding becomes a grouped convolution with another summation order: GN-CNN,
~1e-7 per gradient coordinate), which ``engine_agrees`` bounds for each trial at every group start.

The guard. ``_trial.prepare`` runs the clipping guard for each trial (its whole-model vmap, proven exact for the
model: each example moves its clipped sum by at most C). What a group needs on top (``group_guard``), on the trials'
own models at the calls' real shapes: lanes independent of their place and their company bitwise (``isolation``; a
group that fails it trains its trials one at a time with their own engines), and each trial's lanes within float
rounding of the engine the guard proved, decided for each trial from its own model alone (``engine_agrees``: a trial
that fails it runs its own engine while the others share), so whether a trial shares never depends on its company.

Crashes. A trial whose own code raises (its forward, its optimizer, its evaluation) is that trial's crash: it
scores −∞ (``TrialCrash``), the others go on. When the group's shared computation raises, the round is replayed
lane by lane, each trial as a group of one (bitwise the same), so only a trial that raises alone crashes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dptune.config import TrialConfig
from dptune.data import Splits
from dptune.dpsgd._engines import VmapEngine
from dptune.dpsgd._loop import Chunk, padded_size
from dptune.dpsgd._trial import PreparedTrial, TrialResult, prepare

__all__ = ["ACCELERATOR_LANES", "TrialCrash", "architecture_key", "call_sizes", "default_lanes", "engine_agrees",
           "group_guard", "isolation", "run_group", "synthetic_chunk"]

# the lanes of every shared call on an accelerator: a public constant, never the group's size (which K decides);
# a call with fewer trials is filled with copies of its first (their results unused)
ACCELERATOR_LANES = 4
TOL_ENGINE = 1e-4  # a lane against its trial's own engine: float32 rounding of one example's gradient (of its norm)
# what a trial's model computes, how its per-example gradients are computed and at which shapes (the physical
# chunk): trials that agree on these (and run whole-model vmap) can share one vmapped computation, whose guard
# then probes the same shapes for every group of the architecture; every other field is the trial's own
ARCHITECTURE = ("model", "groups", "scale_norm", "model_kwargs", "fix_batchnorm", "augmult", "clipping",
                "physical_batch_size")


def default_lanes(device: torch.device) -> int:
    """``run_group``'s lanes per call on ``device`` (public: never the group's size)."""
    return 1 if device.type == "cpu" else ACCELERATOR_LANES


def architecture_key(config: TrialConfig) -> tuple[Any, ...]:
    """The public fields that decide a trial's model function and per-example computation (data-independent)."""
    d = config.to_dict()
    return tuple((k, repr(d.get(k))) for k in ARCHITECTURE)


@dataclass(frozen=True)
class TrialCrash:
    """A trial of a group whose own computation raised: it scores −∞ (a result, rule 5); ``error``: why."""

    error: str
    score: float = -math.inf


Outcome = TrialResult | TrialCrash


def _groupable(trial: PreparedTrial) -> bool:
    engine = trial.run.engine
    return isinstance(engine, VmapEngine) and type(engine).backward is VmapEngine.backward


class _Lanes:
    """The group's per-example function: ``vmap`` over trials of the functorch engine's ``vmap`` over examples."""

    def __init__(self, template: nn.Module) -> None:
        self.template = template
        self.names = [n for n, p in template.named_parameters() if p.requires_grad]
        # frozen parameters and buffers are each trial's own too (a frozen layer's init depends on its seed)
        self.rest = [n for n, p in template.named_parameters() if not p.requires_grad] + \
            [n for n, _ in template.named_buffers()]

        def loss_one(params: tuple[torch.Tensor, ...], rest: dict[str, torch.Tensor], xk: torch.Tensor,
                     yk: torch.Tensor) -> torch.Tensor:
            out = torch.func.functional_call(template, ({**dict(zip(self.names, params, strict=True)), **rest},), (xk,))
            return F.cross_entropy(out, yk)

        per_example = torch.func.vmap(torch.func.grad_and_value(loss_one), in_dims=(None, None, 0, 0),
                                      randomness="error")
        self.call = torch.func.vmap(per_example, in_dims=(0, 0, 0, 0), randomness="error")

    def gradients(self, models: Sequence[nn.Module], chunks: Sequence[Chunk]
                  ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Per-example gradients (one (G, N, ...) tensor per trainable parameter) and losses (G, N) of each
        model on its own chunk; chunks are padded with zero rows to the largest (rows are independent lanes)."""
        k = max(chunks[0].views, 1)
        rows = max(len(c.y) for c in chunks)
        xs, ys = [], []
        for c in chunks:
            pad = rows - len(c.y)
            x, y = c.x, c.y
            if pad:
                x = torch.cat([x, x.new_zeros((pad * k, *x.shape[1:]))])
                y = torch.cat([y, y.new_zeros(pad)])
            xs.append(x.view(-1, k, *x.shape[1:]))
            ys.append(y[:, None].expand(-1, k))
        state = [{**dict(m.named_parameters()), **dict(m.named_buffers())} for m in models]
        params = tuple(torch.stack([s[n].detach() for s in state]) for n in self.names)
        rest = {n: torch.stack([s[n].detach() for s in state]) for n in self.rest}
        grads, losses = self.call(params, rest, torch.stack(xs), torch.stack(ys))
        return list(grads), losses.detach()


def _fill(trial: PreparedTrial, grads: list[torch.Tensor], losses: torch.Tensor, lane: int, n_real: int
          ) -> torch.Tensor:
    """Lane ``lane``'s per-example gradients into the trial's engine, as ``VmapEngine.backward`` leaves them."""
    for p, g in zip(trial.run.engine.params, grads, strict=True):
        p.grad_sample = g[lane][:n_real]  # type: ignore[attr-defined]
    return losses[lane][:n_real].sum()


def call_sizes(trials: Sequence[PreparedTrial]) -> list[int]:
    """Every padded chunk size (rows) the trials' training can hand the group's function: a step's last chunk has
    any size from 1 to the trial's physical chunk, padded to its bucket (``_loop.padded_size``)."""
    top = max((t.sched.chunk for t in trials), default=1)
    return sorted({padded_size(n) for n in range(1, top + 1)})


def isolation(models: Sequence[nn.Module], input_shape: tuple[int, ...], num_classes: int, views: int, *,
              width: int | None = None, sizes: Sequence[int] = (4,)) -> str | None:
    """The group's part of its guard, on synthetic inputs (no data is read), with the trials' own models, at every
    call shape the group runs (``width`` lanes, as ``_round`` pads every call; each of ``sizes`` rows): (1) a
    trial's per-example gradients do not depend on its lane (the call's lanes rolled by one: bitwise the same); (2)
    nor on its company (trial 0 with every other lane a copy of itself, as a group of one's call: bitwise the same
    as in the group; another lane's examples changed: bitwise unchanged). None when both hold, else what failed.
    Each trial's own part is ``engine_agrees``; both together: ``group_guard``.

    Why the width is fixed: a batched kernel can sum in another order when the number of lanes changes (measured:
    ResNet-9 on a CPU, a lane's gradients moved by up to 8e-2 between calls of 1 and 3 lanes, where 4-row
    probes of 2 lanes saw nothing). Were the calls as wide as the group, a trial's numbers would show how many
    trials share its group, and so K."""
    g = len(models)
    width = max(width or g, 1)
    gen = torch.Generator().manual_seed(20261127)
    lanes = _Lanes(models[0])
    call_models = [models[i % g] for i in range(width)]

    def same(a: list[torch.Tensor], i: int, b: list[torch.Tensor], j: int) -> bool:
        return all(torch.equal(ga[i], gb[j]) for ga, gb in zip(a, b, strict=True))

    try:
        for n in sizes:
            chunks = [synthetic_chunk(gen, models[0], n, views, input_shape, num_classes) for _ in range(width)]
            grads, _ = lanes.gradients(call_models, chunks)
            if width > 1:
                rolled, _ = lanes.gradients(call_models[1:] + call_models[:1], chunks[1:] + chunks[:1])
                bad = next((i for i in range(width) if not same(grads, i, rolled, (i - 1) % width)), None)
                if bad is not None:
                    return f"at {n} rows a trial's per-example gradients depend on its lane ({bad} of {width})"
                solo, _ = lanes.gradients([call_models[0]] * width, [chunks[0]] * width)
                if not same(grads, 0, solo, 0):
                    return f"at {n} rows trial 0's per-example gradients depend on the trials beside it"
                changed = synthetic_chunk(gen, models[0], n, views, input_shape, num_classes)
                moved, _ = lanes.gradients(call_models, [changed, *chunks[1:]])
                bad = next((i for i in range(1, width) if not same(grads, i, moved, i)), None)
                if bad is not None:
                    return f"at {n} rows changing an example of trial 0 changed trial {bad}'s gradients"
    except Exception as e:
        return _fails(e)
    return None


def engine_agrees(model: nn.Module, engine: VmapEngine, input_shape: tuple[int, ...], num_classes: int, views: int,
                  *, width: int, rows: int) -> str | None:
    """One trial's part of the guard, from its own model alone (so whether it shares its group's calls never
    depends on the trials beside it): in a call of ``width`` lanes (copies of itself, as a group of one runs), its
    per-example gradients at ``rows`` rows are its own engine's (the engine the clipping guard proved exact) up to
    float32 rounding (``TOL_ENGINE`` of each gradient's norm). None when they are, else by how much they are not."""
    k = max(views, 1)
    gen = torch.Generator().manual_seed(20261128)  # the same synthetic inputs for every trial
    chunk = synthetic_chunk(gen, model, rows, views, input_shape, num_classes)
    try:
        got, _ = _Lanes(model).gradients([model] * width, [chunk] * width)
        own, _ = engine._grads(tuple(p.detach() for p in engine.params), chunk.x.view(-1, k, *input_shape),
                               chunk.y[:, None].expand(-1, k))
    except Exception as e:
        return _fails(e)
    diff = _row_norms([g_[0] - o for g_, o in zip(got, own, strict=True)])
    if not bool((diff <= TOL_ENGINE * (_row_norms(list(own)) + 1e-12)).all()):
        return f"a trial's per-example gradients differ from its engine's by {float(diff.max()):.3g}"
    return None


def synthetic_chunk(gen: torch.Generator, model: nn.Module, rows: int, views: int, input_shape: tuple[int, ...],
                    num_classes: int) -> Chunk:
    """A chunk of ``rows`` random examples (``views`` each) and labels from ``gen``, on ``model``'s device and dtype:
    what the group's guard and ``group_probe`` compute on (no data is read)."""
    p0 = next(model.parameters())
    x = torch.randn((rows * max(views, 1), *input_shape), generator=gen).to(dtype=p0.dtype, device=p0.device)
    return Chunk(x, torch.randint(0, num_classes, (rows,), generator=gen).to(p0.device), views, rows)


def _fails(e: BaseException) -> str:
    return f"the group's computation fails ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"


def _row_norms(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([t.reshape(len(t), -1).double().norm(dim=1) for t in ts], 1).norm(dim=1)


def run_group(
    configs: Sequence[TrialConfig],
    data: Splits,
    *,
    device: str | None = None,
    sampling_basis: float | None = None,
    charged_points: Iterable[Any] | None = None,
    checkpoint_paths: Sequence[Path | None] | None = None,
    on_epoch: Sequence[Callable[[int, dict[str, Any]], None] | None] | None = None,
    evaluate_test: bool = False,
    return_model: bool = False,
    lanes_per_call: int | None = None,
) -> list[Outcome]:
    """Train ``configs`` (one architecture: ``architecture_key``) as one computation; each trial's outcome is
    what ``run_trial`` returns for it (bitwise, under whole-model vmap), or a ``TrialCrash`` (−∞) when its own
    computation raised. Set-up failures (a charge check, a refused model) raise for the whole group before any
    data is touched, as they do in ``run_trial``. A group whose trials cannot share the computation (another
    engine, a model that draws random numbers, a failed ``isolation`` probe) trains them one at a time, and a
    trial that fails its own part of the guard (``engine_agrees``) runs its own engine beside the others.

    ``lanes_per_call``: the lanes of every vmapped call (default: ``ACCELERATOR_LANES`` on an accelerator, never
    the group's size; 1 on a CPU, where ``bench/search_walltime.py`` measured a call over several trials' chunks
    slower than each trial's own engine). At 1 each trial's chunks go through its own engine: ``run_trial``'s
    computation, bitwise, whatever the model. Above 1 the group's function (``_Lanes``), every call that wide,
    whose numbers do not depend on the group (``isolation``)."""
    t0 = time.perf_counter()
    dev = torch.device(device or "cpu")
    g = len(configs)
    if g and len({architecture_key(c) for c in configs}) > 1:
        raise ValueError("a group's trials must share one architecture (dptune.dpsgd._group.architecture_key)")
    paths = list(checkpoint_paths) if checkpoint_paths is not None else [None] * g
    hooks = list(on_epoch) if on_epoch is not None else [None] * g
    charged = list(charged_points) if charged_points is not None else None
    trials = [prepare(c, data, dev, sampling_basis=sampling_basis, charged_points=charged, checkpoint_path=p,
                      on_epoch=h) for c, p, h in zip(configs, paths, hooks, strict=True)]
    outcomes: dict[int, Outcome] = {}
    per_call = lanes_per_call if lanes_per_call is not None else default_lanes(dev)
    lanes, eligible = _shared(trials, data, per_call)
    gens: dict[int, Generator[Chunk, torch.Tensor, None]] = {i: t.chunks(data, t0) for i, t in enumerate(trials)}
    pending: dict[int, Chunk] = {}
    for i in list(gens):
        _advance(i, gens, pending, outcomes, None)
    while pending:
        order = sorted(pending)
        losses = _round(trials, order, [pending[i] for i in order], lanes, per_call, eligible)
        for i in order:
            loss = losses[i]
            if isinstance(loss, TrialCrash):
                outcomes[i] = loss
                del gens[i], pending[i]
            else:
                _advance(i, gens, pending, outcomes, loss)
    for i, t in enumerate(trials):
        if i not in outcomes:
            try:
                outcomes[i] = t.finish(data, evaluate_test, return_model, t0)
            except Exception as e:
                outcomes[i] = _crash(e)
    return [outcomes[i] for i in range(g)]


def group_guard(trials: Sequence[PreparedTrial], data: Splits, per_call: int) -> tuple[frozenset[int], str | None]:
    """Which trials share the group's calls (``per_call`` lanes wide), and the first reason any does not (None: all
    do). The group's part first (``isolation``'s lane and company checks: properties of the architecture's kernels at
    the calls' shapes, which one architecture's trials share, ``architecture_key`` holding the chunk size), then each
    trial's own (``engine_agrees``, decided from the trial alone, never from the trials beside it)."""
    if per_call <= 1:
        return frozenset(), "one trial per call: each trial's own engine"
    if not trials or not all(_groupable(t) for t in trials):
        return frozenset(), "an engine other than whole-model vmap"
    views, shape, sizes = trials[0].sched.views, tuple(data.input_shape), call_sizes(trials)
    failure = isolation([t.run.model for t in trials], shape, data.num_classes, views, width=per_call, sizes=sizes)
    if failure is not None:
        return frozenset(), failure
    why = [engine_agrees(t.run.model, t.run.engine, shape, data.num_classes, views,  # type: ignore[arg-type]
                         width=per_call, rows=max(sizes)) for t in trials]
    return (frozenset(i for i, w in enumerate(why) if w is None),
            next((f"trial {i}: {w}" for i, w in enumerate(why) if w is not None), None))


def _shared(trials: list[PreparedTrial], data: Splits, per_call: int) -> tuple[_Lanes | None, frozenset[int]]:
    """The group's function and the trials that run it (``group_guard``); (None, {}): each trial's own engine (at
    one trial per call, run_trial's computation exactly: nothing to share)."""
    eligible, _ = group_guard(trials, data, per_call)
    return (_Lanes(trials[0].run.model) if eligible else None), eligible


def _crash(e: BaseException) -> TrialCrash:
    text = str(e).splitlines()[0] if str(e) else ""
    return TrialCrash(f"{type(e).__name__}: {text}"[:500])


def _advance(i: int, gens: dict[int, Generator[Chunk, torch.Tensor, None]], pending: dict[int, Chunk],
             outcomes: dict[int, Outcome], loss: torch.Tensor | None) -> None:
    """Run trial ``i`` to its next chunk (or its end); its own exception is its crash."""
    try:
        pending[i] = next(gens[i]) if loss is None else gens[i].send(loss)
        return
    except StopIteration:
        pass
    except Exception as e:
        outcomes[i] = _crash(e)
    pending.pop(i, None)
    del gens[i]


def _round(trials: list[PreparedTrial], order: list[int], chunks: list[Chunk], lanes: _Lanes | None,
           per_call: int, eligible: frozenset[int] = frozenset()) -> dict[int, torch.Tensor | TrialCrash]:
    """One physical chunk of each trial in ``order``: one vmapped computation per padded chunk size and at most
    ``per_call`` trials, every call ``per_call`` lanes wide (filled with copies of its first trial, their results
    unused: a call's shape never shows the group), replayed trial by trial (a group of one, filled the same way:
    bitwise the same, see ``isolation``) when it raises, so only a trial that raises alone crashes; without a
    shared computation (or for a trial not ``eligible`` for it), its own engine."""
    out: dict[int, torch.Tensor | TrialCrash] = {}
    if lanes is not None:
        sizes: dict[int, list[int]] = {}
        for j, c in enumerate(chunks):
            if order[j] in eligible:
                sizes.setdefault(len(c.y), []).append(j)
        calls = [same[k:k + per_call] for same in sizes.values() for k in range(0, len(same), max(per_call, 1))]
        for same in calls:
            try:
                wide = same + [same[0]] * (per_call - len(same))  # per_call lanes: its shape never shows the group
                grads, losses = lanes.gradients([trials[order[j]].run.model for j in wide], [chunks[j] for j in wide])
                out.update({order[j]: _fill(trials[order[j]], grads, losses, lane, chunks[j].n_real)
                            for lane, j in enumerate(same)})
            except Exception:
                pass
    for i, c in zip(order, chunks, strict=True):
        if i in out:
            continue
        try:
            if lanes is not None and i in eligible:
                grads, losses = lanes.gradients([trials[i].run.model] * per_call, [c] * per_call)
                out[i] = _fill(trials[i], grads, losses, 0, c.n_real)
            else:
                out[i] = trials[i].run.engine.backward(c.x, c.y, c.views, c.n_real)
        except Exception as e:
            out[i] = _crash(e)
    return out
