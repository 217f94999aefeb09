"""The clipping probe as a test of the engines (issue 59, item 3): every engine on every shipped model, at every
padded batch size a trial of it draws, measured against each example alone.

The trainer runs a shipped model's captured program (``checked_model``); the graph analysis proves it keeps the rows
apart, so what is left to test is each engine's arithmetic: at each padded size, the clipped sum equals the sum of
the examples' own gradients (each from a backward pass of that example alone) clipped by hand, within 1e-5·C per
example, and removing an example moves the sum by at most C·(1 + 1e-5). One engine instance across every pass, as
a trial runs its steps. ResNet-9 and WRN-16-4 (3×32×32) are in the slow suite."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dptune.config import TrialConfig
from dptune.dpsgd import ENGINES as REGISTRY
from dptune.dpsgd import engine_mode, make_engine
from dptune.dpsgd._checked import checked_model
from dptune.dpsgd._guard import _clipped_sum
from dptune.dpsgd._loop import padded_size
from dptune.models import build_model

ENGINES = ["hooks", "ghost", "bookkeeping", "functorch"]
ROWS = 40  # padded to 1, 2, 4, 8, then every multiple of 4 to 32, and 40 (the first multiple-of-8 bucket)
FAST = [("gn_cnn", (1, 8, 8)), ("tanh_cnn", (1, 28, 28)), ("mlp", (1, 8, 8))]
SLOW = [("resnet9", (3, 32, 32)), ("wrn16_4", (3, 32, 32))]


def _flat(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in ts])


def check(name: str, shape: tuple[int, int, int], mode: str, rows: int, device: str = "cpu") -> None:
    """``mode`` on ``name`` at every padded size up to ``rows``, on ``device`` (tests/test_gpu.py: CUDA), in float64."""
    config = TrialConfig(model=name, clipping=mode, groups=4, batch_size=rows, physical_batch_size=2 * rows,
                         optimizer="sgd", momentum=0.0, score_noise=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        model = checked_model(build_model(config, 10, shape), config).double().train().to(device)
    gen = torch.Generator().manual_seed(13)
    x = torch.randn((rows, *shape), generator=gen, dtype=torch.float64).to(device)
    y = torch.randint(0, 10, (rows,), generator=gen).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    alone = [_flat(list(torch.autograd.grad(F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]), params)))
             for i in range(rows)]
    c = float(torch.stack([g.norm() for g in alone]).median())  # about half of them clipped
    clipped = [g * min(1.0, c / (float(g.norm()) + 1e-6)) for g in alone]
    engine = make_engine(mode, model, config.replace(max_grad_norm=c), torch.Generator().manual_seed(1),
                         noise_multiplier=0.0)
    # an engine that cannot run a model hands it to functorch (book-keeping and WRN's weight-standardised convs)
    assert engine_mode(engine) == mode or (engine_mode(engine) == "functorch" and not REGISTRY[mode].supports(model))
    sizes = sorted({n for n in range(2, rows + 1) if padded_size(n) != padded_size(n - 1)} | {1, 3, rows - 1, rows})
    assert {padded_size(n) for n in sizes} == {padded_size(n) for n in range(1, rows + 1)}
    for n in sizes:
        full = _flat(_clipped_sum(engine, x, y, 1, list(range(n))))
        error = float((full - sum(clipped[:n])).norm())
        assert error <= 1e-5 * c * n, f"{name}/{mode} at {n} rows: {error / c:.3g}·C from the reference"
        # against the empty batch (noise only: the loop calls engine.empty(), no backward) the sum is zero
        rest = _flat(_clipped_sum(engine, x, y, 1, list(range(n - 1)))) if n > 1 else torch.zeros_like(full)
        moved = float((full - rest).norm())
        assert moved <= c * (1 + 1e-5), f"{name}/{mode}: the last of {n} examples moved the sum by {moved / c:.4g}·C"


@pytest.mark.parametrize("mode", ENGINES)
@pytest.mark.parametrize(("name", "shape"), FAST)
def test_every_engine_is_exact_on_the_shipped_models_at_every_padded_size(name: str, shape: tuple[int, int, int],
                                                                           mode: str) -> None:
    check(name, shape, mode, ROWS)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ENGINES)
@pytest.mark.parametrize(("name", "shape"), SLOW)
def test_every_engine_is_exact_on_the_large_shipped_models(name: str, shape: tuple[int, int, int], mode: str) -> None:
    check(name, shape, mode, 20)  # padded to 1, 2, 4, 8, 12, 16 and 20
