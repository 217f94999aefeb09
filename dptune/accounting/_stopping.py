"""Random stopping: Papernot & Steinke, "Hyperparameter Tuning with Renyi Differential Privacy"
(ICLR 2022, arXiv:2110.03620v2). Pure functions of RDP curves; no I/O.

Running a mechanism K times, K random, and releasing only the best output costs:
- K ~ TNB(η, γ) (Theorem 2): for λ > 1, λ̂ ≥ 1,
  ε'(λ) = ε(λ) + (1+η)(1 − 1/λ̂) ε(λ̂) + (1+η) log(1/γ)/λ̂ + log E[K] / (λ − 1);
- K ~ Poisson(μ) (Theorem 6): ε'(λ) = ε(λ) + μ δ̂ + log μ / (λ − 1), with (ε̂, δ̂)-DP of one run and
  e^ε̂ ≤ 1 + 1/(λ − 1).
"""

from __future__ import annotations

import math

import numpy as np
from scipy.special import gammaln

from dptune.accounting import _strictmath as strict
from dptune.accounting._convert import rdp_to_delta

__all__ = ["draw_tnb", "random_stopping_rdp", "tnb_gamma", "tnb_mean"]


def tnb_mean(*, gamma: float, eta: float) -> float:
    """E[K] of the truncated negative binomial (paper, Definition 1 / Eq. 4)."""
    if not 0 < gamma <= 1:
        raise ValueError(f"gamma must be in (0, 1], got {gamma}")
    if gamma == 1:
        return 1.0
    if eta == 0:  # logarithmic distribution
        return (1 - gamma) / (gamma * math.log(1 / gamma))
    # η (1 − γ) / (γ (1 − γ^η)), written with expm1 for small η log γ
    return eta * (1 - gamma) / (gamma * -math.expm1(eta * math.log(gamma)))


def tnb_gamma(*, mean: float, eta: float) -> float:
    """γ of TNB(η, γ) with the given mean (E[K] is decreasing in γ); conservative (smaller γ)."""
    if mean < 1:
        raise ValueError(f"mean must be >= 1, got {mean}")
    if mean == 1:
        return 1.0
    if eta == 1:
        return 1 / mean
    lo, hi = 0.0, 1.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if mid in (lo, hi):
            break
        if tnb_mean(gamma=mid, eta=eta) < mean:
            hi = mid
        else:
            lo = mid
    return lo if lo > 0 else hi


def random_stopping_rdp(orders: np.ndarray, rdp: np.ndarray, *, mean: float, shape: float) -> np.ndarray:
    """RDP of 'run K times, release the best' from one run's RDP curve(s) ``rdp`` (``[..., len(orders)]``).

    ``shape`` = η of TNB(η, γ) (Theorem 2; 0 logarithmic, 1 geometric) or ``math.inf`` for Poisson(mean)
    (Theorem 6). The λ̂ of Theorem 2 is minimised over the order grid; the result is made non-decreasing
    in the order (a bound at λ' ≥ λ also bounds λ). Leading dimensions are a batch of curves.
    """
    orders = np.asarray(orders, dtype=np.float64)
    rdp = np.asarray(rdp, dtype=np.float64)
    if not (mean >= 1 and math.isfinite(mean)):
        raise ValueError(f"mean must be >= 1, got {mean}")
    if math.isnan(shape) or shape < 0:
        raise ValueError(f"shape must be >= 0, got {shape}")
    with np.errstate(divide="ignore", invalid="ignore"):
        if shape == math.inf:  # Theorem 6, δ̂ at the largest ε̂ with e^ε̂ <= 1 + 1/(λ − 1)
            eps_hat = strict.log1p(1 / (orders - 1))
            out = rdp + mean * rdp_to_delta(orders, rdp, epsilons=eps_hat)
        else:  # Theorem 2, the λ̂ term minimised over the orders λ̂ >= 1
            gamma = tnb_gamma(mean=mean, eta=shape)
            hat = (1 - 1 / orders) * rdp + math.log(1 / gamma) / orders
            hat = np.where(np.isfinite(hat) & (orders >= 1), hat, np.inf)
            out = rdp + (1 + shape) * np.min(hat, axis=-1, keepdims=True)
        out = np.where(orders > 1, out + math.log(mean) / (orders - 1), np.inf)
    return np.minimum.accumulate(out[..., ::-1], axis=-1)[..., ::-1]


def draw_tnb(u: float, *, gamma: float, eta: float) -> int:
    """Inverse-CDF draw of K ~ TNB(η, γ) from one uniform ``u`` (support K ≥ 1; Definition 1).

    P[K = k] ∝ (1 − γ)^k · Γ(k + η) / (Γ(η) k!) for η > 0 and ∝ (1 − γ)^k / k for η = 0.
    """
    if gamma >= 1:
        return 1
    log_q = math.log1p(-gamma)
    if eta == 0:
        log_norm = math.log(math.log(1 / gamma))  # Σ_k (1−γ)^k / k = log(1/γ)
    else:
        # Σ_{k≥1} C(k+η−1, k)(1−γ)^k = γ^{−η} − 1
        log_norm = math.log(math.expm1(-eta * math.log(gamma)))
    cum, k = 0.0, 0
    while True:
        k += 1
        if eta == 0:
            log_p = k * log_q - math.log(k) - log_norm
        else:
            log_p = k * log_q + gammaln(k + eta) - gammaln(eta) - gammaln(k + 1) - log_norm
        p = math.exp(log_p)
        cum += p
        # The mass beyond the last k whose probability is still representable (< 1e-300) is assigned
        # to that k: a numerical tail, not a cap on K.
        if cum >= u or (p < 1e-300 and k > 1):
            return k
