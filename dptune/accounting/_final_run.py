"""A final training run calibrated after the events already charged on its data (a search's certificate).

One routine, reused by every caller: ``dptune train`` (``dptune.final``) and the benches calibrate a final run
with :func:`calibrate_final`, so the σ a bench reports is the σ the command would train at.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dp_accounting import dp_event as de

from dptune.accounting._accountant import epsilon
from dptune.accounting._calibrate import calibrate_noise_multiplier
from dptune.accounting._events import trial_event
from dptune.config import clipping
from dptune.config.params import sampling_rate, trial_steps

if TYPE_CHECKING:
    from dptune.config import TrialConfig

__all__ = ["FinalCalibration", "calibrate_final"]


@dataclass(frozen=True)
class FinalCalibration:
    """A final run's settings and its charge, after the events charged before it.

    Attributes:
        config: The run's config: σ calibrated (or kept), lr by the transfer rule when one was given, no score.
        event: The run's DP event: DP-SGD at σ per unit of sensitivity, rate q, T steps; no score part.
        prior_events: The events charged before it (a search's certificate events), in order.
        delta: The δ every ε here is computed at.
        sampling_rate: q = B/n of the run.
        steps: T = ⌈epochs·n/B⌉ of the run.
        sensitivity: How far one example moves the noised sum, in units of C (``clipping.sensitivity``).
    """

    config: TrialConfig
    event: de.DpEvent
    prior_events: tuple[de.DpEvent, ...]
    delta: float
    sampling_rate: float
    steps: int
    sensitivity: float

    def epsilon_alone(self) -> float:
        """ε of this run alone."""
        return epsilon([self.event], self.delta)

    def epsilon_total(self) -> float:
        """ε of the prior events composed with this run (RDP/PLD composition, never a sum)."""
        return epsilon([*self.prior_events, self.event], self.delta)


def calibrate_final(config: TrialConfig, *, n_train: int, delta: float, prior_events: Sequence[de.DpEvent] = (),
                    target_epsilon: float | None = None, lr_times_sigma: float | None = None) -> FinalCalibration:
    """The final run of ``config`` on ``n_train`` examples, calibrated after ``prior_events``.

    With ``target_epsilon``: σ is the smallest (:func:`calibrate_noise_multiplier`) such that the prior events
    composed with this run cost at most ``target_epsilon`` at ``delta``; it is charged per unit of the clipping
    mode's sensitivity (batch clipping: one example moves the step by 2C, so the config's σ is twice the charged
    one). Without it the config's own σ is kept. ``lr_times_sigma`` (released by a search that planned its final
    run: lr·σ = L·σ_f) sets lr = ``lr_times_sigma``/σ at the σ this run has. Final training releases no score:
    the config's ``score_noise`` is cleared. Guarantee: ``epsilon_total() <= target_epsilon``. ConfigError
    (field ``target_epsilon``) when the prior events alone leave no room.
    """
    config = config.replace(score_noise=None)
    q = sampling_rate(batch_size=config.batch_size, basis=n_train)
    steps = trial_steps(epochs=config.epochs, batch_size=config.batch_size, basis=n_train)
    sensitivity = clipping.sensitivity(config.clipping)
    prior = tuple(prior_events)
    if target_epsilon is not None:
        sigma = calibrate_noise_multiplier(prior, sampling_rate=q, steps=steps, delta=delta,
                                           target_epsilon=target_epsilon)
        config = config.replace(noise_multiplier=sigma * sensitivity)
    if lr_times_sigma is not None:  # the transfer rule lr·σ = L·σ_f, at the σ this run has
        config = config.replace(learning_rate=lr_times_sigma / config.noise_multiplier)
    event = trial_event(noise_multiplier=config.noise_multiplier / sensitivity, sampling_rate=q, steps=steps,
                        score_noise=None)
    return FinalCalibration(config=config, event=event, prior_events=prior, delta=delta, sampling_rate=q,
                            steps=steps, sensitivity=sensitivity)
