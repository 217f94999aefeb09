"""Trials run what was charged: wide independent random streams, measured noise/batches/steps, charged
points enforced, no data-dependent branches (divergence, small subsamples). Real Opacus runs on digits."""

from __future__ import annotations

import pytest
import torch

from dptune.config import DatasetSpec, TrialConfig
from dptune.data import Splits, load_dataset, poisson_subsample
from dptune.dpsgd import TrialStreams, run_trial

WIDE = 2**127 + 0x5EED  # a 128-bit trial entropy
BASE = TrialConfig(model="gn_cnn", batch_size=64, epochs=1.0, noise_multiplier=1.0, learning_rate=0.5,
                   score_noise=None, physical_batch_size=256)


@pytest.fixture(scope="module")
def digits() -> Splits:
    return load_dataset(DatasetSpec())


@pytest.fixture(scope="module")
def small(digits: Splits) -> Splits:
    return poisson_subsample(digits, 0.2, seed=0)


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
