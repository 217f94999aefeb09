"""RDP of the Poisson-subsampled Gaussian mechanism: dp_accounting's computation, bit for bit, faster.

Mironov, Talwar & Zhang (2019), "Rényi Differential Privacy of the Sampled Gaussian Mechanism": log A_α as a
sum of terms, integer α by the binomial expansion (Sec. 3.2), fractional α by the two series of Sec. 3.3.
dp_accounting 0.6 (pinned) evaluates each term with a scalar call of ``scipy.special.gammaln``/``log_ndtr``,
~1 µs of wrapper each: ~40-90 ms per (q, σ), which made every σ bracket (the planner's floor, final training's
calibration) seconds long. Here the terms of every order are evaluated in one array call per special
function — the same IEEE operations on the same inputs, elementwise — and only the order-dependent part, the
running log-sum with its stopping test, stays a Python loop, written exactly as dp_accounting's
(``_log_add``, inlined): the curve is the same array of floats (tests/test_accounting.py compares them with ==).
"""

from __future__ import annotations

import math

import numpy as np
from dp_accounting.rdp import rdp_privacy_accountant as rdp_acc
from scipy import special

__all__ = ["poisson_gaussian_rdp"]

_MAX_STEPS = rdp_acc._MAX_STEPS_LOG_A_FRAC  # noqa: SLF001 (dp_accounting's series length, 1000)
_BLOCK = 48  # series terms evaluated per array call; most orders converge within the first block


def poisson_gaussian_rdp(q: float, sigma: float, orders: np.ndarray) -> np.ndarray:
    """RDP at ``orders`` of one step of the Gaussian mechanism (noise multiplier ``sigma``) on a Poisson
    subsample of rate ``q``: dp_accounting's ``_compute_rdp_poisson_subsampled_gaussian(q, sigma, orders)``,
    the same floats (an order whose series does not converge in 1000 terms is inf, as there)."""
    if not 0 <= q <= 1:
        raise ValueError(f"Sampling rate must be in [0, 1]. Found {q}.")
    if sigma < 0:
        raise ValueError(f"Noise multiplier must be non-negative: {sigma}")
    out: list[float] = [0.0] * len(orders)
    ints: list[tuple[int, int]] = []  # (position, α) of integer orders
    fracs: list[tuple[int, float]] = []
    for k, alpha in enumerate(orders):
        if q == 0:
            out[k] = 0
        elif np.isinf(alpha) or sigma == 0:
            out[k] = np.inf
        elif q == 1.0:
            out[k] = alpha / (2 * sigma**2)
        elif float(alpha).is_integer():
            ints.append((k, int(alpha)))
        else:
            fracs.append((k, alpha))
    with np.errstate(all="ignore"):  # inf − inf in a term is nan there too; the running sum decides
        for (k, alpha), log_a in zip(ints, _log_a_int(q, sigma, [a for _, a in ints]), strict=True):
            out[k] = log_a / (alpha - 1)
        for (k, alpha), log_a in zip(fracs, _log_a_frac(q, sigma, [a for _, a in fracs]), strict=True):
            out[k] = log_a / (alpha - 1)
    return np.array(out)


def _log_a_int(q: float, sigma: float, alphas: list[int]) -> list[float]:
    """log A_α for integer α (dp_accounting's ``_compute_log_a_int``): every term of every order at once."""
    if not alphas:
        return []
    alpha = np.concatenate([np.full(a + 1, a, dtype=np.float64) for a in alphas])
    i = np.concatenate([np.arange(a + 1, dtype=np.float64) for a in alphas])
    log1mq = math.log1p(-q)
    log_comb = special.gammaln(alpha + 1) - special.gammaln(i + 1) - special.gammaln(alpha - i + 1)
    log_coef = log_comb + i * math.log(q) + (alpha - i) * log1mq
    terms = (log_coef + (i * i - i) / (2 * (sigma**2))).tolist()
    out = []
    start = 0
    exp, log1p, ninf = math.exp, math.log1p, -math.inf
    for a in alphas:
        log_a = ninf
        for s in terms[start:start + a + 1]:  # log_a = _log_add(log_a, s), inlined
            lo, hi = (s, log_a) if s < log_a else (log_a, s if s > log_a else log_a)
            log_a = hi if lo == ninf else log1p(exp(lo - hi)) + hi
        out.append(log_a)
        start += a + 1
    return out


def _log_a_frac(q: float, sigma: float, alphas: list[float]) -> list[float]:
    """log A_α for fractional α (dp_accounting's ``_compute_log_a_frac``): the two series of every order, a
    block of terms per array call, each order's running sums stopped where dp_accounting stops them."""
    if not alphas:
        return []
    z0 = sigma**2 * math.log(1 / q - 1) + 0.5
    log1mq = math.log1p(-q)
    log_q = math.log(q)
    root2_sigma = math.sqrt(2) * sigma
    two_sigma2 = 2 * (sigma**2)
    log_half, log_two = math.log(0.5), math.log(2)
    exp, log1p, ninf = math.exp, math.log1p, -math.inf
    # per order: [log_a0, log_a1, last_s0, last_s1]; done[k] = its log A_α once its series stopped
    state = [[-np.inf, -np.inf, -np.inf, -np.inf] for _ in alphas]
    done: list[float | None] = [None] * len(alphas)
    for start in range(0, _MAX_STEPS, _BLOCK):
        todo = [k for k in range(len(alphas)) if done[k] is None]
        if not todo:
            break
        alpha = np.asarray([alphas[k] for k in todo], dtype=np.float64)[:, None]
        i = np.arange(start, min(start + _BLOCK, _MAX_STEPS), dtype=np.float64)[None, :]
        log_coef = special.gammaln(alpha + 1) - special.gammaln(i + 1) - special.gammaln(alpha - i + 1)
        j = alpha - i
        log_t0 = log_coef + i * log_q + j * log1mq
        log_t1 = log_coef + j * log_q + i * log1mq
        log_e0 = log_half + (log_two + special.log_ndtr(-((i - z0) / root2_sigma) * 2**0.5))
        log_e1 = log_half + (log_two + special.log_ndtr(-((z0 - j) / root2_sigma) * 2**0.5))
        s0 = (log_t0 + (i * i - i) / two_sigma2 + log_e0).tolist()
        s1 = (log_t1 + (j * j - j) / two_sigma2 + log_e1).tolist()
        for row, k in enumerate(todo):
            log_a0, log_a1, last_s0, last_s1 = state[k]
            for log_s0, log_s1 in zip(s0[row], s1[row], strict=True):
                # log_a0 = _log_add(log_a0, log_s0); log_a1 = _log_add(log_a1, log_s1);
                # total = _log_add(log_a0, log_a1): inlined (this loop is the routine's running time)
                lo, hi = (log_s0, log_a0) if log_s0 < log_a0 else (log_a0, log_s0 if log_s0 > log_a0 else log_a0)
                log_a0 = hi if lo == ninf else log1p(exp(lo - hi)) + hi
                lo, hi = (log_s1, log_a1) if log_s1 < log_a1 else (log_a1, log_s1 if log_s1 > log_a1 else log_a1)
                log_a1 = hi if lo == ninf else log1p(exp(lo - hi)) + hi
                if log_s0 < last_s0 and log_s1 < last_s1:  # the total only matters to the stopping test
                    lo, hi = (log_a1, log_a0) if log_a1 < log_a0 else (log_a0, log_a1 if log_a1 > log_a0 else log_a0)
                    total = hi if lo == ninf else log1p(exp(lo - hi)) + hi
                    if max(log_s0, log_s1) < total - 30:
                        done[k] = total
                        break
                last_s0, last_s1 = log_s0, log_s1
            state[k] = [log_a0, log_a1, last_s0, last_s1]
    return [np.inf if d is None else d for d in done]
