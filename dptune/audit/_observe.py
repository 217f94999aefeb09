"""One audited run: a real dptune trial (or search) with canaries, what each threat model observes, and the
membership score of every canary.

* white-box: every intermediate model of the released trial. From consecutive models and the released config
  (SGD: learning rate, momentum, weight decay, B) the auditor recovers each step's noised sum of clipped
  gradients at a canary's coordinate, x_t in units of C. Canary score: the log-likelihood ratio of "included"
  against "excluded" under the *certified* mechanism, Σ_t log(1 − q + q·exp((x_t − 1/2)/σ²)) (x_t ~ N(b_t, σ²),
  b_t ~ Bernoulli(q) when included, b_t = 0 when not): the most powerful test for one Dirac canary
  (Neyman–Pearson), and still valid as a score whatever the trainer really did;
* white-box with feature canaries (``_features``: ordinary training examples, any clipping engine): the same
  statistic on each canary's column, projected on the canary's direction at θ_t, with the exact size a_t of its
  clipped contribution there: Σ_t log(1 − q + q·exp((a_t x_t − a_t²/2)/σ²));
* black-box: the released model only. Canary score: minus its cross-entropy loss on the input canary.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F

from dptune.accounting import Plan
from dptune.audit._canaries import Canaries, audit_basis, audit_splits
from dptune.audit._features import (
    FeatureCanaries,
    FeatureCanaryModel,
    column_directions,
    feature_audit_basis,
    feature_audit_config,
    feature_audit_splits,
)
from dptune.config import SearchSpace, TrialConfig
from dptune.data import Splits
from dptune.dpsgd import AuditHooks, TrialResult, init_model, run_trial
from dptune.release import select_best
from dptune.trials import TrialRow
from dptune.tuning.draw import make_draw

__all__ = ["CANARY_GRADIENT", "FeatureObservation", "Observation", "SearchObservation", "black_box_scores",
           "column_sums", "feature_signals", "feature_white_box_scores", "ideal_white_box_scores", "noised_sums",
           "observed_feature_trial", "observed_search", "observed_trial", "white_box_scores"]

CANARY_GRADIENT = 10.0  # G / C: a Dirac canary's gradient is 10 clipping bounds long, so clipping must act


@dataclass(frozen=True, eq=False)
class Observation:
    """What an auditor of one trial sees: the parameters at the gradient canaries' coordinates before and
    after every noised step (white-box), the released model (black-box), and the trial's measured result."""

    config: TrialConfig
    trajectory: np.ndarray  # float64 [T + 1, m_gradient]
    model_state: dict[str, torch.Tensor]
    result: TrialResult


def observed_trial(config: TrialConfig, data: Splits, canaries: Canaries, *, bug: str | None = None,
                   charged_points: Sequence[Any] | None = None) -> Observation:
    """Run ``config`` with dptune's trainer on ``data`` plus the included canaries (q on the
    data-independent basis of ``audit_basis``), observing every intermediate model. ``bug``: run a
    deliberately broken trainer (``dptune.dpsgd.BUGS``). ``charged_points``: the trial refuses to start
    unless the accountant charged it (``dptune.dpsgd.run_trial``)."""
    splits, coordinate = audit_splits(data, canaries)
    coords = torch.from_numpy(canaries.coordinates)
    model = init_model(config, splits)  # the trial's own seeded initialisation: the first observed model
    steps = [_at(model, coords)]
    hooks = AuditHooks(canary_coordinate=coordinate, canary_gradient_norm=CANARY_GRADIENT * config.max_grad_norm,
                       on_step=lambda m: steps.append(_at(m, coords)), bug=bug)
    result = run_trial(config, splits, return_model=True, sampling_basis=audit_basis(len(data.train[1]), canaries),
                       charged_points=charged_points, _audit=hooks)
    assert result.model_state is not None
    return Observation(config, np.stack(steps), result.model_state, result)


def _at(model: torch.nn.Module, coords: torch.Tensor) -> np.ndarray:
    with torch.no_grad():
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters() if p.requires_grad])
        return flat[coords].double().cpu().numpy()


def noised_sums(obs: Observation) -> np.ndarray:
    """Per step, the noised sum of clipped gradients at each canary coordinate, in units of C, recovered
    from consecutive models: torch SGD keeps buf_t = μ·buf_{t−1} + g_t (g_t = noised mean gradient + λ·θ_t)
    and steps θ_{t+1} = θ_t − lr·buf_t; Opacus' mean gradient is the noised sum / B."""
    return _sgd_noised_sums(obs.config, obs.trajectory)


def _sgd_noised_sums(c: TrialConfig, theta: np.ndarray) -> np.ndarray:
    """``noised_sums`` of a trajectory [T + 1, coordinates] of a trial run with config ``c``."""
    if c.optimizer != "sgd":
        raise ValueError(f"the white-box audit inverts SGD updates; the trial uses {c.optimizer!r}")
    buf = (theta[:-1] - theta[1:]) / c.learning_rate
    prev = np.vstack([np.zeros_like(buf[:1]), buf[:-1]])
    grad = buf - c.momentum * prev - c.weight_decay * theta[:-1]
    return grad * c.batch_size / c.max_grad_norm


def white_box_scores(obs: Observation, *, noise_multiplier: float, sampling_rate: float) -> np.ndarray:
    """Each gradient canary's log-likelihood ratio under the certified mechanism (module docstring)."""
    return _log_likelihood_ratio(noised_sums(obs), noise_multiplier, sampling_rate)


def _log_likelihood_ratio(x: np.ndarray, sigma: float, q: float, size: np.ndarray | float = 1.0) -> np.ndarray:
    """Σ_t log(1 − q + q exp((a x_t − a²/2)/σ²)): N(b_t a, σ²) with b_t ~ Bernoulli(q) against N(0, σ²), a = size."""
    z = (size * x - 0.5 * size**2) / sigma**2
    log_1q = math.log1p(-q) if q < 1 else -math.inf
    return np.logaddexp(log_1q, math.log(q) + z).sum(axis=0)


def ideal_white_box_scores(included: np.ndarray, *, noise_multiplier: float, sampling_rate: float, steps: int,
                           rng: np.random.Generator) -> np.ndarray:
    """The white-box scores the *certified* mechanism itself would give (a simulation: each canary alone on
    its coordinate, sampled at rate q in each of T steps, Gaussian noise σ, no other data): what this audit
    can reach when the trainer is exactly as private as certified."""
    inc = np.asarray(included, dtype=bool)
    hits = (rng.random((steps, len(inc))) < sampling_rate) & inc
    x = hits + rng.normal(0.0, noise_multiplier, size=(steps, len(inc)))
    return _log_likelihood_ratio(x, noise_multiplier, sampling_rate)


@dataclass(frozen=True, eq=False)
class FeatureObservation:
    """What a white-box auditor of one trial with feature canaries (``_features``) sees: every intermediate model
    θ_0 … θ_T of the audited model (``config``: the trial's config with the canary head), and the trial's result."""

    config: TrialConfig
    canaries: FeatureCanaries
    splits: Splits  # the audited data (the model's input format)
    states: list[dict[str, torch.Tensor]]
    result: TrialResult


def observed_feature_trial(config: TrialConfig, data: Splits, canaries: FeatureCanaries, *, bug: str | None = None,
                           charged_points: Sequence[Any] | None = None) -> FeatureObservation:
    """Run ``config`` (its clipping mode, any) with dptune's trainer on ``data`` plus the included feature canaries,
    its model wrapped in the canary head, q on the data-independent ``feature_audit_basis``; every intermediate
    model observed. ``bug``, ``charged_points``: as for ``observed_trial``. The canaries are training rows like any
    other: the only audit hook is the observation (and the bug, when asked for)."""
    audited = feature_audit_config(config, data, canaries)
    splits = feature_audit_splits(data, canaries)
    states = [_state(init_model(audited, splits))]  # the trial's own seeded initialisation: θ_0
    hooks = AuditHooks(on_step=lambda m: states.append(_state(m)), bug=bug)
    result = run_trial(audited, splits, return_model=True, charged_points=charged_points, _audit=hooks,
                       sampling_basis=feature_audit_basis(len(data.train[1]), canaries))
    return FeatureObservation(audited, canaries, splits, states, result)


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.detach().cpu().clone() for k, p in model.named_parameters()}


def column_sums(obs: FeatureObservation) -> np.ndarray:
    """Per step, the noised sum of clipped gradients on every canary column, in units of C ([T, K, m]; column j
    holds canary j's clipped gradient when it was sampled, and the noise), recovered from consecutive models."""
    weights = np.stack([s["canary.weight"].double().numpy() for s in obs.states])  # [T + 1, K, m]
    steps = len(weights) - 1
    return _sgd_noised_sums(obs.config, weights.reshape(steps + 1, -1)).reshape(weights[1:].shape)


def feature_signals(obs: FeatureObservation) -> tuple[np.ndarray, np.ndarray]:
    """Per step and canary ([T, m] each): x_t, ``column_sums`` projected on the canary's direction u_t; a_t, the
    exact size of its clipped contribution there, in units of C (both from the observed θ_t and the canary's
    input and label; ``_features``). A sampled included canary gives x_t = a_t + N(0, σ²), any other N(0, σ²)."""
    sums = column_sums(obs)
    model = init_model(obs.config, obs.splits)
    assert getattr(model, "captured_from", None) == FeatureCanaryModel.__name__  # the canary model, captured
    x, a = np.zeros(sums.shape[::2]), np.zeros(sums.shape[::2])
    for t in range(len(sums)):
        model.load_state_dict(obs.states[t], strict=False)
        # the captured canary model: FeatureCanaryModel's layers and attributes (base, canary, value, image_shape)
        u, a[t] = column_directions(cast(FeatureCanaryModel, model), obs.canaries.labels, obs.config.max_grad_norm)
        x[t] = np.einsum("km,mk->m", sums[t], u)
    return x, a


def feature_white_box_scores(obs: FeatureObservation, *, noise_multiplier: float, sampling_rate: float) -> np.ndarray:
    """Each feature canary's log-likelihood ratio under the certified mechanism, with its exact clipped size a_t:
    Σ_t log(1 − q + q exp((a_t x_t − a_t²/2)/σ²)) (the Dirac canaries' score when a_t = 1)."""
    x, a = feature_signals(obs)
    return _log_likelihood_ratio(x, noise_multiplier, sampling_rate, a)


@torch.no_grad()
def black_box_scores(obs: Observation, data: Splits, canaries: Canaries) -> np.ndarray:
    """Minus each input canary's loss under the released model."""
    model = init_model(obs.config, data)
    model.load_state_dict(obs.model_state)
    model.eval()
    out = model(canaries.x)
    return (-F.cross_entropy(out, canaries.y, reduction="none")).double().numpy()


@dataclass(frozen=True, eq=False)
class SearchObservation:
    """A search's draw (K trials) and its release: the best trial's observation, None when K = 0."""

    k: int
    released: Observation | None
    released_index: int | None
    scores: list[float]  # every trial's released (noised) score: sealed in a real search


def observed_search(space: SearchSpace, plan: Plan, data: Splits, canaries: Canaries, *,
                    draw_seed: int) -> SearchObservation:
    """A random search as ``dptune.search`` runs it, in process: K and the configs from ``make_draw`` (the
    secret draw seed replaced by ``draw_seed``: NOT PRIVATE, a bench), every trial on ``data`` plus the
    canaries and refused unless ``plan`` charged it, the release chosen by ``dptune.release.select_best``."""
    if plan.n_train != audit_basis(len(data.train[1]), canaries):
        raise ValueError("plan the search on audit_basis(n, canaries): q must not depend on the coin flips")
    draw = make_draw(space, plan.stopping, seed=draw_seed)
    rows: list[TrialRow] = []
    observations: list[Observation] = []
    for t in draw.trials:
        obs = observed_trial(space.trial_config(t["params"], seed=int(t["seed"])), data, canaries,
                             charged_points=plan.points)
        rows.append(TrialRow(index=len(rows), params=t["params"], seed=str(t["seed"]), score=obs.result.score))
        observations.append(obs)
    best = select_best(rows)
    return SearchObservation(k=draw.k, released=None if best is None else observations[best.index],
                             released_index=None if best is None else best.index,
                             scores=[r.score for r in rows])
