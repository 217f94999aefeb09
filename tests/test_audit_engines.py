"""Feature canaries (``dptune.audit``, ``_features``): white-box canaries that are ordinary training examples of an
audit model, so the one-run audit covers every per-example clipping engine on its own code path, bookkeeping (the
engine the shipped spaces run) and ghost included, where Dirac canaries need per-sample gradients in grad_sample."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dptune.accounting import TrialPoint, calibrate_noise_multiplier, epsilon, trial_event
from dptune.audit import (
    FeatureCanaryModel,
    audit_fdp,
    column_directions,
    column_sums,
    draw_feature_canaries,
    feature_audit_basis,
    feature_audit_config,
    feature_audit_splits,
    feature_signals,
    feature_white_box_scores,
    guess_grid,
    observed_feature_trial,
)
from dptune.config import DatasetSpec, TrialConfig
from dptune.config.params import sampling_rate, trial_steps
from dptune.data import Splits, load_dataset, poisson_subsample
from dptune.dpsgd import init_model

DELTA = 1e-5
ENGINES = ("bookkeeping", "ghost", "hooks", "functorch")


@pytest.fixture(scope="module")
def small() -> Splits:
    return poisson_subsample(load_dataset(DatasetSpec()), 0.2, seed=0)  # ~250 real training images


@pytest.fixture(autouse=True)
def one_thread() -> object:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 shared cores
    yield
    torch.set_num_threads(threads)


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")  # Opacus' ghost hooks on inputs without grad
@pytest.mark.parametrize("mode", ENGINES)
def test_one_step_puts_each_clipped_canary_on_its_own_column(small: Splits, mode: str) -> None:
    """σ ≈ 0, q = 1, one SGD step of the real engine on 16 real images and the included canaries: the step
    recovered from the two models holds, on each included canary's column, exactly its clipped contribution (norm
    a·C with the exact a the score uses, a ≥ 0.999: the column carries the clipped norm; direction u), and on every
    other canary column nothing (no real example and no other canary touches it)."""
    data = Splits((small.train[0][:16], small.train[1][:16]), small.val, small.test, small.num_classes,
                  small.input_shape)
    canaries = draw_feature_canaries(np.random.default_rng(3), canaries=6, num_classes=data.num_classes)
    inc = canaries.included
    assert 0 < inc.sum() < canaries.m
    config = TrialConfig(batch_size=feature_audit_basis(16, canaries), epochs=1.0, learning_rate=1.0, momentum=0.0,
                         clipping=mode, noise_multiplier=1e-6, score_noise=None, seed=11)
    obs = observed_feature_trial(config, data, canaries)
    assert (obs.result.clipping_mode, obs.result.steps) == (mode, 1)
    column = column_sums(obs)[0]  # [K, m], units of C
    x, a = feature_signals(obs)
    size = np.linalg.norm(column, axis=0)
    assert np.abs(size[inc] - a[0, inc]).max() < 2e-5  # measured: ≤ 1e-6 (float32 engine vs float64 oracle)
    assert np.abs(x[0, inc] - size[inc]).max() < 2e-5  # along u: the projection is the whole column
    assert a[0].min() > 0.999  # measured: 0.99982 (G = 1000, gn_cnn's ‖J‖ ≈ 25 at init)
    assert size[~inc].max() < 1e-4  # noise only (σC = 1e-6 per coordinate)


@pytest.mark.parametrize("clip", [1.0, 100.0])  # clipped (a = the column's share of the norm), not clipped
def test_directions_match_each_canarys_own_gradient(clip: float) -> None:
    """``column_directions``' closed form (one Jacobian of the base at the zero image for all canaries) against
    plain autograd on each canary alone: its clip factor over the whole per-example gradient, its column. G = 30
    here, so the base's part of the gradient is not negligible (a ≈ 0.8 when clipped)."""
    torch.manual_seed(0)
    data_shape = (1, 8, 8)
    canaries = draw_feature_canaries(np.random.default_rng(0), canaries=5, num_classes=10, value=30.0)
    empty = Splits((torch.zeros(0, *data_shape), torch.zeros(0, dtype=torch.int64)),
                   (torch.zeros(1, *data_shape), torch.zeros(1, dtype=torch.int64)),
                   (torch.zeros(1, *data_shape), torch.zeros(1, dtype=torch.int64)), 10, data_shape)
    config = feature_audit_config(TrialConfig(score_noise=None), empty, canaries)
    splits = feature_audit_splits(empty, canaries)
    model = init_model(config, splits)
    assert model.captured_from == FeatureCanaryModel.__name__  # the canary model, captured
    with torch.no_grad():
        model.canary.weight.normal_(0.0, 0.05)  # away from the zero init: logits of the canaries differ
    u, a = column_directions(model, canaries.labels, max_grad_norm=clip)
    model.double()
    for j in range(canaries.m):
        x = torch.zeros(1, 1, 1, 65, dtype=torch.float64)
        x[..., -1] = j + 1
        loss = torch.nn.functional.cross_entropy(model(x), torch.tensor([int(canaries.labels[j])]))
        names, params = zip(*model.named_parameters(), strict=True)
        grads = dict(zip(names, torch.autograd.grad(loss, params), strict=True))
        norm = math.sqrt(sum(float((g**2).sum()) for g in grads.values()))
        head = grads["canary.weight"]
        clipped = head[:, j] * min(1.0, clip / (norm + 1e-6)) / clip  # Opacus' factor, units of C
        assert float(clipped.norm()) == pytest.approx(a[j], rel=1e-9)
        assert np.allclose(clipped.numpy() / a[j], u[j], atol=1e-9)
        head[:, j] = 0
        assert float(head.abs().max()) == 0.0  # canary j touches no other column


def test_bookkeeping_audit_catches_half_the_noise_and_clears_the_real_trainer(small: Splits) -> None:
    """The f-DP one-run audit (``audit_fdp``) of the engine the shipped spaces run: 16,000 feature canaries, one
    full-batch trial (q = 1, T = 2: exactly μ-GDP, μ = √T/σ, as with Dirac canaries) of dptune's trainer with
    clipping: bookkeeping at a certified ε of 2, and one with half its noise (``noise_x0.5``, μ doubled). The
    projected noise is σ on every canary column, in or out (measured: 0.9988σ out, 0.9996σ in; a ≥ 0.99991).
    Measured: real ε ≥ 1.35, μ ≥ 0.387 (certified 1.997, 0.501); broken ε ≥ 2.79, μ ≥ 0.760: caught by both."""
    m = 16_000
    canaries = draw_feature_canaries(np.random.default_rng(5), canaries=m, num_classes=small.num_classes)
    basis = feature_audit_basis(len(small.train[1]), canaries)
    config = TrialConfig(batch_size=basis, epochs=2.0, learning_rate=0.5, momentum=0.9, clipping="bookkeeping",
                         score_noise=None, seed=7, model_kwargs={"width": 8})  # gn_cnn, narrow: 2 shared cores
    assert sampling_rate(batch_size=basis, basis=basis) == 1.0
    steps = trial_steps(epochs=config.epochs, batch_size=basis, basis=basis)
    sigma = calibrate_noise_multiplier([], sampling_rate=1.0, steps=steps, delta=DELTA, target_epsilon=2.0)
    certified = epsilon([trial_event(noise_multiplier=sigma, sampling_rate=1.0, steps=steps, score_noise=None)], DELTA)
    mu_certified = math.sqrt(steps) / sigma
    point = TrialPoint(noise_multiplier=sigma, sampling_rate=1.0, steps=steps, score_noise=None)
    inc = canaries.included
    found = {}
    for bug, noise in ((None, sigma), ("noise_x0.5", sigma / 2)):
        obs = observed_feature_trial(config.replace(noise_multiplier=sigma), small, canaries, bug=bug,
                                     charged_points=[point])
        assert (obs.result.clipping_mode, obs.result.steps) == ("bookkeeping", steps)
        x, a = feature_signals(obs)
        assert a.min() > 0.999  # the column carries the clipped norm
        assert x[:, ~inc].std() == pytest.approx(noise, rel=0.03)  # the noise on each canary's direction
        residual = x[:, inc] - a[:, inc]  # every included canary is in every step at q = 1
        assert residual.std() == pytest.approx(noise, rel=0.03)
        assert abs(residual.mean()) < 4 * noise / math.sqrt(residual.size)
        scores = feature_white_box_scores(obs, noise_multiplier=sigma, sampling_rate=1.0)
        found[bug] = audit_fdp(scores, inc, ks=guess_grid(m), delta=DELTA)
    real, broken = found[None], found["noise_x0.5"]
    assert real.epsilon < certified and real.mu < mu_certified, real
    assert broken.epsilon > certified and broken.mu > mu_certified, broken
