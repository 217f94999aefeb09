"""Trials run what was charged: wide independent random streams, measured noise/batches/steps, charged
points enforced, no data-dependent branches (divergence, small subsamples). Real Opacus runs on digits."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dptune.accounting import TrialPoint, reachable_points
from dptune.config import TrialConfig, load_space
from dptune.config.params import sampling_rate, trial_steps
from dptune.data import Splits
from dptune.dpsgd import ChargeMismatch, TrialStreams, _trial, init_model, make_engine, run_trial
from dptune.dpsgd._charge import check_charged
from dptune.dpsgd._optim import NoiseMeter

WIDE = 2**127 + 0x5EED  # a 128-bit trial entropy
def _point(sigma: float, q: float, steps: int, score_noise: float | None) -> TrialPoint:
    return TrialPoint(noise_multiplier=sigma, sampling_rate=q, steps=steps, score_noise=score_noise)


BASE = TrialConfig(model="gn_cnn", batch_size=64, epochs=1.0, noise_multiplier=1.0, learning_rate=0.5,
                   score_noise=None, physical_batch_size=256)


def _draws(s: TrialStreams) -> dict[str, list[float]]:
    return {"noise": torch.randn(8, generator=s.noise).tolist(),
            "sampler": torch.rand(8, generator=s.sampler).tolist(),
            "augment": torch.rand(8, generator=s.augment).tolist(),
            "score": s.score.normal(size=8).tolist(),
            "init": [float(s.init_seed)]}


def test_entropy_above_bit_64_changes_every_stream() -> None:
    """Two entropies equal in their low 64 bits (and in their low 100 bits) give different streams in
    every stream: the trial's secret is all its bits, not a 64-bit truncation an attacker could enumerate."""
    base = _draws(TrialStreams.from_entropy(WIDE))
    for other in (WIDE + 2**64, WIDE + 2**100, WIDE % 2**64):
        draws = _draws(TrialStreams.from_entropy(other))
        assert all(draws[k] != base[k] for k in base), other


def test_streams_are_independent_not_offset_seeds() -> None:
    """Each stream differs from every other, within a trial and across neighbouring entropies (seed,
    seed+1, seed+2 made trial s+1's DP noise trial s's Poisson sampler)."""
    seen: dict[tuple[float, ...], tuple[int, str]] = {}
    for entropy in (0, 1, 2, 3, WIDE, WIDE + 1):
        s = TrialStreams.from_entropy(entropy)
        firsts = {"noise": torch.rand(8, generator=s.noise), "sampler": torch.rand(8, generator=s.sampler),
                  "augment": torch.rand(8, generator=s.augment)}
        for name, t in firsts.items():
            key = tuple(t.tolist())
            assert key not in seen, (entropy, name, seen.get(key))
            seen[key] = (entropy, name)
    # reproducible: the same entropy gives the same streams
    assert _draws(TrialStreams.from_entropy(WIDE)) == _draws(TrialStreams.from_entropy(WIDE))


def test_state_replays_streams() -> None:
    s = TrialStreams.from_entropy(WIDE)
    _draws(s)
    saved = s.state()
    after = _draws(s)
    fresh = TrialStreams.from_entropy(7)
    fresh.load_state(saved)
    fresh.init_seed = s.init_seed
    assert _draws(fresh) == after


def test_trial_uses_all_bits_of_its_seed(small: Splits) -> None:
    """A real trial: seeds equal in their low 64 bits give different score noise and different models."""
    config = BASE.replace(score_noise=5.0)
    a = run_trial(config.replace(seed=WIDE), small, return_model=True)
    b = run_trial(config.replace(seed=WIDE % 2**64), small, return_model=True)
    assert a.score != b.score
    assert a.model_state is not None and b.model_state is not None
    assert any(not torch.equal(a.model_state[k], b.model_state[k]) for k in a.model_state)


# --------------------------------------------------------------------------------------------------
# the run is measured, and the measurement equals the charge


@pytest.mark.parametrize("mode", ["bookkeeping", "hooks"])
def test_trial_runs_what_was_charged(digits: Splits, mode: str) -> None:
    """Noise additions == steps == charged T; the added noise's empirical std is σ·C; the realised mean
    Poisson batch is q·n within a binomial 99.9 % interval; the score noise drawn is the charged one.
    Physical batches of 24 < B: noise must be added once per logical batch, not per chunk."""
    sigma, clip, batch, epochs = 1.3, 0.7, 64, 2.0
    config = BASE.replace(batch_size=batch, epochs=epochs, noise_multiplier=sigma, max_grad_norm=clip,
                          score_noise=4.0, physical_batch_size=24, clipping="auto" if mode == "bookkeeping" else mode)
    n = len(digits.train[1])
    q, steps = sampling_rate(batch_size=batch, basis=n), trial_steps(epochs=epochs, batch_size=batch, basis=n)
    point = _point(sigma, q, steps, 4.0)  # what the accountant charges for this trial
    result = run_trial(config, digits, charged_points=[point])
    assert result.clipping_mode == mode
    assert result.noise_additions == result.steps == point.steps
    n_params = sum(p.numel() for p in init_model(config, digits).parameters())
    assert result.noised_coordinates == point.steps * n_params  # every coordinate noised at every step
    assert result.noise_std is not None and result.noise_std == pytest.approx(point.noise_multiplier * clip, rel=0.02)
    half_width = 3.29 * math.sqrt(n * q * (1 - q) / steps)  # Σ batch sizes ~ Binomial(n·T, q)
    assert abs(result.mean_batch_size - point.sampling_rate * n) <= half_width
    assert result.applied_score_noise == point.score_noise
    public = run_trial(config.replace(score_noise=None, epochs=0.1), digits)
    assert public.applied_score_noise is None and public.score == public.val_accuracy_raw


def test_measured_noise_follows_the_optimizer_not_the_config(digits: Splits) -> None:
    """Control: an optimizer built with another σ than the config shows up in the measurement."""
    config = BASE.replace(noise_multiplier=2.0, max_grad_norm=0.5)
    meter = NoiseMeter()
    engine = make_engine("hooks", init_model(config, digits), config, torch.Generator().manual_seed(0),
                         noise_multiplier=0.5, meter=meter)
    for i in range(3):
        engine.backward(digits.train[0][i * 16:(i + 1) * 16], digits.train[1][i * 16:(i + 1) * 16], 0)
        engine.optimizer.step()
        engine.optimizer.zero_grad(set_to_none=True)
    assert meter.additions == 3 and meter.std() == pytest.approx(0.5 * 0.5, rel=0.02)


def _refuse_data(monkeypatch: pytest.MonkeyPatch) -> None:
    def touched(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the trial touched the data before checking its charge")

    monkeypatch.setattr(_trial, "_start", touched)
    monkeypatch.setattr(_trial, "epoch_chunks", touched)


@pytest.mark.parametrize(("why", "change"), [
    ("trial's σ below the charged floor", {"noise_multiplier": 1.0 + 1e-6}),
    ("trial's q above the charged one", {"sampling_rate": 0.5 * 64 / 1257}),
    ("more steps than charged", {"steps": 19}),
    ("less score noise than charged", {"score_noise": 4.5}),
    ("charge has no score release", {"score_noise": None}),
])
def test_trial_refuses_to_run_what_was_not_charged(digits: Splits, monkeypatch: pytest.MonkeyPatch, why: str,
                                                   change: dict[str, Any]) -> None:
    config = BASE.replace(batch_size=64, epochs=1.0, noise_multiplier=1.0, score_noise=4.0)
    n = len(digits.train[1])
    exact = _point(1.0, sampling_rate(batch_size=64, basis=n), trial_steps(epochs=1.0, batch_size=64, basis=n), 4.0)
    assert exact.steps == 20
    _refuse_data(monkeypatch)
    bad = dataclasses.replace(exact, **change)
    with pytest.raises(ChargeMismatch, match="refusing to start"):
        run_trial(config, digits, charged_points=[bad])
    # a raw score released while the charge priced a noised one: refused too
    with pytest.raises(ChargeMismatch):
        run_trial(config.replace(score_noise=None), digits, charged_points=[exact])
    # q's basis is part of the charge: the same config on a subsample basis is another trial
    with pytest.raises(ChargeMismatch):
        run_trial(config, digits, charged_points=[exact], sampling_basis=0.5 * n)


def test_trial_accepts_a_dominating_charge(digits: Splits) -> None:
    config = BASE.replace(batch_size=64, epochs=0.5, noise_multiplier=2.5, score_noise=6.0)
    n = len(digits.train[1])
    q, steps = sampling_rate(batch_size=64, basis=n), trial_steps(epochs=0.5, batch_size=64, basis=n)
    others = [_point(3.0, q, steps, 6.0), _point(2.0, q / 2, steps, 6.0)]  # neither covers it
    covering = _point(2.0, 2 * q, 3 * steps, 5.0)  # cheaper σ and score noise, more q and T
    result = run_trial(config, digits, charged_points=[*others, covering])
    assert result.steps == result.noise_additions == steps
    # the planner's own points for the digits space cover its default trial
    space = load_space(Path(__file__).resolve().parent.parent / "search_spaces" / "digits.yaml")
    points = reachable_points(space, n)
    d = space.default
    check_charged(points, noise_multiplier=d.noise_multiplier, sampling_rate=sampling_rate(batch_size=d.batch_size, basis=n),
                  steps=trial_steps(epochs=d.epochs, batch_size=d.batch_size, basis=n), score_noise=d.score_noise)
    # the largest batch on half the basis has twice the largest charged q: not charged
    top = max(space.space["batch_size"].choices)  # type: ignore[attr-defined]
    with pytest.raises(ChargeMismatch):
        check_charged(points, noise_multiplier=d.noise_multiplier, sampling_rate=sampling_rate(batch_size=top, basis=n / 2),
                      steps=trial_steps(epochs=d.epochs, batch_size=top, basis=n / 2), score_noise=d.score_noise)


# --------------------------------------------------------------------------------------------------
# no data-dependent branches


def _linear(config: TrialConfig, num_classes: int, shape: tuple[int, int, int]) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(shape[0] * shape[1] * shape[2], num_classes))


@pytest.mark.parametrize("mode", ["hooks", "functorch", "bookkeeping"])
def test_huge_losses_do_not_decide_divergence(digits: Splits, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Inputs scaled by 1e37 under a linear model: every per-example loss is finite but ~1e37, so a batch's
    summed loss overflows to inf (private, pre-clipping), while each clipped gradient and the noised
    parameters stay finite. The old loss branch declared this diverged (score −∞, early stop): a decision
    on private quantities. Now it runs all T steps and releases a real score."""
    monkeypatch.setattr(_trial, "build_model", _linear)
    x, y = digits.train
    huge = dataclasses.replace(digits, train=(x * 1e37, y))
    config = BASE.replace(batch_size=64, epochs=2.0, learning_rate=0.1, clipping="auto" if mode == "bookkeeping" else mode)
    logged: list[float] = []
    result = run_trial(config, huge, on_epoch=lambda e, m: logged.append(m["train_loss"]), return_model=True)
    assert result.clipping_mode == mode
    with torch.no_grad():
        losses = F.cross_entropy(init_model(config, huge)(huge.train[0][:64]), y[:64], reduction="none")
    assert bool(torch.isfinite(losses).all()) and not math.isfinite(float(losses.sum()))  # the premise
    assert not any(math.isfinite(v) for v in logged)  # curator-side log: the summed loss overflowed
    assert not result.diverged and math.isfinite(result.score)
    assert result.steps == result.noise_additions == trial_steps(epochs=2.0, batch_size=64, basis=len(y))
    assert result.model_state is not None and all(bool(torch.isfinite(v).all()) for v in result.model_state.values())


@pytest.mark.parametrize("mode", ["hooks", "functorch", "bookkeeping"])
def test_a_nonfinite_example_contributes_zero(digits: Splits, mode: str) -> None:
    """An example whose gradient is NaN (here: a NaN pixel) adds exactly nothing to the clipped sum, instead
    of making it NaN: whether a noised step is NaN must not depend on one example."""
    config = BASE.replace(max_grad_norm=0.5, clipping="auto" if mode == "bookkeeping" else mode)
    x, y = digits.train[0][:12].clone(), digits.train[1][:12]
    x[5, 0, 3, 3] = float("nan")
    sums = []
    for xb, yb in ((x, y), (torch.cat([x[:5], x[6:]]), torch.cat([y[:5], y[6:]]))):
        engine = make_engine(mode, init_model(config, digits), config, torch.Generator().manual_seed(0),
                             noise_multiplier=0.0)
        engine.backward(xb, yb, 0)
        if mode != "bookkeeping":
            engine.optimizer.clip_and_accumulate()
            sums.append(torch.cat([p.summed_grad.flatten() for p in engine.params]))
        else:
            sums.append(torch.cat([p.grad.flatten() for p in engine.params]))
    assert bool(torch.isfinite(sums[0]).all())
    assert torch.allclose(sums[0], sums[1], atol=1e-6)


@pytest.mark.parametrize("size", [40, 0])
def test_small_subsample_runs_at_the_charged_rate(digits: Splits, size: int) -> None:
    """Subsample tuning: q = B/basis with basis = f·n = 200 fixed before the draw, B = 120 > |X₁| = 40 (or
    0). The trial must run its T steps like any other (a refusal would reveal that |X₁| was small)."""
    x, y = digits.train
    tiny = dataclasses.replace(digits, train=(x[:size], y[:size]))
    config = BASE.replace(batch_size=120, epochs=3.0, clipping="hooks", score_noise=3.0)
    steps = trial_steps(epochs=3.0, batch_size=120, basis=200.0)
    point = _point(1.0, sampling_rate(batch_size=120, basis=200.0), steps, 3.0)
    result = run_trial(config, tiny, sampling_basis=200.0, charged_points=[point])
    assert result.sampling_rate == point.sampling_rate == 0.6
    assert result.steps == result.noise_additions == steps and not result.diverged
    assert math.isfinite(result.score)
    assert result.mean_batch_size == pytest.approx(0.6 * size, abs=3.29 * math.sqrt(size * 0.24 / steps) + 1e-9)
