"""The epoch loop: Poisson-sampled logical batches, split into physical chunks, one noised step each."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from opacus.utils.batch_memory_manager import BatchSplittingSampler
from opacus.utils.uniform_sampler import UniformWithReplacementSampler

from dptune.data._augment import augment_views
from dptune.dpsgd._state import TrialRun

__all__ = ["Schedule", "padded_size", "train_epoch"]

Pair = tuple[torch.Tensor, torch.Tensor]


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


def padded_size(n: int) -> int:
    """Physical batches are padded to a few bucket sizes: every new batch shape costs oneDNN a fresh
    kernel (~0.1 s on CPU), and Poisson batches would otherwise have a new size at nearly every step."""
    return 1 << max(n - 1, 0).bit_length() if n <= 32 else -(-n // 32) * 32


def train_epoch(run: TrialRun, train: Pair, sched: Schedule, device: torch.device) -> float:
    """One epoch (or what is left of T); returns the mean training loss (curator-side log only)."""
    x_train, y_train = train
    opt = run.engine.optimizer
    st = run.state
    epoch_steps = min(sched.steps_per_epoch, sched.steps - st.steps)
    poisson = UniformWithReplacementSampler(num_samples=len(y_train), sample_rate=sched.sampling_rate,
                                            generator=run.streams.sampler, steps=epoch_steps)
    # BatchMemoryManager's splitter: logical Poisson batch -> physical chunks, the optimizer only
    # steps (and adds noise) after the last chunk. Ghost clipping cannot accumulate: no splitting.
    batches = poisson if sched.clipping_mode == "ghost" else BatchSplittingSampler(
        sampler=poisson, max_batch_size=sched.chunk, optimizer=opt)
    named = run.named_params
    loss_sum, seen = 0.0, 0
    for idx in batches:
        if len(idx) == 0:
            run.engine.empty()
        else:
            loss = _backward(run, x_train, y_train, idx, sched.views, device)
            loss_sum += float(loss)
            seen += len(idx)
            if not torch.isfinite(loss):
                st.diverged = True
        opt.step()
        opt.zero_grad(set_to_none=True)
        if opt._is_last_step_skipped:
            continue
        st.steps += 1
        if run.ema is not None:
            assert sched.ema_decay is not None
            for k, p in named:
                run.ema[k].lerp_(p.detach(), 1.0 - sched.ema_decay)
        if st.diverged:
            break
    if not all(bool(torch.isfinite(p).all()) for _, p in named):
        st.diverged = True
    st.epochs_done += 1
    st.examples += seen
    return loss_sum / max(seen, 1)


def _backward(run: TrialRun, x_train: torch.Tensor, y_train: torch.Tensor, idx: list[int], views: int,
              device: torch.device) -> torch.Tensor:
    """Per-example gradients of one physical chunk (padded to a bucket size; padding contributes nothing)."""
    index = torch.as_tensor(idx)
    xb, yb = x_train[index], y_train[index]
    pad = padded_size(len(idx)) - len(idx)
    if pad:  # zero-weight rows, dropped before clipping: they contribute exactly nothing
        xb = torch.cat([xb, xb.new_zeros((pad, *xb.shape[1:]))])
        yb = torch.cat([yb, yb.new_zeros(pad)])
    if views > 0:
        xb = augment_views(xb, views, run.streams.augment)
    return run.engine.backward(xb.to(device), yb.to(device), views, len(idx))
