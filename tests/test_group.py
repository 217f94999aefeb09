"""Several trials in one computation (dptune.dpsgd._group): each trial of a group is the trial alone.

Real trials on the embedded digits data, real Opacus optimizers; the reference is ``run_trial`` itself."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from dptune.config import TrialConfig
from dptune.config.params import sampling_rate, trial_steps
from dptune.data import Splits
from dptune.dpsgd import run_trial
from dptune.dpsgd._group import TrialCrash, group_guard, run_group
from dptune.dpsgd._trial import TrialResult, prepare
from tests.conftest import importable_module

BASE = TrialConfig(model="mlp", groups=4, clipping="functorch", momentum=0.0, physical_batch_size=48,
                   score_noise=4.0, epochs=1.0)
# three trials of one architecture: batch size, learning rate, epochs, σ and C all differ (B 128 > 48: chunks)
TRIALS = [BASE.replace(batch_size=64, learning_rate=0.5, noise_multiplier=1.0, seed=2**100 + 1),
          BASE.replace(batch_size=128, learning_rate=1.5, noise_multiplier=2.0, max_grad_norm=0.6, epochs=2.0,
                       seed=2**100 + 2),
          BASE.replace(batch_size=32, learning_rate=0.2, noise_multiplier=0.7, seed=2**100 + 3)]


def _same(a: TrialResult | TrialCrash, b: TrialResult | TrialCrash) -> None:
    assert isinstance(a, TrialResult) and isinstance(b, TrialResult)
    assert a.model_state is not None and b.model_state is not None
    assert a.model_state.keys() == b.model_state.keys()
    for k in a.model_state:
        assert torch.equal(a.model_state[k], b.model_state[k]), k
    assert (a.score, a.val_accuracy_raw, a.steps, a.noise_additions, a.noised_coordinates, a.noise_std,
            a.mean_batch_size, a.applied_score_noise, a.diverged) == \
           (b.score, b.val_accuracy_raw, b.steps, b.noise_additions, b.noised_coordinates, b.noise_std,
            b.mean_batch_size, b.applied_score_noise, b.diverged)


def test_group_trials_equal_one_at_a_time_bitwise(digits: Splits) -> None:
    """Parameters after their T steps, score, noise and batch measurements: bitwise those of each trial alone."""
    for per_call in (3, 1):  # one vmapped call over the trials' chunks, or each trial's own engine (the CPU default)
        group = run_group(TRIALS, digits, return_model=True, lanes_per_call=per_call)
        for config, got in zip(TRIALS, group, strict=True):
            _same(got, run_trial(config, digits, return_model=True))


def test_a_grouped_trial_on_a_cpu_runs_the_engine_it_runs_alone(digits: Splits) -> None:
    """``clipping: auto`` in a group: on a CPU each member keeps the mode its trial alone runs (book-keeping for the
    shipped CNNs) and equals that trial bit for bit; on an accelerator the group's engine is whole-model vmap."""
    from dptune.dpsgd import guarded_clipping
    from dptune.tuning.grouping import group_clipping

    auto = [c.replace(model="gn_cnn", clipping="auto", physical_batch_size=64, epochs=0.25) for c in TRIALS[:2]]

    def guard(c: TrialConfig) -> Any:
        return guarded_clipping(c, digits.num_classes, digits.input_shape)

    assert [group_clipping(c, guard, "cpu") for c in auto] == auto
    assert {group_clipping(c, guard, "cuda").clipping for c in auto} == {"functorch"}
    group = run_group([group_clipping(c, guard, "cpu") for c in auto], digits, return_model=True)
    for config, got in zip(auto, group, strict=True):
        alone = run_trial(config, digits, return_model=True)
        assert alone.clipping_mode == "bookkeeping"
        _same(got, alone)


def _count_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Records (lanes, distinct trials) of each vmapped call of the group's function."""
    from dptune.dpsgd import _group

    calls: list[tuple[int, int]] = []
    original = _group._Lanes.gradients
    monkeypatch.setattr(_group._Lanes, "gradients", lambda self, models, chunks: calls.append(
        (len(models), len({id(m) for m in models}))) or original(self, models, chunks))
    return calls


def test_trial_result_does_not_depend_on_its_group(digits: Splits, monkeypatch: pytest.MonkeyPatch) -> None:
    """GN-CNN, where the group's batched-parameter convolution may sum in another order than the engine alone: a
    trial's numbers are still the same in a group of one and a group of three (its company, and so K, cannot show),
    and within float32 rounding of ``run_trial``'s. The group's vmapped calls are counted: they really ran, three
    lanes wide, with all three trials in them."""
    calls = _count_calls(monkeypatch)
    cnn = [c.replace(model="gn_cnn", physical_batch_size=64, epochs=0.25) for c in TRIALS[:2]]
    alone = run_group(cnn[1:], digits, return_model=True, lanes_per_call=3)[0]  # the group's function, alone
    assert calls and set(calls) == {(3, 1)}
    calls.clear()
    together = run_group([cnn[0], cnn[1], cnn[0].replace(seed=7)], digits, return_model=True, lanes_per_call=3)[1]
    assert (3, 3) in calls and {lanes for lanes, _ in calls} == {3}
    _same(alone, together)
    ref = run_trial(cnn[1], digits, return_model=True)
    assert isinstance(alone, TrialResult) and alone.model_state is not None and ref.model_state is not None
    assert alone.model_state.keys() == ref.model_state.keys()
    worst = max(float((alone.model_state[k] - ref.model_state[k]).abs().max()) for k in ref.model_state)
    assert worst < 1e-4  # not bitwise on every CPU (0 < worst on the earlier sessions' and this one's), not far


def _rgb16(digits: Splits, n: int) -> Splits:
    """The first ``n`` examples of each digits split as 3 x 16 x 16 images (ResNet-9's input: 3 channels)."""
    import torch.nn.functional as F

    def pair(p: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x = F.interpolate(p[0][:n], size=(16, 16), mode="bilinear", align_corners=False).repeat(1, 3, 1, 1)
        return x.contiguous(), p[1][:n]

    return Splits(train=pair(digits.train), val=pair(digits.val), test=pair(digits.test),
                  num_classes=digits.num_classes, input_shape=(3, 16, 16))


@pytest.mark.slow  # ResNet-9 groups probed at every chunk size: ~60-120 s on 2 cores (make test-slow; CI runs it)
def test_a_trial_does_not_show_how_many_share_its_calls(digits: Splits, monkeypatch: pytest.MonkeyPatch) -> None:
    """ResNet-9, whose batched kernels sum in another order when a call's lane count changes (on a CPU at 32 rows,
    not at the 4 rows the guard used to probe): a trial in a group of one and in a group of two is the same bit for
    bit, since every call is ``lanes_per_call`` wide whatever the group. Before, a call was as wide as its group:
    the trial's parameters moved with the number of trials beside it, and so with K. The calls are counted: a
    comparison with ``run_trial``'s rounding, the control before, could not tell them apart on every CPU (an AMD EPYC
    at 2 threads rounds both the same)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # oneDNN's kernels depend on it: at 1 thread a 2-lane call equals the engine here
    try:
        _no_company(digits, monkeypatch)
    finally:
        torch.set_num_threads(threads)


def _no_company(digits: Splits, monkeypatch: pytest.MonkeyPatch) -> None:
    from dptune.dpsgd._group import call_sizes

    data = _rgb16(digits, 128)
    res = [BASE.replace(model="resnet9", groups=8, batch_size=32, physical_batch_size=32, epochs=1.0,
                        learning_rate=0.1, noise_multiplier=1.0, max_grad_norm=1.0, seed=2**100 + 40 + i)
           for i in range(2)]
    assert call_sizes([prepare(c, data, torch.device("cpu")) for c in res]) == [1, 2, 4, 8, 12, 16, 20, 24, 28, 32]  # the guard's
    calls = _count_calls(monkeypatch)  # the group's calls really ran
    alone = run_group(res[:1], data, return_model=True, lanes_per_call=2)[0]
    assert calls and set(calls) == {(2, 1)}  # alone: its own lane and a copy of it
    calls.clear()
    together = run_group(res, data, return_model=True, lanes_per_call=2)
    assert (2, 2) in calls and {lanes for lanes, _ in calls} == {2}  # together: both trials in one call
    _same(alone, together[0])
    assert all(isinstance(r, TrialResult) and r.steps > 0 for r in together)


def test_each_trial_runs_its_own_charge(digits: Splits) -> None:
    """Measured per trial inside one group: noise additions == steps == T, noise std σ·C (each its own σ and C),
    the realised mean Poisson batch q·n at its own q (binomial 99.9 % interval)."""
    n = len(digits.train[1])
    group = run_group(TRIALS, digits, lanes_per_call=3)
    for config, got in zip(TRIALS, group, strict=True):
        assert isinstance(got, TrialResult)
        q = sampling_rate(batch_size=config.batch_size, basis=n)
        steps = trial_steps(epochs=config.epochs, batch_size=config.batch_size, basis=n)
        assert got.noise_additions == got.steps == steps
        assert got.sampling_rate == q
        assert got.noise_std == pytest.approx(config.noise_multiplier * config.max_grad_norm, rel=0.02)
        assert abs(got.mean_batch_size - q * n) <= 3.29 * math.sqrt(n * q * (1 - q) / steps)
    stds = sorted(g.noise_std or 0.0 for g in group if isinstance(g, TrialResult))
    assert stds[0] * 1.15 < stds[1] and stds[1] * 1.15 < stds[2]  # control: the trials' noise really differs


CRASHING = '''
import torch
from torch import nn


class Net(nn.Module):
    """An MLP whose evaluation raises once its first layer's weights are large: a user model's own exception
    (torch._assert: a check the captured program keeps, on the parameters, not the data)."""

    def __init__(self, num_classes, shape):
        super().__init__()
        self.first = nn.Linear(shape[0] * shape[1] * shape[2], 32)
        self.head = nn.Linear(32, num_classes)

    def forward(self, x):
        if not self.training:
            torch._assert(self.first.weight.abs().max() <= 5.0, "weights ran away")
        return self.head(torch.tanh(self.first(x.flatten(1))))


def make(num_classes, input_shape, groups):
    return Net(num_classes, input_shape)
'''


@pytest.fixture()
def crashing(tmp_path: Path) -> Iterator[Path]:
    with importable_module(tmp_path, "group_crash_models", CRASHING) as folder:
        yield folder


def test_a_crash_scores_that_trial_minus_inf_and_leaves_the_others(digits: Splits, crashing: Path) -> None:
    model = "factory:group_crash_models:make"
    healthy = [c.replace(model=model) for c in TRIALS[:2]]
    runaway = TRIALS[2].replace(model=model, learning_rate=500.0, noise_multiplier=5.0)
    group = run_group([healthy[0], runaway, healthy[1]], digits, return_model=True, lanes_per_call=3)
    assert isinstance(group[1], TrialCrash) and group[1].score == -math.inf
    assert "weights ran away" in group[1].error
    without = run_group(healthy, digits, return_model=True, lanes_per_call=3)
    _same(group[0], without[0])
    _same(group[2], without[1])
    with pytest.raises(AssertionError, match="weights ran away"):  # control: alone, the same trial raises
        run_trial(runaway, digits)


DROPOUT = '''
from torch import nn


def make(num_classes, input_shape, groups):
    d = input_shape[0] * input_shape[1] * input_shape[2]
    return nn.Sequential(nn.Flatten(), nn.Linear(d, 16), nn.Dropout(0.5), nn.Tanh(), nn.Linear(16, num_classes))
'''


@pytest.fixture()
def dropout(tmp_path: Path) -> Iterator[Path]:
    with importable_module(tmp_path, "group_dropout_models", DROPOUT) as folder:
        yield folder


def _probe(configs: list[TrialConfig], data: Splits) -> str | None:
    trials = [prepare(c, data, torch.device("cpu")) for c in configs]
    return group_guard(trials, data, len(trials))[1]


def test_isolation_probe(digits: Splits, dropout: Path) -> None:
    """The group's guard passes for real trials (one example of one trial moves no other trial's gradients, each
    lane equals its trial alone) and fails for a model that draws random numbers (dropout: lanes would share
    the global stream); such a group trains its trials one at a time, each with its own engine."""
    assert _probe(TRIALS, digits) is None
    assert _probe([c.replace(model="gn_cnn") for c in TRIALS], digits) is None
    drop = [c.replace(model="factory:group_dropout_models:make", epochs=0.2) for c in TRIALS[:2]]
    failure = _probe(drop, digits)
    assert failure is not None and "fails" in failure
    assert all(isinstance(r, TrialResult) and r.steps > 0 for r in run_group(drop, digits))


def test_group_probe_reports_what_the_group_runs(digits: Splits, dropout: Path) -> None:
    """``group_probe`` (the diagnostic bench/gpu_group.py prints): at every padded chunk size the MLP trials train
    with, a lane's gradients are bitwise independent of the call's width, its lane and the other lanes; the
    group shares its calls where the guard passes, and says why not where it does not."""
    from dptune.dpsgd import group_probe

    probe = group_probe(TRIALS, digits, lanes_per_call=3)
    assert probe["shared"] and probe["refused"] is None and probe["lanes_per_call"] == 3
    assert [r["rows"] for r in probe["sizes"]] == [1, 2, 4, 8, 12, 16, 20, 24, 28, 32, 40, 48]  # up to the 48-row physical chunk
    assert all(r["count"] == r["position"] == r["company"] == 0.0 for r in probe["sizes"])
    assert group_probe(TRIALS, digits, sizes=[4])["refused"] == "one trial per call: each trial's own engine"
    drop = [c.replace(model="factory:group_dropout_models:make", epochs=0.2) for c in TRIALS[:2]]
    assert "fails" in group_probe(drop, digits, lanes_per_call=2, sizes=[4])["refused"]


def test_a_group_is_one_architecture(digits: Splits) -> None:
    with pytest.raises(ValueError, match="architecture"):
        run_group([TRIALS[0], TRIALS[1].replace(groups=2)], digits)
    with pytest.raises(ValueError, match="architecture"):  # the calls' shapes, which the group's guard probes
        run_group([TRIALS[0], TRIALS[1].replace(physical_batch_size=32)], digits)
