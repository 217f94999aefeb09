"""Batch clipping (issue 24; van Dijk et al. 2023): the batch's mean gradient clipped to C, noise on it, BatchNorm
allowed only here, and the 2C sensitivity charged (σ/2 per step)."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from dp_accounting import dp_event as de
from dp_accounting.rdp import RdpAccountant
from torch import nn

from dptune.accounting import TrialPoint, plan_search, round_up_epsilon
from dptune.config import ConfigError, TrialConfig, clipping, load_space
from dptune.dpsgd import ChargeMismatch, make_engine, run_trial, validate_model
from dptune.dpsgd._checked import checked_model
from dptune.models import build_model

ROOT = Path(__file__).resolve().parent.parent
SPACE = ROOT / "search_spaces" / "digits_batch_clipping.yaml"
BN = TrialConfig(model="gn_cnn", model_kwargs={"norm": "batch"}, clipping="batch", batch_size=16,
                 physical_batch_size=16, noise_multiplier=1.0, max_grad_norm=0.01)


def _clipped_mean(model: nn.Module, cfg: TrialConfig, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """What the optimizer adds its noise to, for one batch (σ = 0)."""
    engine = make_engine("batch", model, cfg, torch.Generator().manual_seed(0), noise_multiplier=0.0)
    engine.backward(x, y, 0, len(y))
    engine.optimizer.pre_step()
    out = [p.summed_grad.detach().clone() for p in engine.params]  # type: ignore[attr-defined]
    engine.optimizer.zero_grad(set_to_none=True)
    return out


def _norm(ts: list[torch.Tensor]) -> float:
    return float(torch.sqrt(sum((t.double() ** 2).sum() for t in ts)))  # type: ignore[arg-type]


def test_the_step_is_the_clipped_batch_mean_by_hand() -> None:
    torch.manual_seed(0)
    model = checked_model(build_model(BN, 10, (1, 8, 8)), BN)
    x, y = torch.randn(5, 1, 8, 8), torch.arange(5)
    ref = copy.deepcopy(model)
    grads = torch.autograd.grad(F.cross_entropy(ref(x), y), list(ref.parameters()))  # the batch's mean loss
    norm = _norm(list(grads))
    assert norm > BN.max_grad_norm  # the clip is active
    got = _clipped_mean(model, BN, x, y)
    expected = [g * BN.max_grad_norm / (norm + 1e-6) for g in grads]
    assert max(float((a - b).abs().max()) for a, b in zip(got, expected, strict=True)) < 1e-8
    assert _norm(got) == pytest.approx(BN.max_grad_norm, rel=1e-5)
    # padding rows (the trainer pads physical batches) are dropped before BatchNorm sees them
    xp, yp = torch.cat([x, torch.zeros(3, 1, 8, 8)]), torch.cat([y, torch.zeros(3, dtype=torch.long)])
    engine = make_engine("batch", model, BN, torch.Generator().manual_seed(0), noise_multiplier=0.0)
    engine.backward(xp, yp, 0, 5)
    engine.optimizer.pre_step()
    padded = [p.summed_grad for p in engine.params]  # type: ignore[attr-defined]
    assert max(float((a - b).abs().max()) for a, b in zip(padded, expected, strict=True)) < 1e-8


def test_an_empty_batch_steps_on_noise_only() -> None:
    torch.manual_seed(0)
    model = checked_model(build_model(BN, 10, (1, 8, 8)), BN)
    engine = make_engine("batch", model, BN, torch.Generator().manual_seed(1))
    engine.empty()
    engine.optimizer.pre_step()
    noise = torch.cat([p.grad.flatten() for p in engine.params])  # type: ignore[union-attr]
    assert float(noise.std()) == pytest.approx(BN.noise_multiplier * BN.max_grad_norm, rel=0.1)


def test_batchnorm_trains_only_under_batch_clipping() -> None:
    assert validate_model(BN, 10, (1, 8, 8))[0] == "batch"
    for mode in ("auto", *(m for m, info in clipping.MODES.items() if info.per_example and not info.layerwise)):
        with pytest.raises(ConfigError, match="BatchNorm.*fixed.clipping: batch"):
            validate_model(BN.replace(clipping=mode), 10, (1, 8, 8))
    # the BN model keeps no running statistics: nothing un-noised about the data is ever stored
    model = checked_model(build_model(BN, 10, (1, 8, 8)), BN)
    assert not any("running" in k or "num_batches" in k for k in model.state_dict())


def test_one_example_moves_the_clipped_mean_by_up_to_2c_and_no_more() -> None:
    """Adversarial examples: one added example flips the clipped mean, a 2C movement; per-example clipping moves the
    sum by at most C for the same examples (so the 2C charge is needed, and enough)."""
    c = 0.1
    cfg = TrialConfig(clipping="batch", batch_size=4, physical_batch_size=8, noise_multiplier=1.0, max_grad_norm=c)

    def fresh() -> nn.Module:
        m = nn.Sequential(nn.Flatten(), nn.Linear(4, 2, bias=False))
        nn.init.zeros_(m[1].weight)  # softmax 1/2: an example (v, label) has gradient (p - onehot) v^T
        return m

    v = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    batch_x, batch_y = v.view(1, 1, 1, 4), torch.tensor([0])
    adversary_x, adversary_y = (3 * v).view(1, 1, 1, 4), torch.tensor([1])  # gradient -3x the batch's
    before = _clipped_mean(fresh(), cfg, batch_x, batch_y)
    after = _clipped_mean(fresh(), cfg, torch.cat([batch_x, adversary_x]), torch.cat([batch_y, adversary_y]))
    moved = _norm([a - b for a, b in zip(after, before, strict=True)])
    assert moved == pytest.approx(2 * c, rel=1e-4)  # the bound is attained: σ/2 is not pessimism
    # random search for anything larger: batches and added examples of every scale
    gen = torch.Generator().manual_seed(0)
    worst = 0.0
    for trial in range(200):
        n = 1 + trial % 5
        xs = torch.randn((n + 1, 1, 1, 4), generator=gen) * 10 ** float(torch.rand(1, generator=gen) * 4 - 2)
        ys = torch.randint(0, 2, (n + 1,), generator=gen)
        m = nn.Sequential(nn.Flatten(), nn.Linear(4, 2))
        torch.nn.init.normal_(m[1].weight, generator=gen)
        with_x = _clipped_mean(copy.deepcopy(m), cfg, xs, ys)
        without = _clipped_mean(copy.deepcopy(m), cfg, xs[:n], ys[:n])
        worst = max(worst, _norm([a - b for a, b in zip(with_x, without, strict=True)]))
    assert c < worst <= 2 * c * (1 + 1e-6)


def test_the_charge_is_the_per_example_charge_at_half_sigma() -> None:
    space = load_space(SPACE)
    plan = plan_search(space, 1257, compare=False)
    sigma = 10.0  # the space's smallest noise multiplier
    assert {p.noise_multiplier for p in plan.points} == {sigma / 2}
    # dp_accounting, by hand: one worst-case trial = T steps of Poisson-sampled Gaussian at σ/2, plus the score
    worst = max(plan.points, key=lambda p: (p.sampling_rate, p.steps))
    event = de.ComposedDpEvent([
        de.SelfComposedDpEvent(de.PoissonSampledDpEvent(worst.sampling_rate, de.GaussianDpEvent(sigma / 2)),
                               worst.steps),
        de.GaussianDpEvent(space.privacy.score_noise)])
    acc = RdpAccountant()
    acc.compose(event)
    assert plan.trial_epsilon <= round_up_epsilon(acc.get_epsilon(space.privacy.delta) * (1 + 1e-9))  # on the grid
    # and exactly the plan of the same space clipped per example at σ/2
    per_example = load_space(ROOT / "search_spaces" / "digits.yaml")
    assert per_example.space["noise_multiplier"].low == sigma / 2  # type: ignore[attr-defined]
    assert plan.search_epsilon == pytest.approx(plan_search(per_example, 1257, compare=False).search_epsilon,
                                                rel=1e-12)


def test_a_trial_refuses_a_charge_at_the_per_example_sensitivity(digits: Any) -> None:
    """What runs decides the charge: a batch-clipping trial charged as if it clipped per example does not start."""
    cfg = load_space(SPACE).default.replace(seed=3, score_noise=None, epochs=1.0)
    q = cfg.batch_size / len(digits.train[1])
    steps = math.ceil(1 / q - 1e-9)
    as_per_example = TrialPoint(noise_multiplier=cfg.noise_multiplier, sampling_rate=q, steps=steps, score_noise=None)
    with pytest.raises(ChargeMismatch, match="refusing to start"):
        run_trial(cfg, digits, charged_points=[as_per_example])
    halved = TrialPoint(noise_multiplier=cfg.noise_multiplier / 2, sampling_rate=q, steps=steps, score_noise=None)
    r = run_trial(cfg, digits, charged_points=[halved])
    assert r.steps == r.noise_additions == steps


def test_trials_measure_the_noise_they_add_and_batchnorm_learns(digits: Any) -> None:
    """Real training on digits: the noise measured from the tensors is σ·C on the mean, every step; at the paper's
    tiny σ the BatchNorm CNN learns, at the σ a comparable ε needs it does not (the 2B noise ratio)."""
    space = load_space(SPACE)
    tiny = space.default.replace(noise_multiplier=0.01875, learning_rate=0.1, seed=5, score_noise=None, epochs=5.0)
    r = run_trial(tiny, digits, evaluate_test=True)
    assert r.steps == r.noise_additions
    assert r.noise_std == pytest.approx(0.01875 * tiny.max_grad_norm, rel=0.02)
    assert r.test_accuracy is not None and r.test_accuracy > 0.85
    noisy = run_trial(tiny.replace(noise_multiplier=10.0), digits, evaluate_test=True)
    assert noisy.noise_std == pytest.approx(10.0, rel=0.02)
    assert noisy.test_accuracy is not None and noisy.test_accuracy < 0.5


def test_a_planned_final_run_refuses_batch_clipping() -> None:
    import yaml

    from dptune.config import parse_space

    raw = yaml.safe_load((ROOT / "search_spaces" / "mnist.yaml").read_text())
    raw["fixed"]["clipping"] = "batch"
    with pytest.raises(ConfigError, match="fixed.clipping.*batch clipping is not planned"):
        parse_space(raw)


def test_a_batchnorm_score_depends_on_each_validation_example_alone(digits: Any) -> None:
    """The released score's sensitivity is 1 correct prediction: changing one validation example may change only its
    own prediction, even though BatchNorm normalises with batch statistics (measured on the trained model)."""
    import dataclasses

    cfg = load_space(SPACE).default.replace(noise_multiplier=0.01875, seed=5, score_noise=None, epochs=2.0)
    r = run_trial(cfg, digits, return_model=True)
    changed = digits.val[0].clone()
    changed[0] = changed[0] * 50 + 3  # one validation example, far out of distribution
    r2_data = dataclasses.replace(digits, val=(changed, digits.val[1]))
    r2 = run_trial(cfg, r2_data, return_model=True)  # the same seed: the same model (validation is not trained on)
    assert r.model_state is not None and r2.model_state is not None
    assert all(torch.equal(r.model_state[k], r2.model_state[k]) for k in r.model_state)
    n = len(digits.val[1])
    assert abs(r.val_accuracy_raw * n - r2.val_accuracy_raw * n) <= 1 + 1e-9
