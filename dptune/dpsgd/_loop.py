"""The epoch loop: Poisson-sampled logical batches, split into physical chunks, one noised step each."""

from __future__ import annotations

from collections.abc import Generator, Iterable, Iterator
from dataclasses import dataclass

import torch
from opacus.optimizers import DPOptimizer
from opacus.utils.uniform_sampler import UniformWithReplacementSampler

from dptune.config import clipping
from dptune.data import augment_views
from dptune.dpsgd._state import TrialRun

__all__ = ["Chunk", "Schedule", "diverged", "epoch_chunks", "padded_rows", "padded_size", "physical_batches",
           "physical_chunk"]

Pair = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Chunk:
    """One physical chunk whose per-example gradients a trial needs: ``x`` (rows padded to ``padded_size`` and
    augmented, ``views`` per example), ``y``, and ``n_real`` real examples; the rest is zero-weight padding."""

    x: torch.Tensor
    y: torch.Tensor
    views: int
    n_real: int


@dataclass(frozen=True)
class Schedule:
    """The data-independent numbers a trial runs: q = B/basis, T steps, ceil(basis/B) steps per epoch."""

    sampling_rate: float
    steps: int
    steps_per_epoch: int
    clipping_mode: str
    views: int  # augmentation multiplicity (0: off)
    chunk: int  # examples per physical batch (the physical batch counts augmented views)
    ema_decay: float | None


def physical_chunk(physical_batch_size: int, augmult: int) -> int:
    """Examples per physical batch (the physical batch counts augmented views)."""
    return max(1, physical_batch_size // max(augmult, 1))


def padded_size(n: int) -> int:
    """Physical batches are padded to a few bucket sizes, so a trial runs a handful of batch shapes (the guard and a
    group's isolation check run every one of them) rather than a new one at nearly every Poisson step. Powers of two
    up to 8, then multiples of 4 (to 32), 8 (to 128), 16 (to 256) and 32: at most 3 padding rows below 32 (powers
    of two padded 17-31 rows to 32, and one row of ResNet-9 is about 3 % of its B = 32 step), at most 7 rows in 33
    above it (33 -> 40). Against powers of two, paired over the same 40 Poisson batches: ResNet-9's B 32 trial step
    4.3 % faster, gn_cnn's B 256 step (its chunk's rest) 2.0 % (bench/results/step_overhead.md)."""
    if n <= 8:
        return 1 << max(n - 1, 0).bit_length()
    step = 4 if n <= 32 else 8 if n <= 128 else 16 if n <= 256 else 32
    return -(-n // step) * step


def physical_batches(batches: Iterable[list[int]], chunk: int, optimizer: DPOptimizer) -> Iterator[list[int]]:
    """Each logical batch as physical batches of ``chunk`` examples and one with the rest, the optimizer told before
    each whether it ends its logical batch (Opacus' BatchSplittingSampler protocol: noise and the step only after
    the last; an empty batch is one empty physical batch). Opacus splits into near-equal parts (287 rows: 144 + 143,
    each padded to 144); full chunks and a rest (256 + 31, padded to 256 + 32) pad fewer rows and make one call at
    full width: the gn_cnn trial's step 1-3 % faster, paired (bench/results/step_overhead.md)."""
    for idx in batches:
        parts = [idx[s:s + chunk] for s in range(0, len(idx), chunk)] or [idx]
        for j, part in enumerate(parts):
            optimizer.signal_skip_step(do_skip=j < len(parts) - 1)
            yield part


def epoch_chunks(run: TrialRun, train: Pair, sched: Schedule, device: torch.device
                 ) -> Generator[Chunk, torch.Tensor, float]:
    """One epoch as a generator: it yields each physical chunk whose per-example gradients it needs, and the
    driver sends back the chunk's summed loss once they are in the engine's parameters (``run_trial``: the
    trial's own engine; ``_group``: one computation for several trials). Everything else (sampling, clipping,
    noise, the step, EMA, divergence) is the trial's own, in the same order either way. Returns the epoch's
    mean training loss (curator-side log only)."""
    x_train, y_train = train
    opt = run.engine.optimizer
    st = run.state
    epoch_steps = min(sched.steps_per_epoch, sched.steps - st.steps)
    poisson = _poisson(len(y_train), sched.sampling_rate, epoch_steps, run.streams.sampler)
    # logical Poisson batch -> physical chunks, the optimizer only steps (and adds noise) after the last chunk.
    # Ghost clipping cannot accumulate, and batch clipping's BatchNorm statistics are the logical batch's: no splitting.
    batches = physical_batches(poisson, sched.chunk, opt) if clipping.mode(sched.clipping_mode).accumulates \
        else poisson
    named = run.named_params
    loss_sum, seen = 0.0, 0
    for idx in batches:
        rows, canaries = (idx, None) if run.audit is None else run.audit.split(idx)  # audit-only split
        if len(rows) == 0:
            run.engine.empty()
        else:
            loss = yield _chunk(run, x_train, y_train, rows, sched.views, device)
            loss_sum += float(loss)  # curator-side log
        if canaries is not None:
            assert run.audit is not None
            run.audit.add_canary_gradients(run.engine, canaries)
        seen += len(idx)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if opt._is_last_step_skipped:
            continue
        st.steps += 1
        if run.audit is not None and run.audit.on_step is not None:
            run.audit.on_step(run.model)
        if run.ema is not None:
            assert sched.ema_decay is not None
            for k, p in named:
                run.ema[k].lerp_(p.detach(), 1.0 - sched.ema_decay)
    if diverged(run, x_train.shape[1:], device):
        st.diverged = True
    st.epochs_done += 1
    st.examples += seen
    return loss_sum / max(seen, 1)


@torch.no_grad()
def diverged(run: TrialRun, input_shape: tuple[int, ...], device: torch.device) -> bool:
    """Divergence is decided from the parameters after a noised step only (post-processing of DP outputs),
    never from per-example losses, which are private and outside the analysis; until it is declared, T runs
    as charged. Diverged: a non-finite parameter, or non-finite outputs on a fixed probe batch that does not
    depend on any data (an exploded model whose examples all contribute zero keeps finite parameters).
    Checked once per epoch: an exploded model stays exploded."""
    if not all(bool(torch.isfinite(p).all()) for _, p in run.named_params):
        return True
    probe = torch.randn((8, *input_shape), generator=torch.Generator().manual_seed(0)).to(device)
    was_training = run.model.training
    run.model.eval()
    out = run.model(probe)
    run.model.train(was_training)
    return not bool(torch.isfinite(out).all())


def _poisson(n: int, q: float, steps: int, generator: torch.Generator) -> Iterable[list[int]]:
    """``steps`` Poisson batches at rate q = B/basis, for any realised n (n < B, even n = 0: all batches
    empty, every step noise only): nothing here may depend on a private size being large enough."""
    if n == 0:
        return [[] for _ in range(steps)]
    return UniformWithReplacementSampler(num_samples=n, sample_rate=q, generator=generator, steps=steps)


def padded_rows(x: torch.Tensor, y: torch.Tensor, idx: list[int]) -> Pair:
    """The rows ``idx`` of (x, y), then zero rows up to ``padded_size``: the engine is told how many are real, and
    the padding rows get zero weight, dropped before clipping: they contribute exactly nothing."""
    index = torch.as_tensor(idx)
    xb, yb = x[index], y[index]
    pad = padded_size(len(idx)) - len(idx)
    if pad:
        xb = torch.cat([xb, xb.new_zeros((pad, *xb.shape[1:]))])
        yb = torch.cat([yb, yb.new_zeros(pad)])
    return xb, yb


def _chunk(run: TrialRun, x_train: torch.Tensor, y_train: torch.Tensor, idx: list[int], views: int,
           device: torch.device) -> Chunk:
    """One physical chunk, padded to a bucket size (padding contributes nothing) and augmented."""
    xb, yb = padded_rows(x_train, y_train, idx)
    if views > 0:
        xb = augment_views(xb, views, run.streams.augment)
    return Chunk(xb.to(device), yb.to(device), views, len(idx))
