"""The steps ``bench/step_overhead.py`` times side by side: a trial's DP step as the loop runs it (Poisson batch,
physical chunks, padding, noise), the engine alone on exactly B rows, and the non-private SGD step it is divided by."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from dptune.config import TrialConfig, clipping
from dptune.data import Splits
from dptune.dpsgd import Engine, init_model, padded_rows, padded_size, physical_batches


def fake_splits(shape: tuple[int, int, int], n: int = 8) -> Splits:
    x, y = torch.zeros(n, *shape), torch.zeros(n, dtype=torch.long)
    return Splits((x, y), (x, y), (x, y), 10, shape)


def timer(fn: Callable[[list[int]], None], idx: list[int]) -> float:
    t = time.perf_counter()
    fn(idx)
    return time.perf_counter() - t


def interleaved(steps: dict[str, Callable[[list[int]], None]], logical: list[list[int]]) -> dict[str, list[float]]:
    """Each step on each logical batch, round-robin (the first two batches a warm-up: allocator, vmap tracing, oneDNN
    kernels): seconds per step, per name."""
    for idx in logical[:2]:
        for fn in steps.values():
            fn(idx)
    times: dict[str, list[float]] = {k: [] for k in steps}
    for idx in logical[2:]:
        for k, fn in steps.items():
            times[k].append(timer(fn, idx))
    return times


def pow2_to_32(n: int) -> int:
    """The loop's buckets before 2026-12-07 (``--old-buckets``): powers of two up to 32, then as ``padded_size``."""
    return 1 << max(n - 1, 0).bit_length() if n <= 32 else padded_size(n)


def old_padded(x: torch.Tensor, y: torch.Tensor, idx: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``padded_rows`` with the old buckets (``pow2_to_32``): the rows ``idx``, then zero rows."""
    index = torch.as_tensor(idx)
    xb, yb, pad = x[index], y[index], pow2_to_32(len(idx)) - len(idx)
    return (torch.cat([xb, xb.new_zeros((pad, *xb.shape[1:]))]), torch.cat([yb, yb.new_zeros(pad)])) if pad else (xb, yb)


def trial_step(engine: Engine, x: torch.Tensor, y: torch.Tensor, idx: list[int], chunk: int,
               pad: Callable[..., tuple[torch.Tensor, torch.Tensor]] = padded_rows) -> None:
    """One logical DP step as the trial loop runs it (views 0): physical chunks, each padded to its bucket; a mode
    that cannot accumulate (ghost) runs the logical batch whole, as the loop does (its trial needs a physical batch
    of at least B + 4 sqrt(B), else it runs hooks)."""
    opt = engine.optimizer
    split = clipping.mode(engine.mode).accumulates
    chunks = physical_batches([idx], chunk, opt) if split else [idx]
    for rows in chunks:
        if len(rows) == 0:
            engine.empty()
        else:
            float(engine.backward(*pad(x, y, rows), 0, len(rows)))  # the loop logs the loss: a synchronisation
        opt.step()
        opt.zero_grad(set_to_none=True)


def config(model_name: str, batch: int) -> TrialConfig:
    return TrialConfig(model=model_name, batch_size=batch, clipping="hooks", noise_multiplier=1.0,
                       groups=16 if model_name == "resnet9" else 4)


def plain_step(cfg: TrialConfig, data: Splits, x: torch.Tensor, y: torch.Tensor,
                convert: Callable[[torch.nn.Module], torch.nn.Module] = lambda m: m) -> Callable[[], None]:
    """Non-private SGD (momentum 0.9) on the rows x, y: the step a DP step is divided by."""
    plain = convert(init_model(cfg, data))
    sgd = torch.optim.SGD(plain.parameters(), lr=0.01, momentum=0.9)

    def step() -> None:
        sgd.zero_grad(set_to_none=True)
        loss = F.cross_entropy(plain(x), y)
        loss.backward()
        float(loss.detach())  # as the trial logs it
        sgd.step()
    return step


def exact_step(engine: Engine, x: torch.Tensor, y: torch.Tensor) -> None:
    """The engine alone on exactly the rows x, y: its backward and the optimizer's step."""
    engine.backward(x, y, 0)
    engine.optimizer.step()
    engine.optimizer.zero_grad(set_to_none=True)
