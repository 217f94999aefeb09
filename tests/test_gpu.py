"""The GPU path (marker ``gpu``; skipped without CUDA, never in the default suite): every clipping engine trains
on CUDA with the noise it is charged for, and a Ray search that is granted a GPU runs its trials on it.

Run on a GPU machine: ``python -m pytest -m gpu tests/test_gpu.py`` (``bench/gpu_check.sh`` does, with the
engines' CUDA/CPU timings beside it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from dptune.config import clipping, load_space
from dptune.dpsgd import run_trial
from tests.conftest import digits_seed_with_k

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ROOT = Path(__file__).resolve().parent.parent
DIGITS = ROOT / "search_spaces" / "digits.yaml"
BATCH = ROOT / "search_spaces" / "digits_batch_clipping.yaml"


@pytest.mark.parametrize("mode", [m for m, info in clipping.MODES.items() if not info.layerwise])  # alc: public data
def test_every_engine_trains_on_cuda_with_the_charged_noise(digits: Any, mode: str) -> None:
    per_example = clipping.mode(mode).per_example  # batch clipping: its own space (BatchNorm) and σ
    space = load_space(DIGITS if per_example else BATCH)
    sigma = 0.5 if per_example else 0.05
    cfg = space.default.replace(clipping=mode, noise_multiplier=sigma, seed=11, score_noise=None, epochs=4.0)
    r = run_trial(cfg, digits, device="cuda", evaluate_test=True)
    assert not r.diverged and r.steps == r.noise_additions > 0
    assert r.noise_std == pytest.approx(sigma * cfg.max_grad_norm, rel=0.03)  # drawn on the GPU, measured there
    assert r.test_accuracy is not None and r.test_accuracy > 0.6


def test_a_ray_search_granted_a_gpu_runs_its_trials_on_it(tmp_path: Path) -> None:
    import dptune
    from dptune.trials import read_trials

    found = dptune.search(DIGITS, budget_epsilon=30, ledger=tmp_path / "l.sqlite", runs_dir=tmp_path, name="g",
                          seed=digits_seed_with_k(2, 4), epochs=2, num_cpus=4, gpus_per_trial="auto")
    rows = read_trials(found.run / "sealed" / "trials.parquet")
    assert len(rows) >= 2 and all(r.measured.get("device") == "cuda" for r in rows)
    assert all(r.steps == r.measured["noise_additions"] for r in rows)
    model = dptune.train(found, target_epsilon=found.epsilon + 4, epochs=2, seed=1)  # the final run: cuda by default
    assert 0.5 < model.metrics["test_accuracy"] <= 1


def _layerwise(cfg: Any, digits: Any) -> Any:
    """``cfg`` under clipping alc with C split evenly over its layers (C_l = C/√L, so √ΣC_l² = C)."""
    import math

    from dptune.dpsgd._alc import layer_of
    from dptune.models import build_model

    model = build_model(cfg.replace(clipping="auto"), digits.num_classes, digits.input_shape)
    layers = sorted({layer_of(n) for n, p in model.named_parameters() if p.requires_grad})
    c = cfg.max_grad_norm / math.sqrt(len(layers))
    return cfg.replace(clipping="alc", layer_clip={name: c for name in layers})


def test_layerwise_clipping_trains_on_cuda(digits: Any) -> None:
    cfg = _layerwise(load_space(DIGITS).default.replace(noise_multiplier=0.5, seed=12, score_noise=None,
                                                         epochs=4.0), digits)
    r = run_trial(cfg, digits, device="cuda", evaluate_test=True)
    assert r.clipping_mode == "alc" and r.steps == r.noise_additions > 0
    assert r.noise_std == pytest.approx(0.5 * cfg.max_grad_norm, rel=0.03)
    assert r.test_accuracy is not None and r.test_accuracy > 0.6


def test_a_group_on_cuda_does_not_show_its_company(digits: Any) -> None:
    """``--group-trials`` on a GPU: the members' chunks go through whole-model vmap calls ``ACCELERATOR_LANES``
    wide, whatever the group. A trial's parameters in a group of one and in a group of three differ no more than
    the same group of one run twice (the device's own run-to-run difference: 0 where its kernels are
    deterministic), and each member runs its own charge (T noise additions of std σ·C)."""
    from dptune.dpsgd import TrialResult, run_group

    base = load_space(DIGITS).default.replace(clipping="functorch", score_noise=None, epochs=2.0)
    cfgs = [base.replace(noise_multiplier=0.5 + 0.5 * i, learning_rate=base.learning_rate * (1 + 0.5 * i),
                         seed=2**100 + 31 + i) for i in range(3)]

    def params(r: Any) -> dict[str, torch.Tensor]:
        assert isinstance(r, TrialResult) and r.model_state is not None
        return r.model_state

    def maxdiff(a: Any, b: Any) -> float:
        return max(float((params(a)[k] - params(b)[k]).abs().max()) for k in params(a))

    one = run_group(cfgs[:1], digits, device="cuda", return_model=True)[0]
    again = run_group(cfgs[:1], digits, device="cuda", return_model=True)[0]
    three = run_group(cfgs, digits, device="cuda", return_model=True)
    floor = maxdiff(one, again)
    assert maxdiff(one, three[0]) <= floor, f"company moved the trial beyond the device's run-to-run {floor:.3g}"
    for c, r in zip(cfgs, three, strict=True):
        assert isinstance(r, TrialResult) and r.steps == r.noise_additions > 0
        assert r.noise_std == pytest.approx(c.noise_multiplier * c.max_grad_norm, rel=0.03)


def test_a_grouped_ray_search_granted_a_gpu_runs_its_trials_on_it(tmp_path: Path) -> None:
    import dptune
    from dptune.trials import read_trials

    found = dptune.search(DIGITS, budget_epsilon=30, ledger=tmp_path / "l.sqlite", runs_dir=tmp_path, name="g",
                          seed=digits_seed_with_k(2, 4), epochs=2, num_cpus=4, gpus_per_trial="auto",
                          group_trials=True)
    rows = read_trials(found.run / "sealed" / "trials.parquet")
    assert len(rows) >= 2 and all(r.measured.get("device") == "cuda" for r in rows)
    assert all(r.steps == r.measured["noise_additions"] for r in rows)


def test_bookkeeping_on_cuda_is_functorch_with_its_group_norms_from_their_backward(digits: Any) -> None:
    """On CUDA the book-keeping engine's GroupNorms (_GroupNormRows: the batch as one row of N·C channels) give
    nn.GroupNorm's output and input gradient, and the engine's clipped sum is functorch's (checked bit for bit on
    CPU in the default suite; here to float tolerance, since CUDA reductions may order their sums differently)."""
    from torch import nn

    from dptune.dpsgd import init_model, make_engine
    from dptune.dpsgd._bookkeeping import _GroupNormRows

    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(64, 16, 8, 8, generator=gen) * 3 + 2).cuda().requires_grad_()
    g = torch.randn(64, 16, 8, 8, generator=gen).cuda()
    norm = nn.GroupNorm(4, 16).cuda()
    expected = norm(x)
    kept: list[Any] = []
    got = _GroupNormRows.apply(x, norm.weight, norm.bias, 4, norm.eps, kept.append)
    assert torch.allclose(got, expected, atol=1e-5)
    assert torch.allclose(torch.autograd.grad(got, x, g)[0], torch.autograd.grad(expected, x, g)[0], atol=1e-4)
    xhat = torch.nn.functional.group_norm(x.detach(), 4, eps=norm.eps)
    assert torch.allclose(kept[0][0], (g * xhat).sum((2, 3)), atol=1e-3)

    cfg = load_space(DIGITS).default.replace(max_grad_norm=0.5, seed=3)
    xb, yb = digits.train[0][:40].cuda(), digits.train[1][:40].cuda()
    sums = []
    for mode in ("functorch", "bookkeeping"):
        torch.manual_seed(0)
        engine = make_engine(mode, init_model(cfg, digits).cuda(), cfg, torch.Generator(device="cuda"),
                             noise_multiplier=0.0)
        engine.backward(xb, yb, 0, 36)  # the last four rows: padding
        if mode == "functorch":
            engine.optimizer.clip_and_accumulate()
            sums.append([p.summed_grad.view_as(p) for p in engine.params])
        else:
            sums.append([p.grad for p in engine.params])
    for a, b in zip(*sums, strict=True):
        assert torch.allclose(a, b, atol=1e-5), a.shape


@pytest.mark.parametrize("mode", ["hooks", "ghost", "bookkeeping", "functorch"])
@pytest.mark.parametrize(("name", "shape"), [("gn_cnn", (1, 8, 8)), ("tanh_cnn", (1, 28, 28)), ("resnet9", (3, 32, 32)),
                                             ("wrn16_4", (3, 32, 32))])
def test_every_engine_is_exact_on_cuda_at_every_padded_size(name: str, shape: tuple[int, int, int], mode: str) -> None:
    """The CPU suite's engine test (tests/test_engines_padded.py) on CUDA, where the engines take their GPU branches
    (the streamed layer as one block, the pixel-Gram ghost norm, the kept-or-ghost rule, the CNNs' layout on CUDA):
    each clipped sum against each example's own gradient, clipped by hand, at every padded size to 20 rows."""
    from tests.test_engines_padded import check

    check(name, shape, mode, 20, device="cuda")
