"""Several trials of one architecture trained as one computation, each exactly as if it ran alone.

A group is G trials whose model computes the same function of (parameters, input) — same model, groups, model
kwargs, augmentation multiplicity, and whole-model vmap as their clipping engine (``functorch``, or ``alc``'s
layerwise clipping on top of it); batch size, learning rate, epochs, σ, C and the optimizer may differ. Each
trial keeps everything that makes it a trial (``_trial.prepare``): its own model, DPOptimizer, noise meter, EMA,
Poisson sampler and every other random stream from its own entropy, its schedule (q, T), its checkpoint. Only
the expensive part, each physical chunk's per-example gradients, is one function for the whole group: ``vmap``
over trials (parameters stacked) of ``vmap`` over examples of ``grad`` — the functorch engine's own per-example
function with the trials' parameters as one more batch dimension. How many trials one call takes is a performance
choice (``lanes_per_call``): all of them on an accelerator; on a CPU one, and then each trial's own engine, since
there a call over several trials' chunks measured slower than each trial's engine alone (``bench/search_walltime.py``):
the group then shares the process, the data, the guard's probes and the Ray trial, not the arithmetic.

Why a trial's numbers are its own. Each vmap lane computes one example's gradient under one trial's parameters;
nothing in it sees another lane (no batch statistic, no random draw: ``randomness="error"``). The lanes' results are
handed to each trial's own engine (``p.grad_sample`` of its parameters, its real examples only), whose own optimizer
clips, sums, noises and steps exactly as in ``run_trial``. Measured (``isolation``, tests/test_group.py): a lane's
per-example gradients are bitwise the same whatever the group's size, the trial's lane and the chunk's padded size,
so a trial's result never depends on which other trials share its group (nothing about K or their configs gets
into it), and every trial of a grouped search runs this one function (a group of one included) where calls take
several trials, or its own engine where they take one (a CPU). Against the trial
alone (``run_trial`` with ``clipping: functorch``): bitwise where the batched-parameter kernels are the
per-example engine's (the MLP and the MNIST tanh CNN: the same parameters, score and measurements); within float32
rounding elsewhere (a 3x3 convolution with padding becomes a grouped convolution with another summation order:
GN-CNN, ~1e-7 per gradient coordinate), which ``isolation`` bounds at every group start.

The guard. ``_trial.prepare`` runs the clipping guard for each trial (its whole-model vmap, proven exact for the
model: each example moves its clipped sum by at most C). ``isolation`` adds what a group needs on top, on the
trials' own models: lanes equal to a group of one bitwise, one trial's example moving no other trial's gradients,
and each lane within float rounding of the engine the guard proved; a group that fails it trains its trials one at a
time with their own engines.

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
from dptune.dpsgd._loop import Chunk
from dptune.dpsgd._trial import PreparedTrial, TrialResult, prepare

__all__ = ["TrialCrash", "architecture_key", "isolation", "run_group"]

TOL_ENGINE = 1e-4  # a lane against its trial's own engine: float32 rounding of one example's gradient (of its norm)
# what a trial's model computes and how its per-example gradients are computed: trials that agree on these (and
# run whole-model vmap) can share one vmapped computation; every other field is the trial's own
ARCHITECTURE = ("model", "groups", "scale_norm", "model_kwargs", "fix_batchnorm", "augmult", "clipping")


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


def isolation(models: Sequence[nn.Module], engines: Sequence[VmapEngine], input_shape: tuple[int, ...],
              num_classes: int, views: int) -> str | None:
    """The group's guard, on synthetic inputs (no data is read), with the trials' own models: (1) each lane's
    per-example gradients in the group equal the same trial's alone through the group's function (a group of
    one), bitwise: a trial's numbers do not depend on its group; (2) changing one example of trial 0 leaves every
    other lane bitwise unchanged; (3) each lane computes its trial's own engine's per-example gradients (the
    engine the clipping guard proved exact), up to float32 rounding (``TOL_ENGINE`` of each gradient's norm).
    None when all hold, else what failed."""
    k = max(views, 1)
    gen = torch.Generator().manual_seed(20261127)
    n = 4
    p0 = next(models[0].parameters())
    xs = [torch.randn((n * k, *input_shape), generator=gen).to(dtype=p0.dtype, device=p0.device) for _ in models]
    ys = [torch.randint(0, num_classes, (n,), generator=gen).to(p0.device) for _ in models]
    lanes = _Lanes(models[0])
    try:
        grads, _ = lanes.gradients(models, [Chunk(x, y, views, n) for x, y in zip(xs, ys, strict=True)])
        changed = xs[0].clone()
        changed[:k] = torch.randn((k, *input_shape), generator=gen).to(dtype=p0.dtype, device=p0.device)
        moved, _ = lanes.gradients(models, [Chunk(x, y, views, n) for x, y in zip([changed, *xs[1:]], ys,
                                                                                  strict=True)])
        for lane, (model, engine) in enumerate(zip(models, engines, strict=True)):
            alone, _ = lanes.gradients([model], [Chunk(xs[lane], ys[lane], views, n)])
            if not all(torch.equal(g[lane], a[0]) for g, a in zip(grads, alone, strict=True)):
                return f"trial {lane}'s per-example gradients in the group differ from its own alone"
            if lane > 0 and not all(torch.equal(g[lane], m[lane]) for g, m in zip(grads, moved, strict=True)):
                return f"changing an example of trial 0 changed trial {lane}'s gradients"
            own, _ = engine._grads(tuple(p.detach() for p in engine.params), xs[lane].view(-1, k, *input_shape),
                                   ys[lane][:, None].expand(-1, k))
            diff = _row_norms([g[lane] - o for g, o in zip(grads, own, strict=True)])
            if not bool((diff <= TOL_ENGINE * (_row_norms(list(own)) + 1e-12)).all()):
                return f"trial {lane}'s per-example gradients differ from its engine's by {float(diff.max()):.3g}"
    except Exception as e:
        return f"the group's computation fails ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    return None


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
    engine, a model that draws random numbers, a failed ``isolation`` probe) trains them one at a time.

    ``lanes_per_call``: the most trials one vmapped call takes (default: all on an accelerator; 1 on a CPU, where
    ``bench/search_walltime.py`` measured a call over several trials' chunks slower than each trial's own engine).
    At 1 each trial's chunks go through its own engine: ``run_trial``'s computation, bitwise, whatever the model.
    Above 1 the group's function (``_Lanes``), whose numbers do not depend on the group (``isolation``)."""
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
    per_call = lanes_per_call if lanes_per_call is not None else (1 if dev.type == "cpu" else max(g, 1))
    lanes = _shared(trials, data, per_call)
    gens: dict[int, Generator[Chunk, torch.Tensor, None]] = {i: t.chunks(data, t0) for i, t in enumerate(trials)}
    pending: dict[int, Chunk] = {}
    for i in list(gens):
        _advance(i, gens, pending, outcomes, None)
    while pending:
        order = sorted(pending)
        losses = _round(trials, order, [pending[i] for i in order], lanes, per_call)
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


def _shared(trials: list[PreparedTrial], data: Splits, per_call: int) -> _Lanes | None:
    """The group's function when calls take several trials and the trials pass ``isolation``; None: each trial's own
    engine (at one trial per call, run_trial's computation exactly: nothing to share)."""
    if per_call <= 1 or not trials or not all(_groupable(t) for t in trials):
        return None
    failure = isolation([t.run.model for t in trials], [t.run.engine for t in trials],  # type: ignore[misc]
                        tuple(data.input_shape), data.num_classes, trials[0].sched.views)
    return _Lanes(trials[0].run.model) if failure is None else None


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
           per_call: int) -> dict[int, torch.Tensor | TrialCrash]:
    """One physical chunk of each trial in ``order``: one vmapped computation per padded chunk size and at most
    ``per_call`` trials (a lane's gradients do not depend on its company, so chunks are not padded further to share a
    call), replayed lane by lane (a group of one: bitwise the same, see ``isolation``) when it raises, so only a trial
    that raises alone crashes; without a shared computation, each trial's own engine."""
    out: dict[int, torch.Tensor | TrialCrash] = {}
    if lanes is not None:
        sizes: dict[int, list[int]] = {}
        for j, c in enumerate(chunks):
            sizes.setdefault(len(c.y), []).append(j)
        calls = [same[k:k + per_call] for same in sizes.values() for k in range(0, len(same), max(per_call, 1))]
        for same in calls:
            try:
                grads, losses = lanes.gradients([trials[order[j]].run.model for j in same], [chunks[j] for j in same])
                out.update({order[j]: _fill(trials[order[j]], grads, losses, lane, chunks[j].n_real)
                            for lane, j in enumerate(same)})
            except Exception:
                pass
    for i, c in zip(order, chunks, strict=True):
        if i in out:
            continue
        try:
            if lanes is not None:
                grads, losses = lanes.gradients([trials[i].run.model], [c])
                out[i] = _fill(trials[i], grads, losses, 0, c.n_real)
            else:
                out[i] = trials[i].run.engine.backward(c.x, c.y, c.views, c.n_real)
        except Exception as e:
            out[i] = _crash(e)
    return out
