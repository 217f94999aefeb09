"""One DP-SGD trial: set up, resume, run the epochs, release the score."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dptune.config import TrialConfig, clipping
from dptune.config.params import sampling_rate, trial_steps
from dptune.data import Splits
from dptune.dpsgd._audit import AuditHooks, apply_bug
from dptune.dpsgd._charge import check_charged
from dptune.dpsgd._checked import checked_model
from dptune.dpsgd._engines import engine_mode, make_engine
from dptune.dpsgd._guard import guarded_clipping
from dptune.dpsgd._loop import Chunk, Schedule, epoch_chunks, physical_chunk
from dptune.dpsgd._optim import NoiseMeter
from dptune.dpsgd._release import ScoreRelease
from dptune.dpsgd._rows import check_program
from dptune.dpsgd._state import TrialRun, restore_checkpoint, save_checkpoint, trial_identity
from dptune.dpsgd._streams import TrialStreams
from dptune.models import build_model

__all__ = ["PreparedTrial", "TrialResult", "init_model", "prepare", "run_trial", "schedule"]

Pair = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True, eq=False)
class TrialResult:
    """One trial's outcome. The fields from noise_additions to applied_score_noise are measured from the run
    itself (tensors and batches), not copied from its config: it ran as charged when noise_additions ==
    steps == T, noise_std ≈ σ·C (std per coordinate of the summed clipped gradient, Opacus' convention),
    mean_batch_size ≈ q·|train| (binomial) and applied_score_noise is the charged score noise."""

    score: float  # released: noised validation accuracy (private) or plain accuracy (public validation)
    val_accuracy_raw: float  # curator-only, never released
    diverged: bool
    sampling_rate: float
    noise_multiplier: float
    steps: int  # logical DP-SGD steps actually performed
    epochs_done: int
    seconds: float
    clipping_mode: str
    noise_additions: int  # Gaussian noise additions the optimizer performed (one per logical step)
    noised_coordinates: int  # coordinates that received noise, summed over all additions
    noise_std: float | None  # empirical std of all the noise added (None: no addition)
    mean_batch_size: float  # realised mean logical (Poisson) batch size over the steps
    applied_score_noise: float | None  # std of the Gaussian the score release drew (None: none drawn)
    test_accuracy: float | None = None
    model_state: dict[str, torch.Tensor] | None = None


def init_model(config: TrialConfig, data: Splits, streams: TrialStreams | None = None) -> nn.Module:
    """Seeded model init in a forked RNG (the caller's global RNG is left alone); BN refused or fixed, and
    Opacus' ModuleValidator applied (``checked_model``)."""
    init_seed = (streams or TrialStreams.from_entropy(config.seed)).init_seed
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(init_seed)
        model = build_model(config, data.num_classes, data.input_shape)
    return checked_model(model, config)


def schedule(config: TrialConfig, basis: float, num_classes: int, input_shape: tuple[int, ...]) -> Schedule:
    """What the trial runs, from data-independent quantities only (basis = n, or f·n on a subsample; the
    clipping mode the guard proved exact for the model on synthetic inputs: see ``_guard``)."""
    views = config.augmult
    mode, _ = guarded_clipping(config, num_classes, input_shape)
    return Schedule(sampling_rate=sampling_rate(batch_size=config.batch_size, basis=basis),
                    steps=trial_steps(epochs=config.epochs, batch_size=config.batch_size, basis=basis),
                    steps_per_epoch=max(1, math.ceil(basis / config.batch_size)),
                    clipping_mode=mode, views=views,
                    chunk=physical_chunk(config.physical_batch_size, views), ema_decay=config.ema_decay)


def run_trial(
    config: TrialConfig,
    data: Splits,
    *,
    checkpoint_path: Path | None = None,
    on_epoch: Callable[[int, dict[str, Any]], None] | None = None,
    device: str | None = None,
    evaluate_test: bool = False,
    return_model: bool = False,
    sampling_basis: float | None = None,
    charged_points: Iterable[Any] | None = None,
    _audit: AuditHooks | None = None,
) -> TrialResult:
    """Train one DP-SGD trial and release its (noised) validation score; resumes from checkpoint_path.

    ``sampling_basis``: subsample tuning fixes q and T on the data-independent f·n before the draw,
    never on the realised |X₁| (default: the training split's size). ``charged_points``: the worst-case
    points the accountant charged (objects with .noise_multiplier .sampling_rate .steps .score_noise, e.g.
    ``dptune.accounting.TrialPoint``); the trial raises :class:`ChargeMismatch` before touching the data
    unless one covers it. ``_audit``: audit-only hooks (``dptune.audit``; see ``_audit.py``), never passed by a
    search, a final training or a CLI."""
    t0 = time.perf_counter()
    dev = torch.device(device or "cpu")
    prepared = prepare(config, data, dev, sampling_basis=sampling_basis, charged_points=charged_points,
                       checkpoint_path=checkpoint_path, on_epoch=on_epoch, _audit=_audit)
    chunks = prepared.chunks(data, t0)
    engine = prepared.run.engine
    try:
        chunk = next(chunks)
        while True:  # each physical chunk's per-example gradients from the trial's own engine
            chunk = chunks.send(engine.backward(chunk.x, chunk.y, chunk.views, chunk.n_real))
    except StopIteration:
        pass
    return prepared.finish(data, evaluate_test, return_model, t0)


@dataclass
class PreparedTrial:
    """A trial set up and ready to train (``prepare``): its run (model, engine, streams), schedule and checkpoint.
    ``chunks`` is its whole training as a generator of physical chunks (``_loop.epoch_chunks``, epoch after epoch,
    a checkpoint and ``on_epoch`` after each); whoever drives it fills each chunk's per-example gradients: the
    trial's own engine (``run_trial``) or one computation for several trials (``_group``)."""

    config: TrialConfig
    sched: Schedule
    run: TrialRun
    device: torch.device
    identity: dict[str, Any]
    checkpoint_path: Path | None
    on_epoch: Callable[[int, dict[str, Any]], None] | None
    resumed_seconds: float

    def chunks(self, data: Splits, t0: float) -> Generator[Chunk, torch.Tensor, None]:
        st = self.run.state
        while st.steps < self.sched.steps and not st.diverged:
            train_loss = yield from epoch_chunks(self.run, data.train, self.sched, self.device)
            st.seconds = self.resumed_seconds + time.perf_counter() - t0
            if self.checkpoint_path is not None:
                save_checkpoint(Path(self.checkpoint_path), self.run, self.identity)
            if self.on_epoch is not None:
                self.on_epoch(st.epochs_done, {"train_loss": train_loss, "steps": st.steps, "diverged": st.diverged})

    def finish(self, data: Splits, evaluate_test: bool, return_model: bool, t0: float) -> TrialResult:
        return _finish(self.run, self.config, data, self.sched, self.device, evaluate_test, return_model,
                       self.resumed_seconds + time.perf_counter() - t0)


def prepare(config: TrialConfig, data: Splits, dev: torch.device, *, sampling_basis: float | None = None,
            charged_points: Iterable[Any] | None = None, checkpoint_path: Path | None = None,
            on_epoch: Callable[[int, dict[str, Any]], None] | None = None,
            _audit: AuditHooks | None = None) -> PreparedTrial:
    """A trial's schedule (the clipping guard included), its charge check (before any data is touched), its
    model, engine and streams, and its checkpoint restored when one exists (see ``run_trial``)."""
    n = len(data.train[1])
    basis = n if sampling_basis is None else sampling_basis
    sched = schedule(config, basis, data.num_classes, data.input_shape)
    if charged_points is not None:
        # the charged σ is per unit of sensitivity: the mode that will run decides it (batch clipping: 2C)
        check_charged(charged_points, noise_multiplier=config.noise_multiplier / clipping.sensitivity(sched.clipping_mode),
                      sampling_rate=sched.sampling_rate, steps=sched.steps, score_noise=config.score_noise)
    identity = trial_identity(config, n, basis)
    run = _start(config, data, sched, dev, _audit)
    if checkpoint_path is not None and Path(checkpoint_path).exists():
        restore_checkpoint(Path(checkpoint_path), run, identity, dev)
    return PreparedTrial(config, sched, run, dev, identity, checkpoint_path, on_epoch, run.state.seconds)


def _start(config: TrialConfig, data: Splits, sched: Schedule, dev: torch.device,
           audit: AuditHooks | None = None) -> TrialRun:
    streams = TrialStreams.from_entropy(config.seed, dev)
    model = init_model(config, data, streams).to(dev)
    model.train()
    meter = NoiseMeter()
    engine = make_engine(sched.clipping_mode, model, config, streams.noise, meter=meter)
    # the program this trial trains, proven itself (a factory may capture differently in another process)
    check_program(model, data.input_shape, engine_mode(engine), engine.sees_batch)
    if audit is not None:
        apply_bug(engine, audit.bug)  # audit-only: a deliberately broken trainer when an audit asks for one
    ema = None
    if config.ema_decay is not None:
        ema = {k: p.detach().clone() for k, p in model.named_parameters() if p.requires_grad}
    return TrialRun(model, engine, streams, ema, meter, audit=audit)


def _finish(run: TrialRun, config: TrialConfig, data: Splits, sched: Schedule, dev: torch.device,
            evaluate_test: bool, return_model: bool, seconds: float) -> TrialResult:
    model, ema, st = run.model, run.ema, run.state
    eval_params = None if ema is None else {**dict(model.named_buffers()), **ema}
    n_val = len(data.val[1])
    # a released score counts correct predictions with sensitivity 1: each prediction must depend on its own
    # example only, so a model normalising with batch statistics (batch clipping's BatchNorm) sees one at a time
    chunk = 1024 if clipping.mode(sched.clipping_mode).per_example else 1
    correct = _correct(model, eval_params, data.val, dev, chunk)
    score, score_noise = ScoreRelease(config.score_noise).release(correct, n_val, run.streams.score, st.diverged)
    test_acc = None
    if evaluate_test:
        test_acc = _correct(model, eval_params, data.test, dev, chunk) / len(data.test[1])
    state = None
    if return_model:
        state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        if ema is not None:
            state.update({k: v.detach().cpu().clone() for k, v in ema.items()})
    return TrialResult(score=score, val_accuracy_raw=correct / n_val, diverged=st.diverged,
                       sampling_rate=sched.sampling_rate, noise_multiplier=config.noise_multiplier, steps=st.steps,
                       epochs_done=st.epochs_done, seconds=seconds, clipping_mode=engine_mode(run.engine),
                       noise_additions=run.meter.additions, noised_coordinates=run.meter.coordinates,
                       noise_std=run.meter.std(), mean_batch_size=st.examples / max(st.steps, 1),
                       applied_score_noise=score_noise, test_accuracy=test_acc, model_state=state)


@torch.no_grad()
def _correct(model: nn.Module, params: dict[str, torch.Tensor] | None, pair: Pair, device: torch.device,
             chunk: int = 1024) -> int:
    was_training = model.training
    model.eval()
    correct = 0
    x, y = pair
    for i in range(0, len(y), chunk):
        xb = x[i:i + chunk].to(device)
        out = model(xb) if params is None else torch.func.functional_call(model, params, (xb,))
        correct += int((out.argmax(1).cpu() == y[i:i + chunk]).sum())
    model.train(was_training)
    return correct
