"""DP-SGD trials: real Opacus training on real digits data, tiny sizes."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dptune.dpsgd as dpsgd
from dptune.config import ConfigError, TrialConfig, clipping
from dptune.config.params import sampling_rate, trial_steps
from dptune.data import Splits, augment_views
from dptune.dpsgd import (
    _engines,
    _trial,
    init_model,
    load_model,
    make_engine,
    resolve_clipping,
    run_trial,
    save_model,
)

# the per-example modes that clip the whole gradient (asked of the registry: batch and alc have tests of their own)
MODES = [m for m, info in clipping.MODES.items() if info.per_example and not info.layerwise]
BASE = TrialConfig(model="gn_cnn", batch_size=64, epochs=1.0, noise_multiplier=1.0, learning_rate=0.5,
                   score_noise=None, physical_batch_size=256)


def _clipping(mode: str) -> str:
    return "auto" if mode == "bookkeeping" else mode  # dptune.config does not list bookkeeping; auto picks it


def test_short_dp_training_beats_chance(digits: Splits) -> None:
    config = BASE.replace(batch_size=128, epochs=4.0, noise_multiplier=1.0)
    result = run_trial(config, digits, evaluate_test=True)
    assert not result.diverged
    assert result.val_accuracy_raw > 0.6 and result.score == result.val_accuracy_raw  # public validation
    assert result.test_accuracy is not None and result.test_accuracy > 0.6
    assert result.model_state is None


@pytest.mark.parametrize("mode", MODES)
def test_poisson_steps_and_rate(small: Splits, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    sizes: list[int] = []
    engine_cls = _engines.ENGINES[mode]
    original = engine_cls.backward

    def spy(self: Any, x: torch.Tensor, y: torch.Tensor, views: int, n_real: int) -> torch.Tensor:
        sizes.append(n_real)
        assert len(y) == dpsgd.padded_size(n_real)
        return original(self, x, y, views, n_real)

    monkeypatch.setattr(engine_cls, "backward", spy)
    n = len(small.train[1])
    config = BASE.replace(batch_size=8, epochs=2.5, clipping=_clipping(mode))  # fractional epochs: T != epochs * (n/B)
    epochs: list[tuple[int, dict[str, Any]]] = []
    result = run_trial(config, small, on_epoch=lambda e, m: epochs.append((e, m)))
    assert result.clipping_mode == mode
    assert result.steps == trial_steps(epochs=2.5, batch_size=8, basis=n) == epochs[-1][1]["steps"]
    assert result.sampling_rate == sampling_rate(batch_size=8, basis=n) and result.noise_multiplier == 1.0
    assert [e for e, _ in epochs] == [1, 2, 3] and result.epochs_done == 3
    assert len(set(sizes)) > 3  # Poisson batch sizes vary


@pytest.mark.parametrize("mode", MODES)
def test_empty_poisson_batches(small: Splits, mode: str) -> None:
    n = len(small.train[1])
    result = run_trial(BASE.replace(batch_size=1, epochs=0.5, clipping=_clipping(mode), learning_rate=0.05), small)
    # q = 1/n: about a third of the batches are empty, each is still a (noise-only) step
    assert result.steps == trial_steps(epochs=0.5, batch_size=1, basis=n) and not result.diverged


def _engine(mode: str, config: TrialConfig, data: Splits) -> dpsgd.Engine:
    return make_engine(mode, init_model(config, data), config, torch.Generator().manual_seed(0), noise_multiplier=0.0)


def _clipped_sums(engine: dpsgd.Engine, x: torch.Tensor, y: torch.Tensor, views: int, n_real: int
                  ) -> list[torch.Tensor]:
    """The engine's sum of clipped per-example gradients over the first ``n_real`` rows, per parameter: Opacus clips
    the per-sample gradients of hooks and functorch; ghost and book-keeping leave the sum in p.grad."""
    engine.backward(x, y, views, n_real)
    if engine.mode in ("ghost", "bookkeeping"):
        return [p.grad for p in engine.params]
    engine.optimizer.clip_and_accumulate()
    return [p.summed_grad for p in engine.params]


@pytest.mark.parametrize("mode", ["hooks", "functorch"])
def test_augmult_each_example_contributes_at_most_the_clip_norm(digits: Splits, mode: str) -> None:
    k, clip = 4, 0.01
    config = BASE.replace(augmult=k, max_grad_norm=clip, clipping=_clipping(mode))
    engine = _engine(mode, config, digits)
    g = torch.Generator().manual_seed(0)
    x, y = digits.train[0][:6], digits.train[1][:6]
    views = augment_views(x, k, g)
    engine.backward(views, y, k)
    gs = [p.grad_sample for p in engine.params]
    assert all(t.shape[0] == 6 for t in gs)  # one (view-averaged) gradient per example, not per view
    # the first example's gradient is the gradient of its loss averaged over its K views
    model = engine.model
    model.zero_grad()
    F.cross_entropy(model(views[:k]), y[:1].expand(k)).backward()
    for p, t in zip(engine.params, gs, strict=True):
        assert torch.allclose(t[0], p.grad, atol=1e-5, rtol=1e-4)
    norms = torch.stack([t.flatten(1).norm(dim=1) for t in gs], 1).norm(dim=1)
    assert bool((norms > clip).all())  # clipping is active
    for i in range(6):  # each example alone: its clipped contribution has norm <= C
        engine.optimizer.zero_grad(set_to_none=True)
        engine.backward(views[i * k:(i + 1) * k], y[i:i + 1], k)
        engine.optimizer.clip_and_accumulate()
        contribution = torch.cat([p.summed_grad.flatten() for p in engine.params]).norm()
        assert float(contribution) <= clip * (1 + 1e-5)
        assert float(contribution) == pytest.approx(clip, rel=1e-3)


def test_clipping_modes_agree(digits: Splits) -> None:
    """Same model, same batch: the sum of clipped per-sample gradients is the same in every mode."""
    config = BASE.replace(max_grad_norm=0.5)
    x, y = digits.train[0][:32], digits.train[1][:32]
    sums = []
    for mode in MODES:
        engine = _engine(mode, config, digits)
        engine.backward(x, y, 0)
        if mode in ("ghost", "bookkeeping"):
            sums.append(torch.cat([p.grad.flatten() for p in engine.params]))
        else:
            engine.optimizer.clip_and_accumulate()
            sums.append(torch.cat([p.summed_grad.flatten() for p in engine.params]))
    assert torch.allclose(sums[0], sums[1], atol=1e-5)
    assert torch.allclose(sums[0], sums[2], atol=1e-4)
    assert torch.allclose(sums[0], sums[3], atol=1e-5)


def test_ghost_falls_back_when_it_cannot_run() -> None:
    n = 1000
    assert resolve_clipping(BASE.replace(clipping="ghost"), n) == "ghost"
    assert resolve_clipping(BASE.replace(clipping="ghost", augmult=2), n) == "hooks"
    assert resolve_clipping(BASE.replace(clipping="ghost", batch_size=256), n) == "hooks"
    assert resolve_clipping(BASE.replace(clipping="auto"), n) == dpsgd.AUTO_CLIPPING["gn_cnn"]


class _Stop(Exception):
    pass


def test_checkpoint_resume_equals_uninterrupted(small: Splits, tmp_path: Path) -> None:
    config = BASE.replace(batch_size=16, epochs=3.0, augmult=2, ema_decay=0.9, momentum=0.9, score_noise=2.0,
                          seed=2**127 + 2**64 + 3)  # 128-bit entropy: every stream resumes where it stopped
    full = run_trial(config, small, return_model=True)
    ck = tmp_path / "trial.pt"

    def stop(epoch: int, metrics: dict[str, Any]) -> None:
        raise _Stop

    with pytest.raises(_Stop):
        run_trial(config, small, checkpoint_path=ck, on_epoch=stop)
    assert ck.exists() and not ck.with_name("trial.pt.tmp").exists()
    epochs: list[int] = []
    resumed = run_trial(config, small, checkpoint_path=ck, on_epoch=lambda e, m: epochs.append(e), return_model=True)
    assert epochs == [2, 3]
    assert resumed.steps == full.steps and resumed.epochs_done == full.epochs_done == 3
    assert full.model_state is not None and resumed.model_state is not None
    for k, v in full.model_state.items():
        assert torch.equal(v, resumed.model_state[k]), k
    assert resumed.score == full.score and resumed.val_accuracy_raw == full.val_accuracy_raw
    measured = ("noise_additions", "noised_coordinates", "noise_std", "mean_batch_size", "applied_score_noise")
    assert [getattr(resumed, f) for f in measured] == [getattr(full, f) for f in measured]  # the meter resumes
    assert full.noise_additions == full.steps and full.applied_score_noise == 2.0
    with pytest.raises(ConfigError) as e:
        run_trial(config.replace(seed=config.seed + 2**100), small, checkpoint_path=ck)  # another trial
    assert e.value.field == "checkpoint_path"
    with pytest.raises(ConfigError) as e:
        run_trial(config, small, checkpoint_path=ck, sampling_basis=500.0)  # another q and T
    assert e.value.field == "checkpoint_path"


def test_score_noise_private_vs_public(small: Splits) -> None:
    config = BASE.replace(epochs=1.0, score_noise=5.0)
    private = run_trial(config, small)
    assert private.score != private.val_accuracy_raw
    assert run_trial(config, small).score == private.score  # seeded: reproducible
    public = run_trial(config.replace(score_noise=None), small)
    assert public.score == public.val_accuracy_raw == private.val_accuracy_raw


def test_divergence_gives_minus_infinity(small: Splits) -> None:
    result = run_trial(BASE.replace(learning_rate=1e30, noise_multiplier=50.0, epochs=3.0), small)
    assert result.diverged and result.score == -math.inf
    assert result.steps < trial_steps(epochs=3.0, batch_size=64, basis=len(small.train[1]))  # stopped early


def _bn_net(config: TrialConfig, num_classes: int, shape: tuple[int, int, int]) -> nn.Module:
    return nn.Sequential(nn.Conv2d(shape[0], 8, 3, padding=1), nn.BatchNorm2d(8), nn.Tanh(), nn.Flatten(),
                         nn.Linear(8 * shape[1] * shape[2], num_classes))


def test_batchnorm_model_refused_or_fixed(small: Splits, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_trial, "build_model", _bn_net)
    with pytest.raises(ConfigError) as e:
        run_trial(BASE, small)
    assert e.value.field == "model"
    result = run_trial(BASE.replace(fix_batchnorm=True, clipping="hooks"), small, return_model=True)
    assert result.model_state is not None and "1.running_mean" not in result.model_state


@pytest.mark.parametrize(("field", "changes"), [
    ("model", {"model": "vgg"}), ("groups", {"groups": 3}), ("noise_multiplier", {"noise_multiplier": 0.0}),
    ("max_grad_norm", {"max_grad_norm": -1.0}), ("learning_rate", {"learning_rate": 0.0}),
    ("batch_size", {"batch_size": 100_000}),
])
def test_bad_inputs_name_the_field(small: Splits, field: str, changes: dict[str, Any]) -> None:
    with pytest.raises(ConfigError) as e:
        run_trial(BASE.replace(**changes), small)
    assert e.value.field == field


@pytest.mark.parametrize("optimizer", ["nadam", "adam"])
def test_adaptive_optimizers_train(small: Splits, optimizer: str) -> None:
    result = run_trial(BASE.replace(optimizer=optimizer, learning_rate=1e-2, batch_size=32, epochs=2.0), small)
    assert not result.diverged and result.val_accuracy_raw > 0.2


@pytest.mark.parametrize(("views", "stored_over_ghost"), [(0, None), (3, None), (3, 1.0)])
def test_bookkeeping_matches_functorch(digits: Splits, views: int, stored_over_ghost: float | None,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """gn_cnn, padding rows and augmented views: functorch's clipped sum. Its conv3 (4x4 input, 3x3) takes the ghost
    norm, its patch Gram from the pixels' Gram, once per backward, on the real rows only; with three views its T is
    48, and its gradient is kept (T·d_in·d_out <= 2·T²·(d_in + d_out)) unless the rule is Bu et al.'s own (1.0)."""
    from dptune.dpsgd import _bookkeeping

    if stored_over_ghost is not None:
        monkeypatch.setattr(_bookkeeping, "STORED_OVER_GHOST", stored_over_ghost)
    calls: list[tuple[int, ...]] = []
    original = _bookkeeping.pixel_gram
    monkeypatch.setattr(_bookkeeping, "pixel_gram", lambda m, a, *rest: calls.append(tuple(a.shape))
                        or original(m, a, *rest))
    config = BASE.replace(max_grad_norm=0.5, augmult=views)
    x, y = digits.train[0][:10], digits.train[1][:10]
    if views:
        x = augment_views(x, views, torch.Generator().manual_seed(0))
    ref = _clipped_sums(_engine("functorch", config, digits), x, y, views, 8)  # last two rows: padding
    bk = _engine("bookkeeping", config, digits)
    for p, q in zip(ref, _clipped_sums(bk, x, y, views, 8), strict=True):
        assert torch.allclose(p, q, atol=1e-5), p.shape
    assert calls == ([(8 * max(views, 1), 64, 4, 4)] if views == 0 or stored_over_ghost == 1.0 else [])
    k = max(views, 1)
    for i in range(3):  # each example alone contributes at most the clip norm
        bk.backward(x[i * k:(i + 1) * k], y[i:i + 1], views)
        assert float(torch.cat([q.grad.flatten() for q in bk.params]).norm()) <= 0.5 * (1 + 1e-5)


@pytest.mark.parametrize(("views", "stream_floats", "rows"), [(0, 1, 1), (0, 100_000, 2), (0, 1 << 20, 8),
                                                              (2, 200_000, 3)])
def test_bookkeeping_streams_its_largest_kept_weight_block_by_block(digits: Splits, views: int, stream_floats: int,
                                                                    rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """gn_cnn with two padding rows and an example whose gradient is NaN: the kept weight with the most per-example
    floats (conv2; with two views conv3, then kept too) is computed after every other layer's norms, ``rows`` real rows
    a block (``STREAM_FLOATS``), each block once; the others whole. The clipped sums are functorch's, the NaN example
    adding nothing."""
    from dptune.dpsgd import _bookkeeping

    monkeypatch.setattr(_bookkeeping, "STREAM_FLOATS", stream_floats)
    calls: list[tuple[int, int]] = []
    original = _bookkeeping.BookKeepingEngine._kept_rows
    monkeypatch.setattr(_bookkeeping.BookKeepingEngine, "_kept_rows",
                        lambda self, i, m, a, g, r, k: calls.append((i, r)) or original(self, i, m, a, g, r, k))
    config = BASE.replace(max_grad_norm=0.5, augmult=views)
    k = max(views, 1)
    x, y = digits.train[0][:10], digits.train[1][:10]
    x = augment_views(x, views, torch.Generator().manual_seed(0)) if views else x.clone()
    x[3 * k, 0, 3, 3] = float("nan")
    ref = _clipped_sums(_engine("functorch", config, digits), x, y, views, 8)  # last two rows: padding
    bk = _engine("bookkeeping", config, digits)
    got = _clipped_sums(bk, x, y, views, 8)
    for p, q in zip(ref, got, strict=True):
        assert bool(torch.isfinite(q).all()) and torch.allclose(p, q, atol=1e-5), p.shape
    streamed = 4 if views else 2  # conv3 (64 x 576 weights) when kept, else conv2 (64 x 288)
    whole = [(0, 8), (2, 8)] if views else [(0, 8)]  # conv1 (and conv2), each kept whole
    assert calls == [*whole, *((streamed, min(rows, 8 - s)) for s in range(0, 8, rows))]


@pytest.mark.parametrize(("shape", "channels_last"), [((5, 8, 3, 4), False), ((7, 6), False), ((3, 4, 2, 2, 3), False),
                                                      ((5, 8, 3, 4), True)])
def test_group_norm_rows_is_group_norm_and_gives_each_rows_gradients(shape: tuple[int, ...],
                                                                     channels_last: bool) -> None:
    """The book-keeping engine's GroupNorm (the batch as one row of N·C channels; for a channels-last input, which
    cannot be viewed so, nn.GroupNorm's own kernels and two reductions): nn.GroupNorm's output and input gradient bit
    for bit, and the backward's per-row weight and bias gradients are each row's Σ g·x̂ and Σ g."""
    from dptune.dpsgd._bookkeeping import _GroupNormRows, _GroupNormRowsChannelsLast

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=gen) * 3 + 2
    x = (x.contiguous(memory_format=torch.channels_last) if channels_last else x).requires_grad_()
    g = torch.randn(shape, generator=gen)
    norm = nn.GroupNorm(2, shape[1])
    with torch.no_grad():
        norm.weight.normal_(generator=gen), norm.bias.normal_(generator=gen)
    expected = norm(x)
    (dx_expected,) = torch.autograd.grad(expected, x, g)
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []
    rows = _GroupNormRowsChannelsLast if channels_last else _GroupNormRows
    y = rows.apply(x, norm.weight, norm.bias, 2, norm.eps, kept.append)
    (dx,) = torch.autograd.grad(y, x, g)
    assert torch.equal(y, expected) and torch.equal(dx, dx_expected)
    assert y.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    dw, db = kept[0]
    xhat = F.group_norm(x.detach(), 2, eps=norm.eps)
    assert torch.allclose(dw, (g * xhat).reshape(shape[0], shape[1], -1).sum(2), atol=1e-5)
    assert torch.allclose(db, g.reshape(shape[0], shape[1], -1).sum(2), atol=1e-5)


@pytest.mark.parametrize("mode", ["bookkeeping", "hooks", "ghost"])
def test_channels_last_tanh_cnn_clips_as_functorch(digits: Splits, mode: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The tanh CNN runs channels-last (its max-pools' fast CPU kernel): every per-example mode still gives
    functorch's clipped sum (real digits, upsampled to MNIST's 28x28; padding rows), the same function as the NCHW
    model up to float rounding, and book-keeping takes both GroupNorms' gradients from their channels-last backward
    and keeps both convs' gradients (conv2: T·d_in·d_out 1.14x the ghost norm's cost), recomputing the Linears' sums.
    Opacus' conv rules read a conv's input with NCHW strides: without ``contiguous_conv_inputs`` hooks and ghost
    were off by up to 0.49 in a per-sample gradient of conv2 (any channels-last conv input)."""
    from dptune.dpsgd import _bookkeeping

    config = BASE.replace(model="tanh_cnn", max_grad_norm=0.05, clipping=mode)
    x = F.interpolate(digits.train[0][:10], size=(28, 28), mode="bilinear", align_corners=False)
    y = digits.train[1][:10]
    data = Splits(train=(x, y), val=(x, y), test=(x, y), num_classes=digits.num_classes, input_shape=(1, 28, 28))
    model = init_model(config, data)
    conv2 = model.get_submodule("features.4")
    assert conv2.weight.is_contiguous(memory_format=torch.channels_last) and not conv2.weight.is_contiguous()
    nchw = init_model(config, data).to(memory_format=torch.contiguous_format)
    with torch.no_grad():
        assert torch.allclose(model(x), nchw(x), atol=1e-5)
    calls: list[int] = []
    original = _bookkeeping._GroupNormRowsChannelsLast.backward
    monkeypatch.setattr(_bookkeeping._GroupNormRowsChannelsLast, "backward",
                        staticmethod(lambda ctx, grad: calls.append(1) or original(ctx, grad)))
    recomputed: list[str] = []
    redo = _bookkeeping.BookKeepingEngine._clipped_sum
    monkeypatch.setattr(_bookkeeping.BookKeepingEngine, "_clipped_sum",
                        lambda self, m, *rest: recomputed.append(type(m).__name__) or redo(self, m, *rest))
    ref = make_engine("functorch", init_model(config, data), config, torch.Generator(), noise_multiplier=0.0)
    engine = make_engine(mode, model, config, torch.Generator(), noise_multiplier=0.0)
    got = _clipped_sums(engine, x, y, 0, 8)
    for p, q in zip(_clipped_sums(ref, x, y, 0, 8), got, strict=True):  # last two rows: padding
        assert torch.allclose(p, q, atol=1e-6), p.shape
    assert calls == ([1, 1] if mode == "bookkeeping" else [])
    assert recomputed == (["Linear", "Linear"] if mode == "bookkeeping" else [])


@pytest.mark.parametrize("views", [0, 2])
def test_bookkeeping_takes_group_norm_gradients_from_its_backward_or_recomputes_them(
        digits: Splits, views: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GroupNorm after a trained layer gets its per-example gradients from its own backward; one on the input
    (whose backward does not run: nothing before it needs a gradient) recomputes them. Both are functorch's."""
    from dptune.dpsgd import _bookkeeping

    def model() -> nn.Module:
        torch.manual_seed(4)
        return nn.Sequential(nn.GroupNorm(1, 1), nn.Conv2d(1, 6, 3, padding=1), nn.GroupNorm(3, 6), nn.Tanh(),
                             nn.Flatten(), nn.Linear(6 * 64, 10))

    calls: list[int] = []
    original = _bookkeeping._GroupNormRows.backward
    monkeypatch.setattr(_bookkeeping._GroupNormRows, "backward",
                        staticmethod(lambda ctx, grad: calls.append(1) or original(ctx, grad)))
    config = BASE.replace(max_grad_norm=0.2, augmult=views)
    x, y = digits.train[0][:9], digits.train[1][:9]
    if views:
        x = augment_views(x, views, torch.Generator().manual_seed(0))
    ref = _clipped_sums(make_engine("functorch", model(), config, torch.Generator(), noise_multiplier=0.0),
                        x, y, views, 7)  # last two rows: padding
    bk = make_engine("bookkeeping", model(), config, torch.Generator(), noise_multiplier=0.0)
    assert isinstance(bk, _bookkeeping.BookKeepingEngine)
    got = _clipped_sums(bk, x, y, views, 7)
    assert calls == [1]  # the second GroupNorm's backward; the first one's does not run
    for p, q in zip(ref, got, strict=True):
        assert torch.allclose(p, q, atol=1e-6), p.shape
    assert all("forward" not in m.__dict__ for m in bk.model.modules())  # the forward is patched for one pass only


class _Positions(nn.Module):
    """(N, C, H, W) -> (N, H·W, C): a Linear after it runs on each position (T = H·W)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(2).transpose(1, 2)


@pytest.mark.parametrize("views", [0, 2])
def test_bookkeeping_stores_gradients_either_way_round(digits: Splits, views: int,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Each stored layer's per-example gradients come out (d_out, d_in), or (d_in, d_out) where d_in < d_out (the
    batched GEMM's rows along the longer side); summed back into each weight's own layout they are functorch's, for
    convs (channels-last and NCHW) and a Linear on positions, both ways round."""
    from dptune.dpsgd import _bookkeeping

    def model(channels_last: bool) -> nn.Module:
        torch.manual_seed(5)
        net = nn.Sequential(nn.Conv2d(1, 12, 3, padding=1), nn.Tanh(),  # d_in 9 < d_out 12
                            nn.Conv2d(12, 4, 3, padding=1), nn.Tanh(),  # d_in 108 > d_out 4
                            _Positions(), nn.Linear(4, 6), nn.Tanh(),  # T 64, d_in 4 < d_out 6
                            nn.Flatten(), nn.Linear(6 * 64, 10))
        return net.to(memory_format=torch.channels_last) if channels_last else net

    ways: list[bool] = []
    original = _bookkeeping.arrangement
    monkeypatch.setattr(_bookkeeping, "arrangement",
                        lambda w, conv, transposed: ways.append(transposed) or original(w, conv, transposed))
    config = BASE.replace(max_grad_norm=0.3, augmult=views)
    x, y = digits.train[0][:9], digits.train[1][:9]
    if views:
        x = augment_views(x, views, torch.Generator().manual_seed(0))
    for channels_last in (False, True):
        ref = _clipped_sums(make_engine("functorch", model(False), config, torch.Generator(), noise_multiplier=0.0),
                            x, y, views, 7)  # last two rows: padding
        bk = make_engine("bookkeeping", model(channels_last), config, torch.Generator(), noise_multiplier=0.0)
        assert isinstance(bk, _bookkeeping.BookKeepingEngine)
        ways.clear()
        got = _clipped_sums(bk, x.contiguous(memory_format=torch.channels_last) if channels_last else x, y, views, 7)
        # the three kept weights (the last Linear: ghost norm, T 1): conv1 and the Linear on positions, then conv2,
        # the largest, streamed after every other layer's norms
        assert ways == [True, True, False]
        for p, q in zip(ref, got, strict=True):
            assert q is not None and q.shape == p.shape
            assert torch.allclose(p, q, atol=1e-6), p.shape


@pytest.mark.parametrize(("kernel", "padding", "size", "views", "channels_last"), [
    ((3, 3), (1, 1), (4, 4), 1, True), ((3, 3), (0, 0), (6, 5), 2, False), ((2, 3), (1, 0), (5, 4), 3, True),
    ((1, 1), (0, 0), (3, 3), 1, False), ((5, 5), (2, 2), (4, 6), 2, True)])
def test_pixel_gram_is_the_patches_gram(kernel: tuple[int, int], padding: tuple[int, int], size: tuple[int, int],
                                        views: int, channels_last: bool) -> None:
    """A stride-1 conv's patch Gram A A^T from its padded pixels' Gram, views and positions in the order of the
    output gradients' rows: the patches' own Gram, in float64 to 1e-12."""
    from dptune.dpsgd import _perexample

    torch.manual_seed(0)
    m = nn.Conv2d(3, 4, kernel, padding=padding).double()
    r = 5
    a = torch.randn(r * views, 3, *size, dtype=torch.float64)
    if channels_last:
        a = a.contiguous(memory_format=torch.channels_last)
    g = torch.randn(r * views, 4, *m(a[:1]).shape[2:], dtype=torch.float64)
    cols, gt = _perexample.layer_rows(m, a, g, r, views, _perexample.Workspace(), 0)
    got = _perexample.pixel_gram(m, a, r, views, _perexample.Workspace(), 0)
    assert got.shape == (r, cols.shape[1], cols.shape[1])
    assert torch.allclose(got, torch.bmm(cols, cols.transpose(1, 2)), rtol=0, atol=1e-12)
    assert torch.equal(_perexample.output_rows(g, r, views), gt)


def test_pixel_gram_applies_to_stride_1_convs_where_its_gemm_is_no_larger() -> None:
    """gn_cnn's conv3 (64 channels, 4x4, 3x3 padding 1: (6·6)² <= 4·4·4·4·9) takes it; a strided conv keeps the
    patches (book-keeping's spy in ``test_bookkeeping_matches_functorch`` sees conv3 take it in a real backward)."""
    from dptune.dpsgd import _bookkeeping

    assert not _bookkeeping.pixel_gram_pays(nn.Conv2d(3, 4, 3, stride=2, padding=1), torch.zeros(1, 3, 8, 8))
    assert _bookkeeping.pixel_gram_pays(nn.Conv2d(64, 64, 3, padding=1), torch.zeros(1, 64, 4, 4))


@pytest.mark.parametrize("views", [0, 3])
def test_bookkeeping_reuses_its_buffers_exactly(digits: Splits, views: int) -> None:
    """The engine keeps its patches, padded inputs and stored per-example gradients between steps (its CPU
    workspace): a batch after batches of other sizes (more rows, fewer, padding rows) gets the gradients a fresh
    engine gets, bit for bit, so no row of an earlier batch and no stale padding survives into a later one."""
    config = BASE.replace(max_grad_norm=0.5, augmult=views)
    k = max(views, 1)
    xs, ys = digits.train[0][:24], digits.train[1][:24]
    if views:
        xs = augment_views(xs, views, torch.Generator().manual_seed(0))

    def rows(lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        return xs[lo * k:hi * k], ys[lo:hi]

    def grads(engine: dpsgd.Engine, lo: int, hi: int, n_real: int) -> list[torch.Tensor]:
        engine.backward(*rows(lo, hi), views, n_real)
        return [p.grad.clone() for p in engine.params]

    fresh = grads(_engine("bookkeeping", config, digits), 0, 10, 8)
    used = _engine("bookkeeping", config, digits)
    grads(used, 4, 24, 20)  # more rows: the buffers grow
    grads(used, 10, 13, 2)  # fewer, one a padding row
    for p, q in zip(fresh, grads(used, 0, 10, 8), strict=True):
        assert torch.equal(p, q), p.shape
    assert used.work.buffers  # type: ignore[attr-defined]  # the workspace is what was exercised


def test_bookkeeping_steps_without_page_faults() -> None:
    """glibc hands a DP step's large temporaries back to the OS and maps them again on the next step, one page
    fault per 4 KiB (dptune.dpsgd._malloc); an engine built by make_engine keeps them. Measured in fresh processes:
    a gn_cnn book-keeping step at B 256 with make_engine, and the same engine built without it (the control). The
    median step: a step now and then still faults once for a few MiB (the heap growing), in either build."""
    import statistics
    import subprocess
    import sys

    script = """
import resource, sys, torch
from dptune.config import TrialConfig
from dptune.data import Splits
from dptune.dpsgd import BookKeepingEngine, init_model, make_engine
torch.set_num_threads(1)
x, y = torch.randn(256, 1, 8, 8), torch.randint(0, 10, (256,))
config = TrialConfig(model="gn_cnn", batch_size=256, noise_multiplier=1.0)
model = init_model(config, Splits((x, y), (x, y), (x, y), 10, (1, 8, 8)))
engine = make_engine("bookkeeping", model, config, torch.Generator()) if sys.argv[1] == "make_engine" else \
    BookKeepingEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), 1.0)
for _ in range(3):
    engine.backward(x, y, 0)
for _ in range(7):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    engine.backward(x, y, 0)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""
    faults = {how: statistics.median(int(v) for v in subprocess.run(
        [sys.executable, "-c", script, how], capture_output=True, text=True, check=True).stdout.split())
        for how in ("make_engine", "control")}
    assert faults["make_engine"] < 256 and faults["make_engine"] * 10 < faults["control"], faults


def test_model_file_schema(small: Splits, tmp_path: Path) -> None:
    """One model-file schema for the search's best checkpoint and final training: state_dict + public
    config (+ extras), plain data readable with weights_only=True, never the seed."""
    config = BASE.replace(epochs=0.2, seed=2**100 + 1)
    result = run_trial(config, small, return_model=True)
    assert result.model_state is not None
    path = tmp_path / "model.pt"
    save_model(path, result.model_state, config.to_public_dict(), dataset={"name": "digits"})
    raw = torch.load(path, weights_only=True)
    assert sorted(raw) == ["config", "dataset", "model_state"] and "seed" not in raw["config"]
    loaded = load_model(path)
    model = init_model(TrialConfig.from_dict(loaded["config"]), small)
    model.load_state_dict(loaded["model_state"])
    for k, v in model.state_dict().items():
        assert torch.equal(v, result.model_state[k]), k
    with pytest.raises(ValueError, match="seed"):
        save_model(path, result.model_state, config.to_dict())
    with pytest.raises(ValueError, match="overwrite"):
        save_model(path, result.model_state, config.to_public_dict(), config={})
    torch.save({"weights": 1}, tmp_path / "other.pt")
    with pytest.raises(ConfigError) as e:
        load_model(tmp_path / "other.pt")
    assert e.value.field == "other.pt"


@pytest.mark.parametrize("mode", ["hooks", "ghost", "bookkeeping", "functorch", "batch"])
def test_a_trial_warns_the_user_of_nothing_it_cannot_act_on(small: Splits, mode: str) -> None:
    """Issue 26 part 5: in-process runs (a notebook's dptune.train, the checks before a search's charge) printed
    PyTorch's "Full backward hook is firing …" for Opacus' hooks (ghost clipping's two backward passes; the
    clipping guard's probes hid it, with every other warning). Now one narrow filter where the hooks run; the
    guard's probe runs again here (cache cleared), and a user's own warning still passes."""
    import warnings

    from dptune.dpsgd import _guard

    _guard._guarded.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_trial(BASE.replace(clipping=_clipping(mode), epochs=0.5), small)
    assert [f"{w.category.__name__}: {w.message}" for w in caught] == []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with _engines.quiet_hooks():
            warnings.warn("Full backward hook is firing when gradients are computed …", UserWarning, stacklevel=1)
            warnings.warn("the user's own", UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["the user's own"]


def test_physical_batches_are_full_chunks_and_a_rest_with_one_noised_step_per_logical_batch(digits: Splits) -> None:
    """The loop's splitter: each logical batch as chunks of ``chunk`` examples and the rest, in order; the optimizer
    adds its noise and steps once per logical batch (an empty one too), after its last chunk."""
    from dptune.dpsgd import NoiseMeter, physical_batches

    x, y = digits.train
    batches = [list(range(0, 11)), [], list(range(20, 24)), list(range(30, 39))]
    meter = NoiseMeter()
    engine = make_engine("bookkeeping", init_model(BASE, digits), BASE, torch.Generator().manual_seed(0), meter=meter)
    parts, additions = [], []
    for part in physical_batches(batches, 4, engine.optimizer):
        parts.append(part)
        if part:
            engine.backward(x[part], y[part], 0)
        else:
            engine.empty()
        engine.optimizer.step()
        engine.optimizer.zero_grad(set_to_none=True)
        additions.append(meter.additions)
    assert [len(p) for p in parts] == [4, 4, 3, 0, 4, 4, 4, 1]
    assert [i for p in parts for i in p] == [i for b in batches for i in b]
    assert additions == [0, 0, 1, 2, 3, 3, 3, 4]
