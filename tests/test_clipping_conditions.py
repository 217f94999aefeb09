"""Each example moves the clipped sum by at most C *in the conditions training really runs* (issue 40, round 4).

The round-3 guard probed a fresh model on 4 rows with every example clipped. These user models pass such a probe
and still exceed C in training: batch statistics used only from 8 rows on, a gradient rescaled by the number of
rows (one extra example doubles the padded batch), state kept between forward passes (a previous batch's mean in a
plain attribute, an online input normaliser's buffer), a model that crashes on its second call. Each is refused
before anything is charged, or the engine the trial runs keeps every measured contribution <= C·(1 + 1e-6).

The measurement is the test's own: one engine instance across steps (as a trial runs), each step one real
noise-free optimizer step (SGD, lr 1, no momentum: the parameters move by -S/B; restored afterwards, so only
what the model itself keeps carries over), batches padded as the loop pads them at two padded sizes, and a C
between the examples' own norms (some clipped, some not); references are each example alone in float64.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dptune.config import ConfigError, TrialConfig
from dptune.dpsgd import engine_mode, make_engine, padded_rows, validate_model
from dptune.dpsgd._checked import checked_model
from dptune.models import build_model
from tests.conftest import importable_module

MODULE = "dptune_test_condition_models"
SHAPE, CLASSES = (1, 8, 8), 10
MODES = ["auto", "hooks", "functorch", "ghost", "bookkeeping"]
USER_MODELS = '''
import torch
import torch.nn.functional as F
from torch import nn


class BatchStat8(nn.Module):  # centres with the batch mean, but only for batches of >= 8 rows
    def __init__(self, k):
        super().__init__()
        self.fc, self.head = nn.Linear(64, 32), nn.Linear(32, k)

    def forward(self, x):
        h = self.fc(x.flatten(1))
        if h.shape[0] >= 8:
            h = h - h.mean(0)
        return self.head(torch.tanh(h))


class _Rescale(torch.autograd.Function):  # identity forward; backward scaled by 4 / rows from 8 rows on
    generate_vmap_rule = True
    @staticmethod
    def forward(h):
        return h.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.rows = inputs[0].shape[0]

    @staticmethod
    def backward(ctx, g):
        return g * min(1.0, 4.0 / ctx.rows)


class RowsRescale(nn.Module):  # a gradient rescaled by the number of rows inside the model
    def __init__(self, k):
        super().__init__()
        self.fc, self.head = nn.Linear(64, 32), nn.Linear(32, k)

    def forward(self, x):
        return self.head(torch.tanh(_Rescale.apply(self.fc(x.flatten(1)))))


class PrevMean(nn.Module):  # adds the previous batch's mean, kept in a plain attribute
    def __init__(self, k):
        super().__init__()
        self.fc, self.head = nn.Linear(64, 32), nn.Linear(32, k)
        self.prev = None

    def forward(self, x):
        h = self.fc(x.flatten(1))
        out = h if self.prev is None else h + self.prev
        self.prev = h.detach().mean(0)
        return self.head(torch.tanh(out))


class OnlineNorm(nn.Module):  # an online input normaliser: a buffer updated in forward
    def __init__(self, k):
        super().__init__()
        self.register_buffer("mean", torch.zeros(64))
        self.fc, self.head = nn.Linear(64, 32), nn.Linear(32, k)

    def forward(self, x):
        x = x.flatten(1)
        if self.training:
            self.mean.mul_(0.9).add_(0.1 * x.detach().mean(0))
        return self.head(torch.tanh(self.fc(x - self.mean)))


class SecondCall(nn.Module):  # keeps the last batch's activations and crashes when the next batch's size differs
    def __init__(self, k):
        super().__init__()
        self.fc, self.head = nn.Linear(64, 32), nn.Linear(32, k)
        self.last = None

    def forward(self, x):
        h = self.fc(x.flatten(1))
        if self.last is not None:
            h = h + 0.0 * self.last
        self.last = h.detach()
        return self.head(torch.tanh(h))


class Dropped(nn.Module):  # dropout: a data-independent mask per element, nothing mixes examples
    def __init__(self, k, functional):
        super().__init__()
        self.fc, self.head, self.functional = nn.Linear(64, 32), nn.Linear(32, k), functional
        self.drop = nn.Dropout(0.25)

    def forward(self, x):
        h = torch.tanh(self.fc(x.flatten(1)))
        h = F.dropout(h, 0.25, self.training) if self.functional else self.drop(h)
        return self.head(h)


class Shuffled(nn.Module):  # random mixing of examples (mixup in forward): must stay refused
    def __init__(self, k):
        super().__init__()
        self.fc, self.head = nn.Linear(64, 32), nn.Linear(32, k)

    def forward(self, x):
        h = self.fc(x.flatten(1))
        h = 0.5 * h + 0.5 * h[torch.randperm(h.shape[0])]
        return self.head(torch.tanh(h))


class FreqEmbedding(nn.Module):  # Embedding(scale_grad_by_freq=True): the batch's word counts scale gradients
    def __init__(self, k):
        super().__init__()
        self.emb, self.head = nn.Embedding(16, 8, scale_grad_by_freq=True), nn.Linear(8 * 64, k)

    def forward(self, x):
        return self.head(self.emb((x.flatten(1).abs() * 4).long().clamp(max=15)).flatten(1))


class BatchNormMLP(nn.Module):  # batch clipping may train it, but it cannot score one example at a time
    def __init__(self, k):
        super().__init__()
        self.fc, self.bn, self.head = nn.Linear(64, 32), nn.BatchNorm1d(32), nn.Linear(32, k)

    def forward(self, x):
        return self.head(torch.tanh(self.bn(self.fc(x.flatten(1)))))


KINDS = {"batch_stat_8": BatchStat8, "rows_rescale": RowsRescale, "prev_mean": PrevMean, "online_norm": OnlineNorm,
         "second_call": SecondCall, "dropout": lambda k: Dropped(k, False), "f_dropout": lambda k: Dropped(k, True),
         "shuffled": Shuffled, "freq_embedding": FreqEmbedding, "bn_mlp": BatchNormMLP,
         "plain": lambda k: nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, k))}


def make(num_classes, input_shape, groups, kind):
    return KINDS[kind](num_classes)
'''
UNSAFE = ["batch_stat_8", "rows_rescale", "prev_mean", "online_norm", "second_call"]


@pytest.fixture(scope="module")
def user_models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with importable_module(tmp_path_factory.mktemp("condition_models"), MODULE, USER_MODELS) as folder:
        yield folder


def _config(kind: str, mode: str, **kw: object) -> TrialConfig:
    base = dict(model=f"factory:{MODULE}:make", model_kwargs={"kind": kind}, clipping=mode, batch_size=32,
                physical_batch_size=64, optimizer="sgd", momentum=0.0, learning_rate=1.0, score_noise=None)
    return TrialConfig(**{**base, **kw})  # type: ignore[arg-type]


def _flat(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in ts]).double()


def _build(config: TrialConfig) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        return checked_model(build_model(config, CLASSES, SHAPE), config).double().train()  # the program that trains


def _alone(config: TrialConfig, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """Each example alone through plain autograd (a fresh model each, the example twice: its mean loss), unclipped."""
    out = []
    for i in range(len(y)):
        m = _build(config)
        params = [p for p in m.parameters() if p.requires_grad]
        xi, yi = x[i:i + 1].repeat(2, 1, 1, 1), y[i:i + 1].repeat(2)
        grads = torch.autograd.grad(F.cross_entropy(m(xi), yi), params, allow_unused=True)
        out.append(_flat([torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)]))
    return out


class Trainer:
    """One model instance and its engine across steps, as a trial runs them; ``step(rows)`` returns the clipped
    sum S measured from one real noise-free SGD step (the parameter move times B), then restores the parameters."""

    def __init__(self, config: TrialConfig, mode: str) -> None:
        self.config = config
        self.model = _build(config)
        self.engine = make_engine(mode, self.model, config, torch.Generator().manual_seed(1), noise_multiplier=0.0)
        assert engine_mode(self.engine) == mode

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        before = [p.detach().clone() for p in self.engine.params]
        n = len(y)
        self.engine.backward(*padded_rows(x, y, list(range(n))), 0, n)  # as the loop pads its physical batches
        self.engine.optimizer.step()
        self.engine.optimizer.zero_grad(set_to_none=True)
        moved = _flat([b - p.detach() for p, b in zip(self.engine.params, before, strict=True)])
        with torch.no_grad():
            for p, b in zip(self.engine.params, before, strict=True):
                p.copy_(b)
        return moved * self.config.batch_size


def _data(n: int, seed: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((n, *SHAPE), generator=gen, dtype=torch.float64), torch.randint(0, CLASSES, (n,), generator=gen)


def _clip_between(config: TrialConfig, x: torch.Tensor, y: torch.Tensor) -> float:
    norms = sorted(float(g.norm()) for g in _alone(config, x, y))
    return norms[len(norms) // 2]  # about half the examples clipped, half not


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", [*UNSAFE, "plain"])
def test_each_example_moves_the_sum_by_at_most_c_across_steps_and_padded_sizes(user_models: Path, kind: str,
                                                                              mode: str) -> None:
    config = _config(kind, mode)
    try:
        ran, _ = validate_model(config, CLASSES, SHAPE)
    except ConfigError as e:  # refused before anything is charged
        assert e.field in ("clipping", "model")
        assert kind != "plain", f"the plain MLP was refused in {mode}: {e}"
        return
    x, y = _data(40)
    median = _clip_between(config, x[:8], y[:8])
    for c in (median, median / 16):  # the second: near the norms a large batch gives a rows-rescaled gradient
        _check_conditions(config.replace(max_grad_norm=c), ran, x, y, f"{kind}/{ran}/C={c:.3g}")


def _check_conditions(cfg: TrialConfig, ran: str, x: torch.Tensor, y: torch.Tensor, what: str) -> None:
    c = cfg.max_grad_norm
    tol = 1e-6 * c
    # 1. two padded sizes: 33 rows pad to 64, 32 rows to 32; the 33rd example must move the sum by <= C
    t = Trainer(cfg, ran)
    big, small = t.step(x[:33], y[:33]), t.step(x[:32], y[:32])
    assert float((big - small).norm()) <= c + tol, f"{what}: one example moved the sum by > C"
    # 2. state across steps: an example only in step 1 must not move step 2's sum at all
    a, b = Trainer(cfg, ran), Trainer(cfg, ran)
    a.step(x[:20], y[:20])
    b.step(x[1:20], y[1:20])
    s_a, s_b = a.step(x[20:40], y[20:40]), b.step(x[20:40], y[20:40])
    assert float((s_a - s_b).norm()) <= tol, f"{what}: an example of step 1 moved step 2's sum"
    # 3. within one padded size, removing one example moves the sum by <= C
    full, rest = t.step(x[:20], y[:20]), t.step(x[1:20], y[1:20])
    assert float((full - rest).norm()) <= c + tol, f"{what}: one example moved the sum by > C"


@pytest.mark.parametrize("kind", ["prev_mean", "online_norm"])
def test_a_model_that_keeps_state_between_forward_passes_is_refused_by_name(user_models: Path, kind: str) -> None:
    with pytest.raises(ConfigError) as e:
        validate_model(_config(kind, "functorch"), CLASSES, SHAPE)
    assert e.value.field == "model"
    assert {"prev_mean": "prev", "online_norm": "mean"}[kind] in e.value.problem
    assert "forward" in e.value.problem


def test_a_crash_on_the_second_call_is_refused_by_the_guard_under_auto(user_models: Path) -> None:
    with pytest.raises(ConfigError) as e:
        validate_model(_config("second_call", "auto"), CLASSES, SHAPE)
    assert e.value.field == "model"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["dropout", "f_dropout"])
def test_dropout_is_accepted_in_every_per_example_mode(user_models: Path, kind: str, mode: str) -> None:
    ran, _ = validate_model(_config(kind, mode), CLASSES, SHAPE)
    assert ran == mode or mode == "auto"


def test_random_mixing_of_examples_stays_refused(user_models: Path) -> None:
    with pytest.raises(ConfigError) as e:
        validate_model(_config("shuffled", "functorch"), CLASSES, SHAPE)
    assert e.value.field in ("model", "clipping")


def test_embedding_scale_grad_by_freq_is_refused_with_its_reason(user_models: Path) -> None:
    with pytest.raises(ConfigError) as e:
        validate_model(_config("freq_embedding", "functorch"), CLASSES, SHAPE)
    assert "scale_grad_by_freq" in e.value.problem and "scale_grad_by_freq=False" in e.value.fix


def test_batch_clipping_refuses_a_model_that_cannot_score_one_example_before_the_charge(user_models: Path) -> None:
    with pytest.raises(ConfigError) as e:
        validate_model(_config("bn_mlp", "batch"), CLASSES, SHAPE)
    assert e.value.field == "model" and "one example" in e.value.problem


def test_alc_clip_norms_follow_each_trials_own_c() -> None:
    """Per-layer C_l computed for C = 1 and kept for a trial at C = 0.1: every example must still move the sum by
    at most 0.1 (it moved it by up to 10·C), and the noise std is σ·C at the trial's C."""
    from dptune.dpsgd import layer_constants

    base = TrialConfig(model="gn_cnn", groups=4, clipping="alc", batch_size=8, physical_batch_size=16,
                       optimizer="sgd", momentum=0.0, learning_rate=1.0, max_grad_norm=1.0, score_noise=None)
    x, y = _data(12, seed=5)
    clip = layer_constants(base, (x[:8].float(), y[:8]), CLASSES, 0.5, 8)
    for c in (0.1, 3.0):
        cfg = base.replace(max_grad_norm=c, layer_clip=clip)
        ran, _ = validate_model(cfg, CLASSES, SHAPE)
        assert ran == "alc"
        t = Trainer(cfg, "alc")
        full = t.step(x[:6], y[:6])
        for j in range(6):
            rest = t.step(torch.cat([x[:j], x[j + 1:6]]), torch.cat([y[:j], y[j + 1:6]]))
            assert float((full - rest).norm()) <= c * (1 + 1e-6), f"C={c}: example {j} moved the sum by > C"
    from dptune.dpsgd._optim import NoiseMeter

    meter = NoiseMeter()
    noisy = make_engine("alc", _build(base).float(), base.replace(max_grad_norm=0.1, layer_clip=clip,
                        noise_multiplier=2.0), torch.Generator().manual_seed(0), meter=meter)
    noisy.backward(x[:4].float(), y[:4], 0, 4)
    noisy.optimizer.step()
    assert meter.additions == 1 and abs(float(meter.std() or 0) - 2.0 * 0.1) < 0.02 * 0.2
