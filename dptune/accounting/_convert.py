"""RDP → (ε, δ) conversion at dptune's orders: the one implementation, vectorised over curves.

Balle, Barthe, Gaboardi, Hsu & Sato, "Hypothesis Testing Interpretations and Renyi Differential Privacy"
(AISTATS 2020), Prop. 12 (also Asoodeh et al. 2020, Eq. 20), with the KL bound δ ≤ √(1 − e^{−ε(λ)}) where it
is better — exactly dp_accounting's ``compute_epsilon`` / ``compute_delta`` (the tests compare them), written
for a batch of curves (leading dimensions) so the advice can price many plans in one call.
"""

from __future__ import annotations

import numpy as np
from dp_accounting.rdp import rdp_privacy_accountant as rdp_acc

from dptune.accounting import _strictmath as strict

__all__ = ["ORDERS", "rdp_to_delta", "rdp_to_epsilon"]

# dp_accounting's default orders (also what its RdpAccountant uses for RepeatAndSelectDpEvent).
ORDERS: np.ndarray = np.asarray(rdp_acc.DEFAULT_RDP_ORDERS, dtype=np.float64)
ORDERS.flags.writeable = False
strict.make_strict(rdp_acc.__name__)  # its RDP conversions and random stopping compute with strict exp/log


def rdp_to_epsilon(orders: np.ndarray, rdp: np.ndarray, *, delta: float) -> np.ndarray:
    """ε at ``delta`` of each curve: ``rdp`` is ``[..., len(orders)]``, the result ``[...]``.

    Orders ≤ 1.01 are skipped (the bound is unstable there), a negative or KL-small curve gives ε = 0, an
    unconverged order (inf/nan) gives no bound — dp_accounting's ``compute_epsilon`` case by case.
    """
    if delta < 0:
        raise ValueError(f"delta cannot be negative, got {delta}")
    a = np.asarray(orders, dtype=np.float64)
    r = np.asarray(rdp, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        eps = r + strict.log1p(-1 / a) - strict.log(delta * a) / (a - 1)
        eps = np.where(a > 1.01, eps, np.inf)
        eps = np.where(delta ** 2 + strict.expm1(-r) > 0, 0.0, eps)
    eps = np.where(np.isnan(eps), np.inf, eps)
    return np.maximum(0.0, eps.min(axis=-1))


def rdp_to_delta(orders: np.ndarray, rdp: np.ndarray, *, epsilons: np.ndarray) -> np.ndarray:
    """δ at each ε in ``epsilons`` (``[E]``) of each curve ``rdp`` (``[..., len(orders)]``): ``[..., E]``.

    dp_accounting's ``compute_delta``: min over orders of the Prop. 12 bound (orders > 1.01) and the KL bound.
    """
    a = np.asarray(orders, dtype=np.float64)
    r = np.asarray(rdp, dtype=np.float64)[..., None, :]  # [..., 1, O]
    e = np.asarray(epsilons, dtype=np.float64)[:, None]  # [E, 1]
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        kl = np.where(r > 0, 0.5 * strict.log1p(-strict.exp(-r)), -np.inf)
        # (a−1)(r − ε + log1p(−1/a)) − log a, split so the [..., E, O] work is one multiply-add
        part = (a - 1) * (r + strict.log1p(-1 / a)) - strict.log(a)
        bound = part - (a - 1) * e
        logdelta = np.where(a > 1.01, np.fmin(kl, bound), kl)
        logdelta = np.where(np.isnan(logdelta), 0.0, logdelta)  # inf − inf at unconverged orders: no bound
    return np.minimum(strict.exp(logdelta.min(axis=-1)), 1.0)
