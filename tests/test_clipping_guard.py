"""Each example moves the clipped sum by at most C, for any model a user brings, in every clipping mode.

Models of every kind the adversarial review found (a weight used outside its module's call, a Linear over
(N·P, d) rows, reflect/circular padding, batch statistics without a BatchNorm module, in-place ops after a
hooked layer, a module called twice, a weight-transforming subclass, a frozen weight with a trainable bias, an
extra-parameter subclass, legacy weight_norm) × every clipping mode: the model is refused before anything is
charged, or the engine the trial runs gives every example a contribution of norm <= C·(1 + 1e-6) and a clipped
sum within 1e-6·C of the reference (each example alone through autograd, clipped by hand; float64). The
measurement is the test's own: parameters moved by one real noise-free optimizer step, not the guard's fields.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dptune.config import ConfigError, TrialConfig, clipping
from dptune.dpsgd import engine_mode, make_engine, validate_model
from dptune.dpsgd._checked import checked_model
from dptune.dpsgd._guard import guarded_clipping
from dptune.models import build_model
from tests.conftest import factory_search, importable_module

MODULE = "dptune_test_guard_models"
SHAPE, CLASSES = (1, 8, 8), 10
# auto and every per-example mode that clips the whole gradient (asked of the registry: batch clipping and alc
# have probes of their own, tests/test_batch_clipping.py, tests/test_alc.py)
MODES = ["auto", *(m for m, info in clipping.MODES.items() if info.per_example and not info.layerwise)]
USER_MODELS = '''
import torch
import torch.nn.functional as F
from torch import nn


def _head(d, k):
    return nn.Linear(d, k)


class TiedFunctional(nn.Module):  # a weight also used outside its module's call (F.linear(h, fc.weight))
    def __init__(self, k):
        super().__init__()
        self.fc = nn.Linear(64, 64)
        self.head = nn.Linear(64, k)

    def forward(self, x):
        h = torch.tanh(self.fc(x.flatten(1)))
        return self.head(torch.tanh(F.linear(h, self.fc.weight)))


class TiedShared(nn.Module):  # one Parameter owned by two modules (a tied decoder)
    def __init__(self, k):
        super().__init__()
        self.enc, self.dec = nn.Linear(64, 64), nn.Linear(64, 64)
        self.dec.weight = self.enc.weight
        self.head = nn.Linear(64, k)

    def forward(self, x):
        return self.head(torch.tanh(self.dec(torch.tanh(self.enc(x.flatten(1))))))


class Patches(nn.Module):  # a Linear over (N*P, d) rows: P = 4 patches of 16 pixels per example
    def __init__(self, k):
        super().__init__()
        self.proj = nn.Linear(16, 8)
        self.head = nn.Linear(32, k)

    def forward(self, x):
        n = x.shape[0]
        return self.head(torch.tanh(self.proj(x.reshape(n * 4, 16))).reshape(n, 32))


class Padded(nn.Module):
    def __init__(self, k, mode):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1, padding_mode=mode)
        self.norm = nn.GroupNorm(2, 4)
        self.head = nn.Linear(256, k)

    def forward(self, x):
        return self.head(torch.tanh(self.norm(self.conv(x))).flatten(1))


class Centered(nn.Module):  # a batch statistic without a BatchNorm module
    def __init__(self, k, functional):
        super().__init__()
        self.fc, self.head, self.functional = nn.Linear(64, 32), nn.Linear(32, k), functional

    def forward(self, x):
        h = self.fc(x.flatten(1))
        h = F.batch_norm(h, None, None, training=True) if self.functional else h - h.mean(0)
        return self.head(torch.tanh(h))


class TrainCentered(Centered):  # a batch statistic in training only: eval() is per example
    def forward(self, x):
        h = self.fc(x.flatten(1))
        if self.training:
            h = h - h.mean(0)
        return self.head(torch.tanh(h))


class InplaceRelu(nn.Module):
    def __init__(self, k):
        super().__init__()
        self.fc, self.head = nn.Linear(64, 32), nn.Linear(32, k)

    def forward(self, x):
        return self.head(F.relu(self.fc(x.flatten(1)), inplace=True))


class Residual(nn.Module):  # out += identity after a hooked layer
    def __init__(self, k):
        super().__init__()
        self.fc, self.fc2, self.head = nn.Linear(64, 32), nn.Linear(32, 32), nn.Linear(32, k)

    def forward(self, x):
        h = torch.tanh(self.fc(x.flatten(1)))
        out = self.fc2(h)
        out += h
        return self.head(out)


class Twice(nn.Module):  # one module called twice per forward
    def __init__(self, k):
        super().__init__()
        self.fc, self.head = nn.Linear(64, 64), nn.Linear(64, k)

    def forward(self, x):
        return self.head(torch.tanh(self.fc(torch.tanh(self.fc(x.flatten(1))))))


class ScaledLinear(nn.Linear):  # isinstance(Linear), but its forward transforms the weight
    def forward(self, x):
        return F.linear(x, torch.tanh(self.weight) * 2.0, self.bias)


class GatedLinear(nn.Linear):  # an extra parameter the Linear rule knows nothing of
    def __init__(self, i, o):
        super().__init__(i, o)
        self.gate = nn.Parameter(torch.ones(o))

    def forward(self, x):
        return super().forward(x) * self.gate


def _mlp(first, k):
    return nn.Sequential(nn.Flatten(), first, nn.Tanh(), nn.Linear(32, k))


def _weight_norm(k):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _mlp(torch.nn.utils.weight_norm(nn.Linear(64, 32)), k)


def _frozen_weight(k):
    first = nn.Linear(64, 32)
    first.weight.requires_grad_(False)
    return _mlp(first, k)


KINDS = {
    "tied_functional": TiedFunctional, "tied_shared": TiedShared, "patches": Patches,
    "reflect": lambda k: Padded(k, "reflect"), "circular": lambda k: Padded(k, "circular"),
    "centered": lambda k: Centered(k, False), "functional_bn": lambda k: Centered(k, True),
    "train_centered": lambda k: TrainCentered(k, False),
    "inplace_relu": InplaceRelu, "residual_inplace": Residual, "twice": Twice,
    "scaled_linear": lambda k: _mlp(ScaledLinear(64, 32), k), "frozen_weight": _frozen_weight,
    "gated": lambda k: _mlp(GatedLinear(64, 32), k), "weight_norm": _weight_norm,
    # the control: an ordinary GroupNorm CNN
    "plain": lambda k: nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.Tanh(), nn.Flatten(),
                                     nn.Linear(256, k)),
}


def make(num_classes, input_shape, groups, kind):
    return KINDS[kind](num_classes)
'''
KINDS = ["tied_functional", "tied_shared", "patches", "reflect", "circular", "centered", "functional_bn", "train_centered",
         "inplace_relu", "residual_inplace", "twice", "scaled_linear", "frozen_weight", "gated", "weight_norm",
         "plain"]  # the keys of USER_MODELS' KINDS


@pytest.fixture(scope="module")
def user_models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with importable_module(tmp_path_factory.mktemp("guard_models"), MODULE, USER_MODELS) as folder:
        yield folder


def _config(kind: str, mode: str) -> TrialConfig:
    return TrialConfig(model=f"factory:{MODULE}:make", model_kwargs={"kind": kind}, clipping=mode, batch_size=4,
                       optimizer="sgd", momentum=0.0, learning_rate=1.0, score_noise=None)


def _flat(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in ts]).double()


Build = Callable[[], nn.Module]


def _measured_sum(build: Build, config: TrialConfig, mode: str, x: torch.Tensor, y: torch.Tensor,
                  rows: list[int]) -> torch.Tensor:
    """The clipped sum of ``rows`` as the run applies it: one real noise-free SGD step (lr 1, no momentum) of
    the engine the trial runs moves the parameters by -S/B; padding as the trainer pads (zero rows)."""
    m = build()
    engine = make_engine(mode, m, config, torch.Generator().manual_seed(1), noise_multiplier=0.0)
    assert engine_mode(engine) == mode
    before = [p.detach().clone() for p in engine.params]
    pad = 2
    xb = torch.cat([x[rows], x.new_zeros((pad, *x.shape[1:]))])
    yb = torch.cat([y[rows], y.new_zeros(pad)])
    engine.backward(xb, yb, 0, len(rows))
    engine.optimizer.step()
    return -_flat([p.detach() - b for p, b in zip(engine.params, before, strict=True)]) * config.batch_size


def _reference(build: Build, x: torch.Tensor, y: torch.Tensor, clip: float) -> list[torch.Tensor]:
    out = []
    for i in range(len(y)):
        m = build()
        params = [p for p in m.parameters() if p.requires_grad]
        grads = torch.autograd.grad(F.cross_entropy(m(x[i:i + 1]), y[i:i + 1]), params, allow_unused=True)
        g = _flat([torch.zeros_like(p) if gi is None else gi for p, gi in zip(params, grads, strict=True)])
        out.append(g * min(1.0, clip / (float(g.norm()) + 1e-6)))
    return out


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", KINDS)
def test_every_example_moves_the_sum_by_at_most_c_or_the_model_is_refused(user_models: Path, kind: str,
                                                                          mode: str) -> None:
    config = _config(kind, mode)
    try:
        ran, _ = validate_model(config, CLASSES, SHAPE)
    except ConfigError as e:  # refused before anything is charged, with a fix that names a mode or the model
        assert e.field in ("clipping", "model")
        assert kind != "plain", f"the ordinary GroupNorm CNN was refused in {mode}: {e}"
        return

    def model() -> nn.Module:  # rebuilt, not deep-copied (legacy weight_norm cannot be copied); the program that
        with torch.random.fork_rng(devices=[]):  # trains: the captured model (checked_model), not the user's Python
            torch.manual_seed(3)
            return checked_model(build_model(config, CLASSES, SHAPE), config).double().train()

    gen = torch.Generator().manual_seed(7)  # other inputs than the guard's
    x = torch.randn((4, *SHAPE), generator=gen, dtype=torch.float64)
    y = torch.randint(0, CLASSES, (4,), generator=gen)
    probe = _reference(model, x, y, clip=float("inf"))
    clip = 0.5 * min(float(g.norm()) for g in probe)  # every example clipped: a wrong norm is a wrong scale
    ref = _reference(model, x, y, clip)
    cfg = config.replace(max_grad_norm=clip)
    everyone = list(range(4))
    total = _measured_sum(model, cfg, ran, x, y, everyone)
    assert float((total - sum(ref)).norm()) <= 1e-6 * clip, f"{kind}/{ran}: the clipped sum is not the reference"
    for j in everyone:
        moved = total - _measured_sum(model, cfg, ran, x, y, [i for i in everyone if i != j])
        assert float(moved.norm()) <= clip * (1 + 1e-6), f"{kind}/{ran}: example {j} moved the sum by > C"
        assert float((moved - ref[j]).norm()) <= 1e-6 * clip


@pytest.mark.parametrize("kind", ["patches", "tied_functional", "centered"])
def test_a_per_layer_mode_that_under_clips_is_refused_by_name(user_models: Path, kind: str) -> None:
    mode = {"patches": "hooks", "tied_functional": "ghost", "centered": "bookkeeping"}[kind]
    with pytest.raises(ConfigError) as e:
        validate_model(_config(kind, mode), CLASSES, SHAPE)
    assert e.value.field in ("clipping", "model")
    if kind != "centered":  # functorch isolates examples: the error offers it
        assert e.value.field == "clipping" and "functorch" in e.value.fix and mode in e.value.problem


def test_auto_falls_back_to_functorch_and_says_so(user_models: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the graph does not prove auto's per-layer choice exact for the model (a batch statistic in training),
    auto runs functorch and the note names the node."""
    from dptune.dpsgd import AUTO_CLIPPING
    from dptune.dpsgd._guard import _guarded

    config = _config("train_centered", "auto")
    monkeypatch.setitem(AUTO_CLIPPING, config.model, "bookkeeping")  # as auto picks for gn_cnn and resnet9
    _guarded.cache_clear()
    try:
        mode, note = guarded_clipping(config, CLASSES, SHAPE)
    finally:
        _guarded.cache_clear()
    assert mode == "functorch"
    assert note is not None and "bookkeeping needs a model graph that keeps the rows" in note and "mean" in note
    mode, note = guarded_clipping(TrialConfig(model="gn_cnn", clipping="auto"), CLASSES, SHAPE)
    assert mode == "bookkeeping" and note is None


def test_bookkeeping_skips_frozen_weights(user_models: Path) -> None:
    """A frozen weight with a trainable bias: book-keeping counted the frozen weight's gradient in the norm
    (over-clipping to 0.69·C); now its norm is over trainable parameters only, so the guard accepts it."""
    ran, _ = validate_model(_config("frozen_weight", "bookkeeping"), CLASSES, SHAPE)
    assert ran == "bookkeeping"


def test_the_guard_costs_little_on_the_shipped_models() -> None:
    for model, shape in (("gn_cnn", (1, 8, 8)), ("tanh_cnn", (1, 28, 28))):
        config = TrialConfig(model=model, clipping="auto", groups=4)
        t0 = time.perf_counter()
        mode, note = guarded_clipping(config, 10, shape)
        assert note is None and mode in ("bookkeeping", "hooks", "functorch")
        assert time.perf_counter() - t0 < 60


@pytest.mark.ray
def test_search_cli_refuses_an_under_clipping_model_with_exit_2_and_charges_nothing(user_models: Path,
                                                                                     tmp_path: Path) -> None:
    res, charges = factory_search(tmp_path, user_models, f"{MODULE}:make", {"kind": "patches"}, "hooks")
    assert res.returncode == 2, res.stderr[-2000:]
    assert "clipping" in res.stderr and "functorch" in res.stderr
    assert charges == []
