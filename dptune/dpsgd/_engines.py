"""Per-sample-gradient engines: each fills what its Opacus DPOptimizer clips and noises.

``p.grad_sample`` (hooks, functorch: DPOptimizer clips it) or ``p.grad`` = the sum of clipped per-example
gradients (ghost, bookkeeping: DPOptimizerFastGradientClipping). Either way the optimizer adds the Gaussian
noise, std noise_multiplier · max_grad_norm per coordinate of the summed gradient, once per logical step.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, TypeVar, cast

import torch
import torch.nn.functional as F
from opacus.grad_sample import GradSampleModule
from opacus.optimizers import DPOptimizer
from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping
from torch import nn

from dptune.config import ConfigError, TrialConfig, clipping
from dptune.config.params import sampling_rate
from dptune.dpsgd._malloc import keep_freed_memory
from dptune.dpsgd._optim import (
    ClippingDPOptimizer,
    GhostClippingModule,
    NoiseMeter,
    SummedDPOptimizer,
)

__all__ = ["AUTO_CLIPPING", "ENGINES", "Engine", "engine", "engine_mode", "make_engine", "quiet_hooks",
           "resolve_clipping"]


@contextlib.contextmanager
def quiet_hooks() -> Iterator[None]:
    """Opacus' per-sample hooks (hooks, ghost) are full backward hooks; PyTorch warns that they fire with respect
    to a module's outputs when its inputs (the data) need no gradient — exactly what the weights' per-sample
    gradients need, so the warning tells the user nothing. That one warning only; every other one passes."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Full backward hook is firing", category=UserWarning)
        yield


# "auto" = the mode measured fastest on CPU (2 shared cores, torch 2.14 at 1 thread, opacus 1.6, bench/step_overhead.py,
# the trial's step / non-private step, the CNNs channels-last, at fc7ca3e; bench/results/step_overhead.md, 2026-11-28):
# gn_cnn B=256: bookkeeping 1.61x, functorch 2.57x, hooks 3.65x, ghost 3.71x; resnet9 B=32: bookkeeping 1.30x,
# functorch 1.69x, hooks 2.15x, ghost 2.62x; tanh_cnn (MNIST spaces, physical batch 256) B=256: bookkeeping 1.78x,
# functorch 3.22x, ghost 3.36x, hooks 3.66x (the same ranking as in four NCHW runs at b1a60d0).
# WRN's weight-standardized convs are not plain Conv2d: whole-model functorch handles them.
AUTO_CLIPPING = {"gn_cnn": "bookkeeping", "resnet9": "bookkeeping", "tanh_cnn": "bookkeeping", "wrn16_4": "functorch"}


def _auto_mode(model: str) -> str:
    # torchvision and user models may modify tensors in place (torchvision's ResNets: ReLU(inplace=True),
    # out += identity), which crashes Opacus' full backward hooks (opacus issue #828): whole-model vmap
    return AUTO_CLIPPING.get(model, "functorch" if ":" in model else "hooks")


def resolve_clipping(config: TrialConfig, basis: float) -> str:
    """The per-sample-gradient mode that will run. Ghost clipping cannot average augmented views before
    clipping and is used without gradient accumulation, so it needs a logical batch that fits one
    physical batch (B + 4 sqrt(B), a Poisson tail bound) and augmult == 0; otherwise hooks."""
    mode = _auto_mode(config.model) if config.clipping == "auto" else config.clipping
    m = clipping.mode(mode)
    if m.per_example and not m.accumulates:  # ghost: the logical batch must fit one physical batch
        b = config.batch_size
        if config.augmult > 0 or b + 4 * math.sqrt(b) > config.physical_batch_size:
            return "hooks"
    sampling_rate(batch_size=config.batch_size, basis=basis)
    return mode


ENGINES: dict[str, type[Engine]] = {}  # clipping mode -> its engine (dptune.config.clipping registers what each mode is)
E = TypeVar("E", bound="type[Engine]")


def engine(mode: str) -> Callable[[E], E]:
    """Register an engine class for clipping mode ``mode`` (a mode of ``dptune.config.clipping``'s registry). Checked at
    import: the mode is registered there and has no engine yet; the class is an ``Engine`` with its own ``backward``
    (the base's only raises) and an Opacus ``DPOptimizer`` as ``optimizer_class`` (it adds the noise)."""
    def register(cls: E) -> E:
        clipping.mode(mode)  # a mode the config layer knows, with its sensitivity and capabilities
        if mode in ENGINES or mode == clipping.AUTO:
            raise ValueError(f"clipping mode {mode!r} has two engines (auto is resolved to another mode's)")
        if not (isinstance(cls, type) and issubclass(cls, Engine)):
            raise TypeError(f"the engine of clipping mode {mode!r} must subclass dptune.dpsgd.Engine, not {cls!r}")
        if cls.backward is Engine.backward or not issubclass(cls.optimizer_class, DPOptimizer):
            raise TypeError(f"the engine of clipping mode {mode!r} ({cls.__name__}) does not implement "
                            "Engine.backward, or its optimizer_class is not an Opacus DPOptimizer")
        cls.mode = mode  # type: ignore[misc]
        ENGINES[mode] = cls
        return cls
    return register


# --------------------------------------------------------------------------------------------------
# per-sample gradient engines: each fills what its DPOptimizer clips (p.grad_sample, or p.grad for ghost)


class Engine:
    """A per-step gradient engine with its DPOptimizer. ``build`` makes both (its optimizer class: what the
    engine leaves in p.grad or p.grad_sample); ``mode``: the clipping mode it is registered for (``engine``)."""

    mode: ClassVar[str] = ""
    optimizer_class: ClassVar[type[DPOptimizer]] = ClippingDPOptimizer
    # whether the model sees the physical batch (its rows, their count): False only where each example's forward
    # runs alone whatever the batch (vmap), so the clipping guard need not probe at the trial's batch size
    sees_batch: ClassVar[bool] = True

    @classmethod
    def build(cls, model: nn.Module, base: torch.optim.Optimizer, kw: dict[str, Any], config: TrialConfig) -> Engine:
        return cls(model, cls.optimizer_class(base, **kw))

    @classmethod
    def supports(cls, model: nn.Module) -> bool:
        """Whether this engine can run ``model`` at all (else ``make_engine`` falls back to functorch)."""
        return True

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


@engine("hooks")
class HooksEngine(Engine):
    """Opacus GradSampleModule (hooks); augmented views are per-sample rows, summed per example."""

    def __init__(self, model: nn.Module, optimizer: DPOptimizer, force_functorch: bool = False) -> None:
        super().__init__(model, optimizer)
        contiguous_conv_inputs(model)
        self.gsm = GradSampleModule(model, batch_first=True, loss_reduction="sum", force_functorch=force_functorch)

    def backward(self, x: torch.Tensor, y: torch.Tensor, views: int, n_real: int | None = None) -> torch.Tensor:
        k = max(views, 1)
        losses = F.cross_entropy(self.gsm(x), y.repeat_interleave(k), reduction="none")
        losses = losses * _real_mask(len(y), n_real, y.device).repeat_interleave(k)
        with quiet_hooks():
            (losses.sum() / k).backward()
        for p in self.params:
            rows = p.grad_sample.shape[0]  # type: ignore[attr-defined]
            if rows != len(x):  # a layer over (N·P, d) rows: one example would be P rows, each clipped alone
                raise ConfigError("clipping", f"hooks: a layer's per-sample gradients have {rows} rows for a batch "
                                  f"of {len(x)} inputs (the layer does not see one row per example)",
                                  "set fixed.clipping: functorch (whole-model vmap: each example alone)")
        for p in self.params:  # per view -> per example; padding rows dropped
            p.grad_sample = p.grad_sample.view(-1, k, *p.shape).sum(1)[:n_real]  # type: ignore[attr-defined]
        return losses.detach().sum() / k


@engine("functorch")
class VmapEngine(Engine):
    """Whole-model torch.func: vmap(grad) over examples, each example's loss averaged over its views.
    One batched call instead of per-layer hooks; the fastest mode on CPU (see AUTO_CLIPPING)."""

    sees_batch = False  # each vmap lane runs the model on one example (its views): the batch is invisible

    def __init__(self, model: nn.Module, optimizer: DPOptimizer) -> None:
        super().__init__(model, optimizer)
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        buffers = dict(model.named_buffers())

        def loss_one(params: tuple[torch.Tensor, ...], xk: torch.Tensor, yk: torch.Tensor) -> torch.Tensor:
            out = torch.func.functional_call(model, ({**dict(zip(names, params, strict=True)), **buffers},), (xk,))
            return F.cross_entropy(out, yk)

        # randomness "different": each example its own dropout masks (the guard refuses any other random draw)
        self._grads = torch.func.vmap(torch.func.grad_and_value(loss_one), in_dims=(None, 0, 0),
                                      randomness="different")

    def backward(self, x: torch.Tensor, y: torch.Tensor, views: int, n_real: int | None = None) -> torch.Tensor:
        k = max(views, 1)
        xk = x.view(-1, k, *x.shape[1:])
        yk = y[:, None].expand(-1, k)
        grads, losses = self._grads(tuple(p.detach() for p in self.params), xk, yk)
        for p, g in zip(self.params, grads, strict=True):
            p.grad_sample = g[:n_real]  # type: ignore[attr-defined]
        return losses.detach()[:n_real].sum()


@engine("ghost")
class GhostEngine(Engine):
    """Opacus ghost clipping: per-sample norms without materialising per-sample gradients (Linear),
    then a second backward of the clipped loss; p.grad holds the sum of clipped gradients."""

    @classmethod
    def build(cls, model: nn.Module, base: torch.optim.Optimizer, kw: dict[str, Any], config: TrialConfig) -> Engine:
        return cls(model, SummedDPOptimizer(base, **kw), config.max_grad_norm)

    def __init__(self, model: nn.Module, optimizer: DPOptimizer, max_grad_norm: float) -> None:
        super().__init__(model, optimizer)
        _refuse_unghostable(model)
        contiguous_conv_inputs(model)
        self.gsm = GhostClippingModule(model, batch_first=True, loss_reduction="mean",
                                       max_grad_norm=max_grad_norm, use_ghost_clipping=True)
        assert isinstance(optimizer, SummedDPOptimizer)
        self.loss = DPLossFastGradientClipping(self.gsm, optimizer, nn.CrossEntropyLoss(), "mean")

    def backward(self, x: torch.Tensor, y: torch.Tensor, views: int, n_real: int | None = None) -> torch.Tensor:
        loss = self.loss(self.gsm(x), y) * _real_mask(len(y), n_real, y.device)  # padding rows: zero loss and norm
        with quiet_hooks():  # both of Opacus' backward passes (norms, then the clipped loss) run the hooks
            loss.backward()
        return loss.detach() * len(y)

    def empty(self) -> None:
        for p in self.params:
            p.grad = torch.zeros_like(p)


def contiguous_conv_inputs(model: nn.Module) -> None:
    """Opacus' conv rules (hooks' per-sample gradients, ghost's norms) unfold a conv's input with strides written for
    a contiguous NCHW tensor (``opacus.utils.tensor_utils.unfold2d``): a channels-last input (the built-in CNNs'
    layout, any model run channels-last) gave wrong per-sample gradients, which the clipping guard refused. Each conv's
    input is made contiguous before it, and so before the hook that saves it (a no-op for a contiguous input)."""
    for m in model.modules():
        if isinstance(m, nn.modules.conv._ConvNd) and not getattr(m, "_dptune_contiguous_input", False):
            m.register_forward_pre_hook(lambda _, args: (args[0].contiguous(), *args[1:]))
            m._dptune_contiguous_input = True  # type: ignore[assignment]


def _refuse_unghostable(model: nn.Module) -> None:
    """Ghost norms assume zero padding and a weight used only inside its own module's hooked call: refuse
    non-zero padding modes and a parameter shared by two modules (a weight used functionally elsewhere, e.g.
    ``F.linear(h, emb.weight)``, is invisible here; the clipping guard's probe catches it)."""
    owners: dict[int, str] = {}
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.conv._ConvNd) and m.padding_mode != "zeros":
            raise ConfigError("clipping", f"ghost: layer {name} pads with {m.padding_mode!r}; ghost norms assume "
                              "zero padding", "set fixed.clipping: functorch, or use padding_mode='zeros'")
        for pname, p in m.named_parameters(recurse=False):
            if id(p) in owners and p.requires_grad:
                raise ConfigError("clipping", f"ghost: parameter {name}.{pname} is also {owners[id(p)]} (a tied "
                                  "weight); ghost norms see one use of it", "set fixed.clipping: functorch")
            owners[id(p)] = f"{name}.{pname}"


def _real_mask(rows: int, n_real: int | None, device: torch.device) -> torch.Tensor:
    mask = torch.ones(rows, device=device)
    mask[rows if n_real is None else n_real:] = 0.0
    return mask


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
                noise_multiplier: float | None = None, meter: NoiseMeter | None = None) -> Engine:
    """The engine for ``mode`` with its DPOptimizer (noise_multiplier override: tests only); ``meter``
    records every noise addition the optimizer performs."""
    sigma = config.noise_multiplier if noise_multiplier is None else noise_multiplier
    keep_freed_memory()  # a step's temporaries come back without page faults (_malloc)
    base = _base_optimizer(config, [p for p in model.parameters() if p.requires_grad])
    kw: dict[str, Any] = dict(noise_multiplier=sigma, max_grad_norm=config.max_grad_norm,
                              expected_batch_size=config.batch_size, loss_reduction="mean", generator=noise)
    cls = ENGINES.get(mode)
    if cls is None:
        raise ConfigError("clipping", f"unknown clipping mode {mode!r}", "use one of: " + ", ".join(ENGINES))
    if not cls.supports(model):  # e.g. book-keeping on a layer it has no rule for: each example alone instead
        cls = ENGINES["functorch"]
    built = cls.build(model, base, kw, config)
    cast(Any, built.optimizer).meter = meter
    return built


def engine_mode(engine: Engine) -> str:
    return type(engine).mode
