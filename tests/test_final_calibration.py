"""The public names the benches use instead of private modules: ``accounting.calibrate_final`` (a final run's
calibration after prior events, shared by ``dptune train`` and the benches), ``accounting.sampling_rate`` /
``trial_steps`` (the one definition of q and T) and ``dpsgd.guarded_clipping``."""

from __future__ import annotations

import math

import pytest

from dptune import accounting
from dptune.accounting import (
    calibrate_final,
    calibrate_noise_multiplier,
    epsilon,
    sampling_rate,
    trial_event,
    trial_steps,
)
from dptune.config import ConfigError, TrialConfig

DELTA = 1e-5
CONFIG = TrialConfig(batch_size=64, epochs=2.0, learning_rate=0.1, noise_multiplier=3.0, score_noise=9.0)


def test_q_and_t_are_the_library_definition() -> None:
    import dptune.config.params as params

    assert accounting.sampling_rate is params.sampling_rate and accounting.trial_steps is params.trial_steps
    assert sampling_rate(batch_size=64, basis=1000) == 0.064
    assert trial_steps(epochs=2.0, batch_size=64, basis=1000) == math.ceil(2000 / 64)
    assert {"sampling_rate", "trial_steps", "calibrate_final", "FinalCalibration"} <= set(accounting.__all__)


def test_guarded_clipping_is_public() -> None:
    from dptune import dpsgd
    from dptune.dpsgd._guard import guarded_clipping

    assert dpsgd.guarded_clipping is guarded_clipping and "guarded_clipping" in dpsgd.__all__


def test_calibrated_after_a_prior_event_fits_the_total_and_no_less() -> None:
    """Known answer: the σ of ``calibrate_noise_multiplier`` for the same q, T and prior; the composed ε is at
    most the target and a 1 % smaller σ would exceed it (the calibration is tight)."""
    prior = [trial_event(noise_multiplier=8.0, sampling_rate=0.1, steps=50, score_noise=20.0)]
    cal = calibrate_final(CONFIG, n_train=1000, delta=DELTA, prior_events=prior, target_epsilon=4.0)
    q, steps = 64 / 1000, 32
    assert (cal.sampling_rate, cal.steps, cal.sensitivity) == (q, steps, 1.0)
    expected = calibrate_noise_multiplier(prior, sampling_rate=q, steps=steps, delta=DELTA, target_epsilon=4.0)
    assert cal.config.noise_multiplier == expected
    assert cal.config.score_noise is None and cal.config.learning_rate == 0.1  # no score; lr kept
    assert cal.epsilon_total() <= 4.0 * (1 + 1e-9)
    smaller = trial_event(noise_multiplier=0.99 * expected, sampling_rate=q, steps=steps, score_noise=None)
    assert epsilon([*prior, smaller], DELTA) > 4.0
    assert cal.epsilon_alone() == pytest.approx(epsilon([cal.event], DELTA)) and cal.epsilon_alone() < 4.0
    alone = calibrate_final(CONFIG, n_train=1000, delta=DELTA, target_epsilon=4.0)
    assert alone.config.noise_multiplier < expected  # the prior's charge costs the final run noise


def test_kept_sigma_transfer_rule_and_batch_clipping() -> None:
    kept = calibrate_final(CONFIG, n_train=1000, delta=DELTA)
    assert kept.config.noise_multiplier == 3.0 and kept.prior_events == ()
    assert kept.event == trial_event(noise_multiplier=3.0, sampling_rate=0.064, steps=32, score_noise=None)
    ruled = calibrate_final(CONFIG, n_train=1000, delta=DELTA, target_epsilon=2.0, lr_times_sigma=1.5)
    assert ruled.config.learning_rate == pytest.approx(1.5 / ruled.config.noise_multiplier)
    per_example = calibrate_final(CONFIG, n_train=1000, delta=DELTA, target_epsilon=2.0)
    batch = calibrate_final(CONFIG.replace(clipping="batch"), n_train=1000, delta=DELTA, target_epsilon=2.0)
    assert batch.sensitivity == 2.0  # one example moves the clipped mean's sum by 2C: twice the σ, same charge
    assert batch.config.noise_multiplier == pytest.approx(2 * per_example.config.noise_multiplier)
    assert batch.event == per_example.event


def test_no_room_left_is_a_config_error() -> None:
    prior = [trial_event(noise_multiplier=0.5, sampling_rate=1.0, steps=100, score_noise=None)]
    with pytest.raises(ConfigError) as e:
        calibrate_final(CONFIG, n_train=1000, delta=DELTA, prior_events=prior, target_epsilon=1.0)
    assert e.value.field == "target_epsilon"
