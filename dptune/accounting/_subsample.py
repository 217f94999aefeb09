"""Tuning on a Poisson subsample of the training data, and moving the result to the full data.

Koskela & Kulkarni, "Practical Differentially Private Hyperparameter Tuning with Subsampling" (NeurIPS 2023,
arXiv:2301.11989), Sec. 3: the search runs on a tuning set X₁ drawn from the training data by Poisson
subsampling with rate f (each example kept independently w.p. f, drawn once, kept secret); its RDP follows
from the RDP of the tuning algorithm *on X₁* by the Poisson-subsampling amplification of Zhu & Wang,
"Poisson Subsampled Rényi Differential Privacy" (ICML 2019), Theorem 6 (general upper bound, any mechanism M,
integer α ≥ 2, add/remove neighbours):

    ε'(α) ≤ 1/(α−1) · log[ (1−f)^{α−1}(1 + (α−1)f) + C(α,2) f² (1−f)^{α−2} e^{ε(2)}
                           + 3 Σ_{ℓ=3..α} C(α,ℓ) f^ℓ (1−f)^{α−ℓ} e^{(ℓ−1)ε(ℓ)} ].

It needs nothing of M but its RDP curve, so it applies to the whole random-stopping search (Papernot &
Steinke's transform of the worst-case trial). It is within log(3)/(α−1) of Zhu & Wang's lower bound
(Theorem 5: the same sum with factor 1), which is exact for the Gaussian mechanism, i.e. Mironov, Talwar &
Zhang (2019)'s formula that dp_accounting implements — the tests check both facts.

Two details that make the charge an upper bound of what dptune runs:

* **Which data the search touches.** dptune's trials score on the full (private) validation split, which is
  *not* subsampled. A neighbour differs in one example, either in the training split — then the validation
  split is fixed and the whole search is a mechanism of X₁ (amplified as above) — or in the validation split —
  then every trial's training is identically distributed on both sides and only the score releases differ:
  the random-stopping transform of the score-only trial curve, not amplified. The search is charged at the
  maximum of the two (:func:`subsampled_search_event`).
* **Sampling rate inside X₁.** |X₁| ~ Binomial(n, f) is random and data-dependent; the trainer must sample
  batches with the data-independent rate q = B / (f·n) and run T = ⌈epochs·f·n / B⌉ steps
  (:func:`subsample_sampling_rate`, :func:`subsample_steps`) — not B/|X₁| — so that M's RDP curve holds on
  every X₁ and the amplification theorem applies exactly, with no extra δ.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attr
import numpy as np
from dp_accounting import dp_event as de
from scipy.special import gammaln

from dptune._params import trial_steps
from dptune.accounting import _events
from dptune.accounting._events import WorstCaseDpEvent
from dptune.config import ConfigError

__all__ = [
    "SubsampledMechanismDpEvent",
    "min_subsample_size",
    "amplify_log_moments",
    "poisson_subsampled_rdp",
    "subsample_sampling_rate",
    "subsample_steps",
    "subsampled_epsilon",
    "subsampled_rdp_of",
    "subsampled_search_event",
    "transfer_config",
    "validation_part",
]


@attr.s(frozen=True, slots=True, auto_attribs=True)
class SubsampledMechanismDpEvent(de.DpEvent):
    """``event`` run on a Poisson subsample (rate ``fraction``) of the data, drawn once: Zhu & Wang 2019, Thm. 6."""

    event: de.DpEvent
    fraction: float


_events._CLASSES[SubsampledMechanismDpEvent.__name__] = SubsampledMechanismDpEvent  # JSON allow-list


def _check_fraction(fraction: float, name: str = "search.tune_fraction") -> float:
    if isinstance(fraction, bool) or not isinstance(fraction, int | float) or not (
            math.isfinite(fraction) and 0 < fraction <= 1):
        raise ConfigError(name, f"{fraction!r} is not in (0, 1]", "choose e.g. 0.25, or 1 for no subsampling")
    return float(fraction)


def _log_binom(n: np.ndarray, k: np.ndarray) -> np.ndarray:
    return gammaln(n + 1) - gammaln(k + 1) - gammaln(n - k + 1)


def _integer_log_moments(orders: np.ndarray, rdp: np.ndarray, top: int) -> np.ndarray:
    """(ℓ−1)·ε(ℓ) for ℓ = 0..top, an upper bound from the curve at ``orders``.

    (ℓ−1)·D_ℓ is convex in ℓ (van Erven & Harremoës 2014, Cor. 2), so between two evaluated orders it lies
    below the chord; beyond the largest order no bound is known (inf). Entries ℓ < 2 are unused (0).
    """
    ells = np.arange(top + 1, dtype=np.float64)
    out = np.zeros(rdp.shape[:-1] + (top + 1,))
    cgf = (orders - 1) * rdp  # (λ−1) ε(λ)
    for idx in np.ndindex(rdp.shape[:-1]):
        c = cgf[idx]
        ok = np.isfinite(c)
        if not ok.any():
            out[idx][2:] = np.inf
            continue
        o, v = orders[ok], c[ok]
        row = np.interp(ells, o, v, left=np.nan, right=np.inf)
        # below the smallest finite order o₀ (only if small orders are infinite): ε(ℓ) <= ε(o₀), monotonicity
        row = np.where(np.isnan(row), (ells - 1) * v[0] / (o[0] - 1), row)
        row[:2] = 0.0
        out[idx] = row
    return out


def poisson_subsampled_rdp(orders: np.ndarray, rdp: np.ndarray, fraction: float, factor: float = 3.0,
                           max_order: int | None = None) -> np.ndarray:
    """RDP at ``orders`` of a mechanism with RDP ``rdp`` run on a Poisson subsample of rate ``fraction``.

    Zhu & Wang (2019), Theorem 6 at integer orders α ≥ 2 (``factor=3``; ``factor=1`` is their Theorem 5
    lower bound, exact for the Gaussian mechanism — for tests only). Fractional orders take the value of the
    next integer order (RDP is non-decreasing in the order), orders in (1, 2) that of α = 2. The result is
    also capped by ``rdp`` itself (subsampling never hurts: quasi-convexity of the Rényi divergence), so
    ``fraction = 1`` returns ``rdp`` unchanged; orders above ``max_order`` (a speed knob) keep ``rdp``.
    ``rdp`` may carry leading batch dimensions.
    """
    f = _check_fraction(fraction)
    orders = np.asarray(orders, dtype=np.float64)
    rdp = np.asarray(rdp, dtype=np.float64)
    if f == 1.0:
        return rdp.copy()
    top = _top_order(orders, max_order)
    return amplify_log_moments(_integer_log_moments(orders, rdp, top), orders, rdp, f, factor, max_order)


def _top_order(orders: np.ndarray, max_order: int | None) -> int:
    ints = np.maximum(2, np.ceil(orders)).astype(np.int64)
    if max_order is not None:
        ints = ints[ints <= max_order]
    return int(ints.max()) if len(ints) else 2


def amplify_log_moments(log_moments: np.ndarray, orders: np.ndarray, cap: np.ndarray, fraction: float,
                        factor: float = 3.0, max_order: int | None = None) -> np.ndarray:
    """Zhu & Wang (2019) Thm. 6 (``factor`` 3) / Thm. 5 (``factor`` 1) from ``log_moments[..., ℓ]`` =
    (ℓ−1)·ε(ℓ) at every integer ℓ = 0..top, evaluated at ``orders`` and capped by ``cap`` (see
    :func:`poisson_subsampled_rdp`)."""
    f = float(fraction)
    cap = np.asarray(cap, dtype=np.float64)
    if f == 1.0:
        return cap.copy()
    top = log_moments.shape[-1] - 1
    ceil = np.maximum(2, np.ceil(orders)).astype(np.int64)
    ints = np.unique(ceil[ceil <= top])
    alpha = ints[:, None].astype(np.float64)  # [A, 1]
    ell = np.arange(top + 1, dtype=np.float64)[None, :]  # [1, L]
    valid = (ell >= 2) & (ell <= alpha)
    with np.errstate(divide="ignore", invalid="ignore"):
        base = _log_binom(alpha, ell) + ell * math.log(f) + (alpha - ell) * math.log1p(-f)
        base = np.where(valid, base + np.where(ell >= 3, math.log(factor), 0.0), -np.inf)  # [A, L]
        lm = log_moments.reshape(-1, 1, top + 1)
        terms = np.where(valid[None], base[None] + lm, -np.inf)  # [B, A, L]
        head = (alpha[:, 0] - 1) * math.log1p(-f) + np.log1p((alpha[:, 0] - 1) * f)  # ℓ = 0, 1
        top_term = np.max(terms, axis=-1, keepdims=True)
        top_term = np.where(np.isfinite(top_term), top_term, 0.0)
        lse = np.log(np.sum(np.exp(terms - top_term), axis=-1)) + top_term[..., 0]
        eps_int = np.logaddexp(head[None, :], lse) / (alpha[:, 0] - 1)  # [B, A]
    eps_int = np.concatenate([eps_int, np.full((eps_int.shape[0], 1), np.inf)], axis=1)
    pos = np.where(ceil <= top, np.searchsorted(ints, ceil), len(ints))
    amplified = eps_int[:, pos].reshape(cap.shape[:-1] + (len(orders),))
    return np.minimum(amplified, cap)


# ---------------------------------------------------------------------------------------------------
# events of a subsampled search


def validation_part(event: de.DpEvent) -> de.DpEvent:
    """The part of a dptune search event that reads the validation split: its score releases.

    dptune's convention (``trial_event``): the Poisson-sampled Gaussians are DP-SGD on the training split;
    a bare Gaussian is the validation correct-count. Training parts become no-ops; the structure (worst
    case, composition, random stopping) is kept, so the result is the search's cost for a neighbour that
    differs in the validation split.
    """
    if isinstance(event, de.NoOpDpEvent | de.PoissonSampledDpEvent):
        return de.NoOpDpEvent()
    if isinstance(event, de.GaussianDpEvent):
        return event
    if isinstance(event, de.SelfComposedDpEvent):
        inner = validation_part(event.event)
        return inner if isinstance(inner, de.NoOpDpEvent) else de.SelfComposedDpEvent(inner, event.count)
    if isinstance(event, de.ComposedDpEvent):
        parts = [p for p in (validation_part(e) for e in event.events) if not isinstance(p, de.NoOpDpEvent)]
        return de.NoOpDpEvent() if not parts else parts[0] if len(parts) == 1 else de.ComposedDpEvent(parts)
    if isinstance(event, WorstCaseDpEvent):
        uniq = list(dict.fromkeys(validation_part(e) for e in event.events))
        return uniq[0] if len(uniq) == 1 else WorstCaseDpEvent(tuple(uniq))
    if isinstance(event, de.RepeatAndSelectDpEvent):
        inner = validation_part(event.event)
        if isinstance(inner, de.NoOpDpEvent):
            return inner
        return de.RepeatAndSelectDpEvent(inner, event.mean, event.shape)
    raise TypeError(f"cannot split {type(event).__name__} into training and validation parts")


def subsampled_search_event(search_event: de.DpEvent, fraction: float) -> de.DpEvent:
    """The whole search run on a Poisson subsample of the training split (rate ``fraction``).

    Worst case over where the differing example lies (module docstring): the amplified search for a
    training-split neighbour, the unamplified score releases for a validation-split neighbour.
    ``fraction = 1`` returns ``search_event`` itself.
    """
    f = _check_fraction(fraction)
    if f == 1.0:
        return search_event
    train = SubsampledMechanismDpEvent(search_event, f)
    val = validation_part(search_event)
    return train if isinstance(val, de.NoOpDpEvent) else WorstCaseDpEvent((train, val))


def subsampled_rdp_of(event: de.DpEvent) -> np.ndarray:
    """:func:`rdp_of` that also interprets :class:`SubsampledMechanismDpEvent` anywhere in the tree."""
    from dptune.accounting._rdp import ORDERS, rdp_of
    from dptune.accounting._stopping import random_stopping_rdp

    if isinstance(event, SubsampledMechanismDpEvent):
        return poisson_subsampled_rdp(ORDERS, subsampled_rdp_of(event.event), event.fraction)
    if isinstance(event, de.SelfComposedDpEvent):
        return event.count * subsampled_rdp_of(event.event)
    if isinstance(event, de.ComposedDpEvent):
        return np.sum([subsampled_rdp_of(e) for e in event.events], axis=0) if event.events \
            else np.zeros_like(ORDERS)
    if isinstance(event, WorstCaseDpEvent):
        return np.max([subsampled_rdp_of(e) for e in event.events], axis=0)
    if isinstance(event, de.RepeatAndSelectDpEvent):
        return random_stopping_rdp(ORDERS, subsampled_rdp_of(event.event), mean=event.mean, shape=event.shape)
    return rdp_of(event)


def subsampled_epsilon(event: de.DpEvent, delta: float) -> float:
    from dptune.accounting._rdp import epsilon_from_rdp

    return epsilon_from_rdp(subsampled_rdp_of(event), delta)[0]


# ---------------------------------------------------------------------------------------------------
# what the trainer must use inside the subsample


def subsample_sampling_rate(batch_size: int, n_train: int, fraction: float) -> float:
    """DP-SGD rate inside the subsample: q = B / (f·n), fixed before the draw (not B / |X₁|)."""
    f = _check_fraction(fraction)
    expected = f * n_train
    if not 1 <= batch_size <= expected:
        raise ConfigError("search.tune_fraction", f"batch size {batch_size} exceeds the expected subsample "
                          f"of {expected:.0f} examples (fraction {f:g} of {n_train})",
                          f"choose a fraction >= {batch_size / n_train:.3g} or smaller batches")
    return batch_size / expected


def subsample_steps(epochs: float, batch_size: int, n_train: int, fraction: float) -> int:
    """T = ⌈epochs·f·n / B⌉ steps: epochs over the *expected* subsample, fixed before the draw."""
    subsample_sampling_rate(batch_size, n_train, fraction)
    return trial_steps(epochs=epochs, batch_size=batch_size, basis=_check_fraction(fraction) * n_train)


def min_subsample_size(n: int, fraction: float, failure_prob: float) -> int:
    """A size m with P[Binomial(n, f) < m] ≤ ``failure_prob`` (exact binomial quantile).

    Privacy does not need it (the rate q = B/(f·n) is data-independent). If a caller *refuses to run* when
    |X₁| < m, the refusal is a data-dependent output: the mechanism is within total variation
    ``failure_prob`` =: p of the unconditioned one on every dataset, so an (ε, δ) guarantee becomes
    (ε, δ + (1 + e^ε)·p) — add that to δ (or, better, never refuse: warn the curator in sealed/ and run).
    """
    f = _check_fraction(fraction)
    if not (isinstance(n, int) and n >= 1):
        raise ConfigError("n_train", f"{n!r} is not a positive integer", "give the training-set size")
    if not 0 < failure_prob < 1:
        raise ConfigError("failure_prob", f"{failure_prob!r} is not in (0, 1)", "choose e.g. 1e-6")
    if f == 1.0:
        return n
    from scipy import stats  # ≈ 0.4 s to import: only here, not on every planner start

    # ppf(p) is the smallest k with P[X <= k] >= p, so P[X < k] = P[X <= k-1] < p
    return max(0, int(stats.binom.ppf(failure_prob, n, f)))


def transfer_config(params: Mapping[str, Any], fraction: float, n_train: int | None = None) -> dict[str, Any]:
    """Hyperparameters found on the subsample, moved to final training on the full training split.

    Rule: keep the sampling rate q = B/n (so ``batch_size`` is scaled by 1/f), ``epochs`` (hence the step
    count T = epochs/q and the schedule length), ``learning_rate``, ``noise_multiplier`` and every other
    setting. The final run is then the tuned trial with f⁻¹ times more examples per step: the same expected
    clipped-gradient sum per example, the same RDP per unit of σ as the trial on X₁, and a per-step noise
    std on the averaged gradient σ·C/B smaller by the factor f — the selected trial's conditions, with less
    noise (the direction Koskela & Kulkarni's extrapolation from X₁ to X takes: keep q and the epochs, let
    the batch grow with the data). The final σ is then set by what the budget leaves
    (dptune.train / the advice); σ/f would keep the trial's update noise exactly.
    """
    f = _check_fraction(fraction)
    out = dict(params)
    if "batch_size" in out:
        b = max(1, round(int(out["batch_size"]) / f))
        out["batch_size"] = min(b, n_train) if n_train is not None else b
    return out
