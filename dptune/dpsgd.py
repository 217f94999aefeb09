"""One DP-SGD trial (the only Opacus importer): Poisson sampling, per-sample clipping, Gaussian noise.

The privacy-relevant numbers (q, sigma, T) come from :mod:`dptune.config` so the accountant charges
exactly what runs: q = sampling_rate(B, n), T = trial_steps(epochs, B, n) logical steps, counted here.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F
from opacus.grad_sample import GradSampleModule, GradSampleModuleFastGradientClipping
from opacus.optimizers import DPOptimizer, DPOptimizerFastGradientClipping
from opacus.utils.batch_memory_manager import BatchSplittingSampler
from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping
from opacus.utils.uniform_sampler import UniformWithReplacementSampler
from torch import nn
from torch.nn.grad import conv2d_weight

from dptune._params import sampling_rate, trial_steps
from dptune.config import ConfigError, TrialConfig
from dptune.data import Splits, augment_views
from dptune.models import build_model, check_no_batchnorm, fix_batchnorm

__all__ = ["TrialResult", "resolve_clipping", "run_trial"]

# "auto" = the mode measured fastest on CPU (2 shared cores, torch 2.14, opacus 1.6, bench/step_overhead.py
# --quick, DP step / non-private step): gn_cnn B=256: bookkeeping 2.17x, hooks 3.54x, functorch 3.69x,
# ghost 3.73x; resnet9 B=32: bookkeeping 1.45x, functorch 1.60x, hooks 1.75x, ghost 2.07x.
# WRN's weight-standardized convs are not plain Conv2d: whole-model functorch handles them.
AUTO_CLIPPING = {"gn_cnn": "bookkeeping", "resnet9": "bookkeeping", "wrn16_4": "functorch"}
_SCORE_STREAM = 0x5C0E  # numpy stream id of the validation-score noise, independent of training noise


@dataclass(frozen=True, eq=False)
class TrialResult:
    score: float  # released: noised validation accuracy (private) or plain accuracy (public validation)
    val_accuracy_raw: float  # curator-only, never released
    diverged: bool
    sampling_rate: float
    noise_multiplier: float
    steps: int  # logical DP-SGD steps actually performed
    epochs_done: int
    seconds: float
    clipping_mode: str
    test_accuracy: float | None = None
    model_state: dict[str, torch.Tensor] | None = None


def resolve_clipping(config: TrialConfig, basis: float) -> str:
    """The per-sample-gradient mode that will run. Ghost clipping cannot average augmented views before
    clipping and is used without gradient accumulation, so it needs a logical batch that fits one
    physical batch (B + 4 sqrt(B), a Poisson tail bound) and augmult == 0; otherwise hooks."""
    mode = AUTO_CLIPPING.get(config.model, "hooks") if config.clipping == "auto" else config.clipping
    if mode == "ghost":
        b = config.batch_size
        if config.augmult > 0 or b + 4 * math.sqrt(b) > config.physical_batch_size:
            return "hooks"
    sampling_rate(batch_size=config.batch_size, basis=basis)
    return mode


# --------------------------------------------------------------------------------------------------
# per-sample gradient engines: each fills what its DPOptimizer clips (p.grad_sample, or p.grad for ghost)


class _Engine:
    def __init__(self, model: nn.Module, optimizer: DPOptimizer) -> None:
        self.model, self.optimizer = model, optimizer
        self.params = [p for p in model.parameters() if p.requires_grad]

    def backward(self, x: torch.Tensor, y: torch.Tensor, views: int, n_real: int | None = None) -> torch.Tensor:
        """Per-example gradients of the loss averaged over ``views`` views; returns the summed loss.
        Rows from ``n_real`` on are padding: they get zero weight and no per-sample gradient."""
        raise NotImplementedError

    def empty(self) -> None:
        """An empty Poisson batch: zero contribution, but the step (and its noise) still happens."""
        for p in self.params:
            p.grad_sample = p.new_zeros((0, *p.shape))  # type: ignore[attr-defined]


class _HooksEngine(_Engine):
    """Opacus GradSampleModule (hooks); augmented views are per-sample rows, summed per example."""

    def __init__(self, model: nn.Module, optimizer: DPOptimizer, force_functorch: bool = False) -> None:
        super().__init__(model, optimizer)
        self.gsm = GradSampleModule(model, batch_first=True, loss_reduction="sum", force_functorch=force_functorch)

    def backward(self, x: torch.Tensor, y: torch.Tensor, views: int, n_real: int | None = None) -> torch.Tensor:
        k = max(views, 1)
        losses = F.cross_entropy(self.gsm(x), y.repeat_interleave(k), reduction="none")
        losses = losses * _real_mask(len(y), n_real).repeat_interleave(k)
        (losses.sum() / k).backward()
        for p in self.params:  # per view -> per example; padding rows dropped
            p.grad_sample = p.grad_sample.view(-1, k, *p.shape).sum(1)[:n_real]  # type: ignore[attr-defined]
        return losses.detach().sum() / k


class _VmapEngine(_Engine):
    """Whole-model torch.func: vmap(grad) over examples, each example's loss averaged over its views.
    One batched call instead of per-layer hooks; the fastest mode on CPU (see AUTO_CLIPPING)."""

    def __init__(self, model: nn.Module, optimizer: DPOptimizer) -> None:
        super().__init__(model, optimizer)
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        buffers = dict(model.named_buffers())

        def loss_one(params: tuple[torch.Tensor, ...], xk: torch.Tensor, yk: torch.Tensor) -> torch.Tensor:
            out = torch.func.functional_call(model, ({**dict(zip(names, params, strict=True)), **buffers},), (xk,))
            return F.cross_entropy(out, yk)

        self._grads = torch.func.vmap(torch.func.grad_and_value(loss_one), in_dims=(None, 0, 0))

    def backward(self, x: torch.Tensor, y: torch.Tensor, views: int, n_real: int | None = None) -> torch.Tensor:
        k = max(views, 1)
        xk = x.view(-1, k, *x.shape[1:])
        yk = y[:, None].expand(-1, k)
        grads, losses = self._grads(tuple(p.detach() for p in self.params), xk, yk)
        for p, g in zip(self.params, grads, strict=True):
            p.grad_sample = g[:n_real]  # type: ignore[attr-defined]
        return losses.detach()[:n_real].sum()


class _GhostEngine(_Engine):
    """Opacus ghost clipping: per-sample norms without materialising per-sample gradients (Linear),
    then a second backward of the clipped loss; p.grad holds the sum of clipped gradients."""

    def __init__(self, model: nn.Module, optimizer: DPOptimizer, max_grad_norm: float) -> None:
        super().__init__(model, optimizer)
        self.gsm = GradSampleModuleFastGradientClipping(model, batch_first=True, loss_reduction="mean",
                                                        max_grad_norm=max_grad_norm, use_ghost_clipping=True)
        assert isinstance(optimizer, DPOptimizerFastGradientClipping)
        self.loss = DPLossFastGradientClipping(self.gsm, optimizer, nn.CrossEntropyLoss(), "mean")

    def backward(self, x: torch.Tensor, y: torch.Tensor, views: int, n_real: int | None = None) -> torch.Tensor:
        loss = self.loss(self.gsm(x), y) * _real_mask(len(y), n_real)  # padding rows: zero loss and norm
        loss.backward()
        return loss.detach() * len(y)

    def empty(self) -> None:
        for p in self.params:
            p.grad = torch.zeros_like(p)


class _BookKeepingEngine(_Engine):
    """Hand-written book-keeping clipping (Bu et al. 2023) for Conv2d/Linear/GroupNorm models: one
    backward to the layer outputs (no weight gradients), per-example norms per layer by the cheaper of
    ghost norm <A A^T, G G^T> or materialised gradients, then each layer's clipped sum as ONE ordinary
    weight-gradient GEMM with the outputs' gradients scaled by the clip factors. Ghost-optimizer API:
    p.grad holds the sum of clipped per-example gradients."""

    SUPPORTED = (nn.Conv2d, nn.Linear, nn.GroupNorm)

    def __init__(self, model: nn.Module, optimizer: DPOptimizer, max_grad_norm: float) -> None:
        super().__init__(model, optimizer)
        self.clip = max_grad_norm
        self.layers = [m for m in model.modules() if list(m.parameters(recurse=False))]
        self.acts: dict[nn.Module, tuple[torch.Tensor, torch.Tensor]] = {}
        for m in self.layers:
            m.register_forward_hook(self._save)

    @classmethod
    def supports(cls, model: nn.Module) -> bool:
        layers = [m for m in model.modules() if list(m.parameters(recurse=False))]
        return all(isinstance(m, cls.SUPPORTED) and (not isinstance(m, nn.Conv2d) or
                   (m.groups == 1 and m.padding_mode == "zeros" and isinstance(m.padding, tuple))) for m in layers)

    def _save(self, m: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        if torch.is_grad_enabled():  # training forward only, not evaluation
            self.acts[m] = (inputs[0].detach(), output)

    def backward(self, x: torch.Tensor, y: torch.Tensor, views: int, n_real: int | None = None) -> torch.Tensor:
        k, n = max(views, 1), len(y)
        self.acts = {}
        losses = F.cross_entropy(self.model(x), y.repeat_interleave(k), reduction="none")
        losses = losses * _real_mask(n, n_real).repeat_interleave(k) / k
        outs = [self.acts[m][1] for m in self.layers]
        grads = torch.autograd.grad(losses.sum(), outs)
        sq = x.new_zeros(n)
        for m, g in zip(self.layers, grads, strict=True):
            sq += self._sq_norm(m, self.acts[m][0], g, n)
        coef = (self.clip / (sq.sqrt() + 1e-6)).clamp(max=1.0).repeat_interleave(k)
        for m, g in zip(self.layers, grads, strict=True):
            self._clipped_sum(m, self.acts[m][0], g * coef.view(-1, *([1] * (g.dim() - 1))))
        self.acts = {}
        return losses.detach().sum()

    def _sq_norm(self, m: nn.Module, a: torch.Tensor, g: torch.Tensor, n: int) -> torch.Tensor:
        if isinstance(m, nn.GroupNorm):
            xhat = F.group_norm(a, m.num_groups, eps=m.eps)
            gw = (g * xhat).flatten(2).sum(2).view(n, -1, g.shape[1]).sum(1)
            gb = g.flatten(2).sum(2).view(n, -1, g.shape[1]).sum(1)
            return (gw ** 2).sum(1) + (gb ** 2).sum(1)
        if isinstance(m, nn.Conv2d):
            a = F.unfold(a, m.kernel_size, m.dilation, cast(tuple[int, ...], m.padding), m.stride).transpose(1, 2)  # (NK, T, d_in)
            g = g.flatten(2).transpose(1, 2)  # (NK, T, d_out)
        else:
            a, g = a.unsqueeze(1), g.unsqueeze(1)
        a = a.reshape(n, -1, a.shape[-1])  # the K views of an example are extra positions
        g = g.reshape(n, -1, g.shape[-1])
        t, d_in, d_out = a.shape[1], a.shape[2], g.shape[2]
        if t * t * (d_in + d_out) < t * d_in * d_out:  # ghost norm is cheaper
            w_sq = (torch.bmm(a, a.transpose(1, 2)) * torch.bmm(g, g.transpose(1, 2))).sum((1, 2))
        else:
            w_sq = (torch.bmm(g.transpose(1, 2), a) ** 2).sum((1, 2))
        b_sq = (g.sum(1) ** 2).sum(1) if m.bias is not None else 0.0
        return w_sq + b_sq

    def _clipped_sum(self, m: nn.Module, a: torch.Tensor, g: torch.Tensor) -> None:
        if isinstance(m, nn.GroupNorm):
            xhat = F.group_norm(a, m.num_groups, eps=m.eps)
            grads = [(g * xhat).sum((0, 2, 3)), g.sum((0, 2, 3))]
        elif isinstance(m, nn.Conv2d):
            gw = conv2d_weight(a, m.weight.shape, g, m.stride, m.padding, m.dilation)
            grads = [gw] + ([g.sum((0, 2, 3))] if m.bias is not None else [])
        else:
            grads = [g.t() @ a] + ([g.sum(0)] if m.bias is not None else [])
        for p, gp in zip([m.weight] + ([m.bias] if m.bias is not None else []), grads, strict=True):
            p.grad = gp

    def empty(self) -> None:
        for p in self.params:
            p.grad = torch.zeros_like(p)


def _real_mask(rows: int, n_real: int | None) -> torch.Tensor:
    mask = torch.ones(rows)
    mask[rows if n_real is None else n_real:] = 0.0
    return mask


def padded_size(n: int) -> int:
    """Physical batches are padded to a few bucket sizes: every new batch shape costs oneDNN a fresh
    kernel (~0.1 s on CPU), and Poisson batches would otherwise have a new size at nearly every step."""
    return 1 << max(n - 1, 0).bit_length() if n <= 32 else -(-n // 32) * 32


def _base_optimizer(config: TrialConfig, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    lr, wd = config.learning_rate, config.weight_decay
    if config.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=config.momentum, weight_decay=wd)
    if config.optimizer == "nadam":
        return torch.optim.NAdam(params, lr=lr, weight_decay=wd)
    if config.optimizer == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=wd)
    raise ConfigError("optimizer", f"unknown optimizer {config.optimizer!r}", "use one of: sgd, nadam, adam")


def make_engine(mode: str, model: nn.Module, config: TrialConfig, noise: torch.Generator,
                noise_multiplier: float | None = None) -> _Engine:
    """The engine for ``mode`` with its DPOptimizer (noise_multiplier override: tests only)."""
    sigma = config.noise_multiplier if noise_multiplier is None else noise_multiplier
    base = _base_optimizer(config, [p for p in model.parameters() if p.requires_grad])
    kw: dict[str, Any] = dict(noise_multiplier=sigma, max_grad_norm=config.max_grad_norm,
                              expected_batch_size=config.batch_size, loss_reduction="mean", generator=noise)
    if mode == "ghost":
        return _GhostEngine(model, DPOptimizerFastGradientClipping(base, **kw), config.max_grad_norm)
    if mode == "bookkeeping" and not _BookKeepingEngine.supports(model):
        mode = "functorch"
    if mode == "bookkeeping":
        return _BookKeepingEngine(model, DPOptimizerFastGradientClipping(base, **kw), config.max_grad_norm)
    opt = DPOptimizer(base, **kw)
    if mode == "hooks":
        return _HooksEngine(model, opt)
    if mode == "functorch":
        return _VmapEngine(model, opt)
    raise ConfigError("clipping", f"unknown clipping mode {mode!r}", "use one of: auto, hooks, functorch, ghost")


def engine_mode(engine: _Engine) -> str:
    return {_HooksEngine: "hooks", _VmapEngine: "functorch", _GhostEngine: "ghost",
            _BookKeepingEngine: "bookkeeping"}[type(engine)]


def init_model(config: TrialConfig, data: Splits) -> nn.Module:
    """Seeded model init in a forked RNG (the caller's global RNG is left alone); BN refused or fixed."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = build_model(config, data.num_classes, data.input_shape)
    if config.fix_batchnorm:
        fix_batchnorm(model, config.groups)
    check_no_batchnorm(model)
    return model


# --------------------------------------------------------------------------------------------------
# evaluation, checkpoints


@torch.no_grad()
def _correct(model: nn.Module, params: dict[str, torch.Tensor] | None, pair: tuple[torch.Tensor, torch.Tensor],
             device: torch.device) -> int:
    was_training = model.training
    model.eval()
    correct = 0
    x, y = pair
    for i in range(0, len(y), 1024):
        xb = x[i:i + 1024].to(device)
        out = model(xb) if params is None else torch.func.functional_call(model, params, (xb,))
        correct += int((out.argmax(1).cpu() == y[i:i + 1024]).sum())
    model.train(was_training)
    return correct


def _save_atomic(obj: dict[str, Any], path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)  # atomic: a crash leaves the previous checkpoint intact


@dataclass
class _State:
    steps: int = 0
    epochs_done: int = 0
    seconds: float = 0.0
    diverged: bool = False


# --------------------------------------------------------------------------------------------------


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
) -> TrialResult:
    """Train one DP-SGD trial and release its (noised) validation score; resumes from checkpoint_path."""
    t0 = time.perf_counter()
    dev = torch.device(device or "cpu")
    x_train, y_train = data.train
    n = len(y_train)
    # subsample tuning fixes q and T on the data-independent f·n before the draw, never on |X₁|
    basis = n if sampling_basis is None else sampling_basis
    q = sampling_rate(batch_size=config.batch_size, basis=basis)
    total_steps = trial_steps(epochs=config.epochs, batch_size=config.batch_size, basis=basis)
    steps_per_epoch = max(1, math.ceil(basis / config.batch_size))
    mode = resolve_clipping(config, basis)
    views = config.augmult
    chunk = max(1, config.physical_batch_size // max(views, 1))  # physical batch counts augmented views

    model = init_model(config, data).to(dev)
    model.train()
    noise_gen = torch.Generator(device=dev).manual_seed(config.seed)
    sampler_gen = torch.Generator().manual_seed(config.seed + 1)
    augment_gen = torch.Generator().manual_seed(config.seed + 2)
    score_rng = np.random.default_rng([config.seed, _SCORE_STREAM])
    engine = make_engine(mode, model, config, noise_gen)
    mode = engine_mode(engine)
    opt = engine.optimizer
    named = [(k, p) for k, p in model.named_parameters() if p.requires_grad]
    ema = {k: p.detach().clone() for k, p in named} if config.ema_decay is not None else None
    st = _State()

    if checkpoint_path is not None and Path(checkpoint_path).exists():
        ck = torch.load(checkpoint_path, map_location=dev, weights_only=False)
        if ck["config"] != config.to_dict() or ck["n_train"] != n:
            raise ConfigError("checkpoint_path", f"{checkpoint_path} belongs to another trial or dataset",
                              "delete it or pass this trial's own checkpoint")
        model.load_state_dict(ck["model"])
        opt.original_optimizer.load_state_dict(ck["optimizer"])
        ema = ck["ema"]
        st = _State(ck["steps"], ck["epochs_done"], ck["seconds"])
        noise_gen.set_state(ck["rng"]["noise"])
        sampler_gen.set_state(ck["rng"]["sampler"])
        augment_gen.set_state(ck["rng"]["augment"])
        score_rng.bit_generator.state = ck["rng"]["numpy"]
    resumed_seconds = st.seconds

    while st.steps < total_steps and not st.diverged:
        epoch_steps = min(steps_per_epoch, total_steps - st.steps)
        poisson = UniformWithReplacementSampler(num_samples=n, sample_rate=q, generator=sampler_gen,
                                                steps=epoch_steps)
        # BatchMemoryManager's splitter: logical Poisson batch -> physical chunks, the optimizer only
        # steps (and adds noise) after the last chunk. Ghost clipping cannot accumulate: no splitting.
        batches = poisson if mode == "ghost" else BatchSplittingSampler(
            sampler=poisson, max_batch_size=chunk, optimizer=opt)
        loss_sum, seen = 0.0, 0
        for idx in batches:
            if len(idx) == 0:
                engine.empty()
            else:
                index = torch.as_tensor(idx)
                xb, yb = x_train[index], y_train[index]
                pad = padded_size(len(idx)) - len(idx)
                if pad:  # zero-weight rows, dropped before clipping: they contribute exactly nothing
                    xb = torch.cat([xb, xb.new_zeros((pad, *xb.shape[1:]))])
                    yb = torch.cat([yb, yb.new_zeros(pad)])
                if views > 0:
                    xb = augment_views(xb, views, augment_gen)
                loss = engine.backward(xb.to(dev), yb.to(dev), views, len(idx))
                loss_sum += float(loss)
                seen += len(idx)
                if not math.isfinite(float(loss)):
                    st.diverged = True
            opt.step()
            opt.zero_grad(set_to_none=True)
            if opt._is_last_step_skipped:
                continue
            st.steps += 1
            if ema is not None:
                decay = config.ema_decay
                assert decay is not None
                for k, p in named:
                    ema[k].lerp_(p.detach(), 1.0 - decay)
            if st.diverged:
                break
        if not all(bool(torch.isfinite(p).all()) for _, p in named):
            st.diverged = True
        st.epochs_done += 1
        st.seconds = resumed_seconds + time.perf_counter() - t0
        if checkpoint_path is not None:
            _save_atomic({
                "config": config.to_dict(), "n_train": n, "model": model.state_dict(),
                "optimizer": opt.original_optimizer.state_dict(), "ema": ema, "steps": st.steps,
                "epochs_done": st.epochs_done, "seconds": st.seconds,
                "rng": {"noise": noise_gen.get_state(), "sampler": sampler_gen.get_state(),
                        "augment": augment_gen.get_state(), "numpy": score_rng.bit_generator.state},
            }, Path(checkpoint_path))
        if on_epoch is not None:
            on_epoch(st.epochs_done, {"train_loss": loss_sum / max(seen, 1), "steps": st.steps,
                                      "diverged": st.diverged})

    eval_params = None if ema is None else {**dict(model.named_buffers()), **ema}
    n_val = len(data.val[1])
    correct = _correct(model, eval_params, data.val, dev)
    raw = correct / n_val
    if st.diverged:
        score = -math.inf
    elif config.score_noise is None:
        score = raw
    else:
        # Gaussian mechanism on the correct-count (sensitivity 1), seeded so a resumed trial agrees
        score = (correct + float(score_rng.normal(0.0, config.score_noise))) / n_val
    test_acc = None
    if evaluate_test:
        test_acc = _correct(model, eval_params, data.test, dev) / len(data.test[1])
    state = None
    if return_model:
        state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        if ema is not None:
            state.update({k: v.detach().cpu().clone() for k, v in ema.items()})
    return TrialResult(score=score, val_accuracy_raw=raw, diverged=st.diverged, sampling_rate=q,
                       noise_multiplier=config.noise_multiplier, steps=st.steps, epochs_done=st.epochs_done,
                       seconds=resumed_seconds + time.perf_counter() - t0, clipping_mode=mode,
                       test_accuracy=test_acc, model_state=state)
