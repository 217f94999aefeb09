"""ε of a composition whose parts have a PLD and parts have only an RDP curve (e.g. final training after a
random-stopping search): the RDP part's privacy profile convolved with the PLD part's loss distribution.

Let A be the events with only an RDP curve r(λ) (composed: curves add), B those with a PLD (``_pld``).
Proof that the bound below holds for the adaptive composition of A and B, in any order, add/remove neighbours:

1. A is (x, δ_R(x))-DP for every x >= 0, δ_R the RDP conversion (``_convert.rdp_to_delta``, Balle et al. 2020)
   — for :func:`profile_mixed_epsilon`, the smaller of that and the privacy-profile bound of A, one random-stopping
   search (``_profile``, which bounds both directions) — so its tradeoff function is at least f = sup_x f_{x, δ_R(x)}, a symmetric tradeoff function (Dong, Roth &
   Su 2022, Prop. 2.5 and 2.2), realised by a pair (P_A, Q_A) that Blackwell-dominates A on every neighbouring
   pair (Blackwell's theorem). Its hockey-stick profile is δ_A(x) <= δ_R(x) for x >= 0 and, by
   H_{e^x}(P||Q) = 1 − e^x + e^x·H_{e^{−x}}(Q||P) and the symmetry of f, δ_A(x) <= 1 − e^x + e^x·δ_R(−x) for x < 0.
2. dp_accounting's pessimistic PLD of B (both directions) is a dominating pair for every α = e^x, x real
   (losses rounded up: H_α = E_P[(1 − α e^{−L})_+] only grows; connect-the-dots: Doroshenko et al. 2022).
3. The product of dominating pairs dominates the adaptive composition (Zhu, Dong & Wang, AISTATS 2022,
   Thm. 10), and for a product H_{e^ε}(P_A×P_B || Q_A×Q_B) = E_{L~P_B}[δ_A(ε − L)] exactly (L the loss of B's
   pair; L = ∞ contributes 1). So δ(ε) <= E_{L~PLD_B}[δ̄_A(ε − L)] with δ̄_A the bounds of step 1, per direction.

ε at δ is then found by bisection on this δ(ε), which decreases in ε. It is charged only where it is the
smallest valid bound (``_accountant``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from dp_accounting import dp_event as de

from dptune.accounting import _strictmath as strict
from dptune.accounting._convert import ORDERS, rdp_to_delta, rdp_to_epsilon
from dptune.accounting._events import NoisyMaxDpEvent
from dptune.accounting._pld import VALUE_DISCRETIZATION_INTERVAL, has_pld, pld_module, pld_of
from dptune.accounting._pldlib import fftconvolve
from dptune.accounting._profile import has_profile, search_profile_delta_grid
from dptune.accounting._rdp import rdp_of

__all__ = ["has_noisy_max", "mixed_epsilon", "profile_mixed_epsilon", "rdp_pld_epsilon", "split_by_pld"]

_TAIL = 1e-14  # loss-distribution mass below this per point is charged δ = 1 instead of evaluated


def has_noisy_max(event: de.DpEvent) -> bool:
    """Whether ``event`` holds a noisy-max selection anywhere inside a composition."""
    if isinstance(event, NoisyMaxDpEvent):
        return True
    return isinstance(event, de.ComposedDpEvent) and any(has_noisy_max(e) for e in event.events)


def split_by_pld(events: Sequence[de.DpEvent]) -> tuple[list[de.DpEvent], list[de.DpEvent]]:
    """(events with a PLD, events without), flattening compositions (composition is associative)."""
    with_pld: list[de.DpEvent] = []
    without: list[de.DpEvent] = []
    for e in events:
        if has_pld(e):
            with_pld.append(e)
        elif isinstance(e, de.ComposedDpEvent):
            a, b = split_by_pld(e.events)
            with_pld += a
            without += b
        else:
            without.append(e)
    return with_pld, without


@functools.lru_cache(maxsize=16)
def _rdp_delta_grid(rdp_bytes: bytes, size: int) -> np.ndarray:
    """δ_R(k·step) for k = 0..size−1 of the RDP curve (as bytes, for the cache): calibration reuses it."""
    rdp = np.frombuffer(rdp_bytes, dtype=np.float64)
    out = rdp_to_delta(ORDERS, rdp, epsilons=np.arange(size) * VALUE_DISCRETIZATION_INTERVAL)
    out.flags.writeable = False
    return out


def _rdp_profile(rdp: np.ndarray, x: np.ndarray, search: de.DpEvent | None = None) -> np.ndarray:
    """Upper bound of the hockey-stick profile δ_A(x·step) of a symmetric pair with RDP curve ``rdp`` (and, with
    ``search``, the profile bound of that random-stopping search too), for integers x (grid steps): δ_R(x) for
    x >= 0, 1 − e^x + e^x·δ_R(−x) below (module docstring, step 1)."""
    ax = np.abs(x)
    size = 1 << max(10, int(ax.max()).bit_length())  # powers of two: one grid serves many calls
    grid = _rdp_delta_grid(np.ascontiguousarray(rdp, dtype=np.float64).tobytes(), size)
    if search is not None:
        grid = np.minimum(grid, search_profile_delta_grid(search, step=VALUE_DISCRETIZATION_INTERVAL, size=size))
    d = grid[ax]
    e = strict.exp(x * VALUE_DISCRETIZATION_INTERVAL)
    return np.minimum(1.0, np.where(x >= 0, d, 1 - e + e * d))


def mixed_epsilon(events: Sequence[de.DpEvent], delta: float) -> float | None:
    """ε at ``delta`` of ``events`` composed, by the bound of the module docstring, on the PLD's grid (ε
    rounded up to a multiple of its 1e-3 interval, so that ε − L is on the grid too and δ̄_A is evaluated once
    per grid point; the crossing found by one FFT correlation and confirmed by exact sums); None unless some
    events have a PLD and some do not."""
    return _mixed(events, delta, profile=False)


def profile_mixed_epsilon(events: Sequence[de.DpEvent], delta: float) -> float | None:
    """:func:`mixed_epsilon` with the RDP part's profile the smaller of its RDP conversion and its own
    privacy-profile bound (``_profile``); None unless the part without a PLD is exactly one random-stopping search
    of trials with a PLD (e.g. final training after the search), and None beside a noisy max: the profile bound
    holds when only the best trial leaves, and a noisy max over the trials' counts releases more (which search's
    trials it chose among, the events do not say). A separate accountant, so certificates that ``rdp+pld`` proved
    before it existed still verify."""
    return _mixed(events, delta, profile=True)


def _mixed(events: Sequence[de.DpEvent], delta: float, *, profile: bool) -> float | None:
    if isinstance(events, de.DpEvent):
        raise TypeError("mixed_epsilon() takes a sequence of events: pass [event] for one")
    b_events, a_events = split_by_pld(list(events))
    if not a_events or not b_events:
        return None
    search = a_events[0] if len(a_events) == 1 and has_profile(a_events[0]) else None
    if profile and (search is None or any(has_noisy_max(e) for e in b_events)):
        return None
    rdp = np.sum([rdp_of(e) for e in a_events], axis=0)
    pld = pld_module().identity(value_discretization_interval=VALUE_DISCRETIZATION_INTERVAL)
    for e in b_events:
        one = pld_of(e)
        assert one is not None
        pld = pld.compose(one)
    return rdp_pld_epsilon(rdp, pld, delta, search=search if profile else None)


def rdp_pld_epsilon(rdp: np.ndarray, pld: Any, delta: float, *, search: de.DpEvent | None = None) -> float:
    """ε at ``delta`` of a mechanism with RDP curve ``rdp`` (at ``ORDERS``) composed with one with PLD ``pld``
    (dp_accounting, interval 1e-3): the bound of the module docstring, ε rounded up to the grid. ``search``: the
    RDP part is this one random-stopping search, whose privacy-profile bound (``_profile``) is used where smaller."""
    worst = 0
    step = VALUE_DISCRETIZATION_INTERVAL
    for pmf in (pld._pmf_remove, pld._pmf_add):  # noqa: SLF001 - the loss distributions of both directions
        dense = pmf.to_dense_pmf()
        probs = np.asarray(dense._probs, dtype=np.float64)  # noqa: SLF001
        assert math.isclose(dense._discretization, step)  # noqa: SLF001
        keep = np.flatnonzero(probs > _TAIL)
        fixed = float(dense._infinity_mass) + float(probs.sum() - probs[keep].sum())  # noqa: SLF001 - δ = 1
        lo_i, hi_i = int(keep[0]), int(keep[-1])
        p = probs[lo_i:hi_i + 1][::-1]  # reversed: a dot product with a slice of g is the correlation
        first = int(dense._lower_loss) + lo_i  # noqa: SLF001 - loss of p's last entry, in grid steps
        top = max(1, math.ceil(float(rdp_to_epsilon(ORDERS, rdp, delta=delta)) / step) + first + len(p))
        while True:  # ε = j·step, j in [0, top]; x = ε − L in grid steps runs from x0 to top − first
            x0 = -(first + len(p) - 1)
            g = _rdp_profile(rdp, np.arange(x0, top - first + 1), search)
            # all j at once: the correlation of g with p (FFT), then checked exactly by dot products below
            approx = fftconvolve(g, p[::-1], mode="valid") + fixed  # [top + 1]

            def total(j: int, g: np.ndarray = g, p: np.ndarray = p, fixed: float = fixed) -> float:
                return float(np.sum(p * g[j:j + len(p)])) + fixed  # x0 = −(first + len − 1): g index j + k

            if total(top) <= delta:
                break
            if top * step > 1e4:
                return math.inf
            top *= 2
        if total(0) <= delta:
            continue
        fits = np.flatnonzero(approx <= delta)
        guess = int(fits[0]) if len(fits) else top
        if 0 < guess <= top and total(guess) <= delta < total(guess - 1):
            worst = max(worst, guess)
            continue
        lo, hi = 0, top  # the FFT's rounding misled the guess: exact bisection, total(lo) > δ >= total(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if total(mid) > delta else (lo, mid)
        worst = max(worst, hi)
    return worst * step
