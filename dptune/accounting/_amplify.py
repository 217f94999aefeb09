"""Privacy amplification by Poisson subsampling of any mechanism, from its RDP curve alone.

Zhu & Wang, "Poisson Subsampled Rényi Differential Privacy" (ICML 2019), Theorem 6 (general upper bound, any
mechanism M, integer α ≥ 2, add/remove neighbours): run M on a Poisson subsample of rate f, then

    ε'(α) ≤ 1/(α−1) · log[ (1−f)^{α−1}(1 + (α−1)f) + C(α,2) f² (1−f)^{α−2} e^{ε(2)}
                           + 3 Σ_{ℓ=3..α} C(α,ℓ) f^ℓ (1−f)^{α−ℓ} e^{(ℓ−1)ε(ℓ)} ].

It needs nothing of M but its RDP curve, so it applies to a whole random-stopping search. It is within
log(3)/(α−1) of Zhu & Wang's lower bound (Theorem 5: the same sum with factor 1), which is exact for the
Gaussian mechanism, i.e. Mironov, Talwar & Zhang (2019)'s formula that dp_accounting implements — the tests
check both facts. Pure functions of curves: this module interprets no events (``_rdp`` does).
"""

from __future__ import annotations

import math

import numpy as np
from scipy.special import gammaln

from dptune.accounting import _strictmath as strict
from dptune.errors import ConfigError

__all__ = ["amplify_log_moments", "check_fraction", "integer_orders", "poisson_subsampled_rdp", "top_order"]


def check_fraction(fraction: float) -> float:
    """A subsampling rate f in (0, 1] (``search.tune_fraction``)."""
    if isinstance(fraction, bool) or not isinstance(fraction, int | float) or not (
            math.isfinite(fraction) and 0 < fraction <= 1):
        raise ConfigError("search.tune_fraction", f"{fraction!r} is not in (0, 1]",
                          "choose e.g. 0.25, or 1 for no subsampling")
    return float(fraction)


def integer_orders(orders: np.ndarray) -> np.ndarray:
    """The integer order α ≥ 2 whose bound serves each order: ⌈λ⌉ (RDP is non-decreasing in the order)."""
    return np.maximum(2, np.ceil(orders)).astype(np.int64)


def top_order(orders: np.ndarray, max_order: int | None) -> int:
    """The largest integer order needed for ``orders`` (at most ``max_order``)."""
    ints = integer_orders(orders)
    if max_order is not None:
        ints = ints[ints <= max_order]
    return int(ints.max()) if len(ints) else 2


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


def poisson_subsampled_rdp(orders: np.ndarray, rdp: np.ndarray, *, fraction: float, factor: float = 3.0,
                           max_order: int | None = None) -> np.ndarray:
    """RDP at ``orders`` of a mechanism with RDP ``rdp`` run on a Poisson subsample of rate ``fraction``.

    Zhu & Wang (2019), Theorem 6 at integer orders α ≥ 2 (``factor=3``; ``factor=1`` is their Theorem 5
    lower bound, exact for the Gaussian mechanism — for tests only). Fractional orders take the value of the
    next integer order (RDP is non-decreasing in the order), orders in (1, 2) that of α = 2. The result is
    also capped by ``rdp`` itself (subsampling never hurts: quasi-convexity of the Rényi divergence), so
    ``fraction = 1`` returns ``rdp`` unchanged; orders above ``max_order`` (a speed knob) keep ``rdp``.
    ``rdp`` may carry leading batch dimensions.
    """
    f = check_fraction(fraction)
    orders = np.asarray(orders, dtype=np.float64)
    rdp = np.asarray(rdp, dtype=np.float64)
    if f == 1.0:
        return rdp.copy()
    top = top_order(orders, max_order)
    return amplify_log_moments(_integer_log_moments(orders, rdp, top), orders, rdp, fraction=f, factor=factor)


def amplify_log_moments(log_moments: np.ndarray, orders: np.ndarray, cap: np.ndarray, *, fraction: float,
                        factor: float = 3.0) -> np.ndarray:
    """Zhu & Wang (2019) Thm. 6 (``factor`` 3) / Thm. 5 (``factor`` 1) from ``log_moments[..., ℓ]`` =
    (ℓ−1)·ε(ℓ) at every integer ℓ = 0..top, evaluated at ``orders`` and capped by ``cap`` (see
    :func:`poisson_subsampled_rdp`; orders whose integer order exceeds ``top`` keep ``cap``)."""
    f = float(fraction)
    cap = np.asarray(cap, dtype=np.float64)
    if f == 1.0:
        return cap.copy()
    top = log_moments.shape[-1] - 1
    ceil = integer_orders(orders)
    ints = np.unique(ceil[ceil <= top])
    alpha = ints[:, None].astype(np.float64)  # [A, 1]
    ell = np.arange(top + 1, dtype=np.float64)[None, :]  # [1, L]
    valid = (ell >= 2) & (ell <= alpha)
    with np.errstate(divide="ignore", invalid="ignore"):
        base = _log_binom(alpha, ell) + ell * math.log(f) + (alpha - ell) * math.log1p(-f)
        base = np.where(valid, base + np.where(ell >= 3, math.log(factor), 0.0), -np.inf)  # [A, L]
        lm = log_moments.reshape(-1, 1, top + 1)
        terms = np.where(valid[None], base[None] + lm, -np.inf)  # [B, A, L]
        head = (alpha[:, 0] - 1) * math.log1p(-f) + strict.log1p((alpha[:, 0] - 1) * f)  # ℓ = 0, 1
        top_term = np.max(terms, axis=-1, keepdims=True)
        top_term = np.where(np.isfinite(top_term), top_term, 0.0)
        lse = strict.log(np.sum(strict.exp(terms - top_term), axis=-1)) + top_term[..., 0]
        eps_int = strict.logaddexp(head[None, :], lse) / (alpha[:, 0] - 1)  # [B, A]
    eps_int = np.concatenate([eps_int, np.full((eps_int.shape[0], 1), np.inf)], axis=1)
    pos = np.where(ceil <= top, np.searchsorted(ints, ceil), len(ints))
    amplified = eps_int[:, pos].reshape(cap.shape[:-1] + (len(orders),))
    return np.minimum(amplified, cap)
