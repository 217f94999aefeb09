"""The bound holds by construction (issue 59): a user's model trains as a captured program, and the per-layer
engines run only a graph that proves each example stays in its row.

Round 5's classes, each a model that passed the old probe under some fast mode: it mixes rows only at one padded
batch size, only after N calls, only on a draw from numpy, ``random`` or Python state, only in eval(), or through a
module-level cache. For each, under every mode a user may name, the model is either refused before anything is
charged (ConfigError: exit 2 at the CLI) or trained exactly: measured on the program the trial trains, at every
padded size a trial of it can draw, each example moves the clipped sum by at most C·(1 + 1e-5), and the sum is the
sum of the examples' clipped gradients, each from a backward pass of that example alone."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dptune.config import ConfigError, TrialConfig, clipping
from dptune.dpsgd import ENGINES, engine_mode, make_engine, resolve_clipping, validate_model
from dptune.dpsgd._checked import checked_model
from dptune.dpsgd._guard import _clipped_sum, _guarded, probe_rows
from dptune.dpsgd._loop import padded_size
from dptune.dpsgd._rows import check_program
from dptune.models import build_model
from tests.conftest import factory_search, importable_module

MODULE = "dptune_test_captured_models"
SHAPE, CLASSES = (1, 8, 8), 10
MODES = ["auto", *(m for m, info in clipping.MODES.items() if info.per_example and not info.layerwise)]
ADVERSARIAL = '''
import random

import numpy as np
import torch
from torch import nn

CALLS = [0]
CACHE = {}


class Base(nn.Module):
    def __init__(self, k):
        super().__init__()
        self.fc, self.head = nn.Linear(64, 32), nn.Linear(32, k)
        self.calls = 0

    def body(self, x):
        return self.fc(x.flatten(1))

    def forward(self, x):
        return self.head(torch.tanh(self.mix(self.body(x))))


class AtSixteen(Base):  # a batch statistic only at the padded size 16 (Poisson batches of 9 to 16 rows reach it)
    def mix(self, h):
        return h + 4 * h.mean(0) if h.shape[0] == 16 else h


class AfterCalls(Base):  # a batch statistic from the third call of this instance on
    def mix(self, h):
        self.calls += 1
        return h + 4 * h.mean(0) if self.calls > 2 else h


class AfterGlobalCalls(Base):  # the same, counted in module state across every instance
    def mix(self, h):
        CALLS[0] += 1
        return h + 4 * h.mean(0) if CALLS[0] > 2 else h


class NumpyDraw(Base):  # a batch statistic on a draw from numpy's own generator
    def mix(self, h):
        return h + 4 * h.mean(0) if np.random.rand() < 0.5 else h


class RandomDraw(Base):  # ... from the random module
    def mix(self, h):
        return h + 4 * h.mean(0) if random.random() < 0.5 else h


class EvalOnly(Base):  # a batch statistic in eval() only (scoring)
    def mix(self, h):
        return h if self.training else h - h.mean(0)


class Cached(Base):  # the previous batch's mean, kept in a module-level cache
    def mix(self, h):
        out = h + CACHE["m"] if "m" in CACHE else h
        CACHE["m"] = h.mean(0).detach()
        return out


KINDS = {"at_sixteen": AtSixteen, "after_calls": AfterCalls, "after_global_calls": AfterGlobalCalls,
         "numpy_draw": NumpyDraw, "random_draw": RandomDraw, "eval_only": EvalOnly, "cached": Cached,
         "plain": type("Plain", (Base,), {"mix": lambda self, h: h})}


def make(num_classes, input_shape, groups, kind):
    return KINDS[kind](num_classes)
'''
KINDS = ["at_sixteen", "after_calls", "after_global_calls", "numpy_draw", "random_draw", "eval_only", "cached",
         "plain"]
BATCH = 12  # a trial's logical batch: Poisson batches up to probe_rows (26) rows, padded to 1, 2, 4, 8, 12, ..., 28


@pytest.fixture(scope="module")
def adversarial(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with importable_module(tmp_path_factory.mktemp("captured_models"), MODULE, ADVERSARIAL) as folder:
        yield folder


def _config(kind: str, mode: str) -> TrialConfig:
    return TrialConfig(model=f"factory:{MODULE}:make", model_kwargs={"kind": kind}, clipping=mode, batch_size=BATCH,
                       physical_batch_size=64, optimizer="sgd", momentum=0.0, learning_rate=1.0, score_noise=None)


def resolve(config: TrialConfig) -> str:
    return resolve_clipping(config, basis=1000)


def _flat(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in ts])


def _alone(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    params = [p for p in model.parameters() if p.requires_grad]
    return _flat(list(torch.autograd.grad(F.cross_entropy(model(x[None]), y[None]), params)))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", KINDS)
def test_a_model_is_refused_or_trained_exactly_at_every_padded_size(adversarial: Path, kind: str,
                                                                     mode: str) -> None:
    config = _config(kind, mode)
    _guarded.cache_clear()
    rows = probe_rows(config, resolve(config))
    gen = torch.Generator().manual_seed(11)
    x = torch.randn((rows, *SHAPE), generator=gen, dtype=torch.float64)
    y = torch.randint(0, CLASSES, (rows,), generator=gen)
    try:
        ran, _ = validate_model(config, CLASSES, SHAPE)  # the search's check before the charge
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(3)
            model = checked_model(build_model(config, CLASSES, SHAPE), config).double().train()
        alone = [_alone(model, x[i], y[i]) for i in range(rows)]
        c = float(torch.stack([g.norm() for g in alone]).median())  # about half the examples clipped
        engine = make_engine(ran, model, config.replace(max_grad_norm=c), torch.Generator().manual_seed(1),
                             noise_multiplier=0.0)
        check_program(model, SHAPE, engine_mode(engine), engine.sees_batch)  # the trial's own gate, on its model
    except ConfigError as e:  # refused with a field and a fix; exit 2 at the CLI (below)
        assert e.field in ("clipping", "model") and e.fix
        assert kind != "plain", f"the plain model was refused in {mode}: {e}"
        return
    clipped = [g * min(1.0, c / (float(g.norm()) + 1e-6)) for g in alone]
    sizes = sorted({n for n in range(1, rows + 1) if padded_size(n) != padded_size(n - 1) or n == rows} | {16, 9})
    assert padded_size(rows) == 28 and 16 in {padded_size(n) for n in sizes}
    for n in sizes:  # one engine across every pass, as a trial runs its steps
        full = _flat(_clipped_sum(engine, x, y, 1, list(range(n))))
        assert float((full - sum(clipped[:n])).norm()) <= 1e-5 * c * n, f"{kind}/{ran}: the sum at {n} rows"
        for j in {0, n - 1}:
            rest = _flat(_clipped_sum(engine, x, y, 1, [i for i in range(n) if i != j]))
            moved = float((full - rest).norm())
            assert moved <= c * (1 + 1e-5), f"{kind}/{ran}: example {j} of {n} moved the sum by {moved / c:.3g}·C"


def test_a_branch_on_the_batch_size_is_refused_by_name(adversarial: Path) -> None:
    for mode in MODES:
        with pytest.raises(ConfigError) as e:
            validate_model(_config("at_sixteen", mode), CLASSES, SHAPE)
        assert e.value.field == "model" and "cannot be captured" in e.value.problem
        assert "branch" in e.value.problem and "torch.where" in e.value.fix


def test_eval_mixing_is_refused_in_every_per_example_mode(adversarial: Path) -> None:
    for mode in MODES:
        with pytest.raises(ConfigError) as e:
            validate_model(_config("eval_only", mode), CLASSES, SHAPE)
        assert e.value.field == "model" and "in eval()" in e.value.problem and "mean" in e.value.problem


def test_the_fast_engines_take_a_graph_that_does_not_prove_only_by_name(adversarial: Path) -> None:
    """A graph holding a batch statistic (the module-level counter already past 2 at capture): refused for each
    engine that sees the batch, with the node and the fix; auto trains it in functorch and says why."""
    import importlib

    importlib.import_module(MODULE).CALLS[0] = 10  # every capture from now on holds h.mean(0)
    for mode in MODES:
        config = _config("after_global_calls", mode)
        _guarded.cache_clear()
        if mode in ("auto", "functorch"):
            with pytest.raises(ConfigError, match="in eval"):  # its eval graph mixes rows too: no mode scores it
                validate_model(config, CLASSES, SHAPE)
            continue
        assert ENGINES[mode].sees_batch
        with pytest.raises(ConfigError) as e:
            validate_model(config, CLASSES, SHAPE)
        assert e.value.field in ("clipping", "model") and "mean" in e.value.problem


@pytest.mark.ray
def test_search_cli_refuses_the_padded_size_model_with_exit_2_and_charges_nothing(adversarial: Path,
                                                                                   tmp_path: Path) -> None:
    res, charges = factory_search(tmp_path, adversarial, f"{MODULE}:make", {"kind": "at_sixteen"}, "bookkeeping")
    assert res.returncode == 2, res.stderr[-2000:]
    assert "model" in res.stderr and "cannot be captured" in res.stderr
    assert charges == []
