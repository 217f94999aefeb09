"""One accountant interface, two accountants behind it, and the bound dptune charges: the smaller of them.

An :class:`Accountant` turns a sequence of events (run one after another, any of them adaptively chosen)
into ε at δ for the *whole* composed mechanism, or says it cannot (None). Five are catalogued:

* ``rdp`` (:class:`RdpAccountant`): Rényi DP, every event dptune writes (``_rdp``): composition adds
  curves (Mironov 2017), random stopping is Papernot & Steinke (2022), then one conversion (Balle et al. 2020);
* ``pld`` (:class:`PldAccountant`): privacy-loss distributions (``_pld``; dp_accounting's pessimistic PLD),
  for compositions of Gaussian, Poisson-subsampled Gaussian and score/selection releases — tight for DP-SGD;
* ``rdp+pld`` (:class:`MixedAccountant`): a composition of both kinds (``_mixed``), e.g. final training after
  a random-stopping search: the RDP part's privacy profile convolved with the PLD part's loss distribution;
* ``profile`` (:class:`ProfileAccountant`): a random-stopping search alone, from its trial's privacy profile
  (``_profile``: the pgf of K and the trial's PLD pair, for every ranking of the outputs);
* ``profile+pld`` (:class:`ProfileMixedAccountant`): ``rdp+pld`` with the search's profile the smaller of its RDP
  conversion and its ``profile`` bound (one random-stopping search, e.g. before final training; never one chosen by
  a noisy max).

Each is a valid (ε, δ) upper bound for the same composed mechanism at the same δ, so their minimum is too
(the mechanism is (ε₁, δ)-DP and (ε₂, δ)-DP, hence (min, δ)-DP). :func:`certify` returns that minimum and the
name of the accountant that gave it (certificates record it), its ε rounded up to the charge grid (``_grid``: the
same charge on every CPU); :func:`epsilon` is that ε — what the planner, calibration, certificates and the ledger
charge. Never a sum of ε's.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar

from dp_accounting import dp_event as de

from dptune.accounting._grid import round_up_epsilon
from dptune.accounting._mixed import has_noisy_max, mixed_epsilon, profile_mixed_epsilon
from dptune.accounting._pld import has_pld, pld_epsilon
from dptune.accounting._profile import has_profile, profile_epsilon
from dptune.accounting._rdp import rdp_epsilon

__all__ = ["ACCOUNTANTS", "Accountant", "Bound", "MixedAccountant", "PldAccountant", "ProfileAccountant",
           "ProfileMixedAccountant", "RdpAccountant", "accountant", "certify", "epsilon", "tight_epsilon"]


class Accountant(abc.ABC):
    """ε of a sequence of composed events at δ (add/remove-one neighbours), or None where this accountant
    has no valid bound for one of the events. Construct through :func:`accountant` (the catalogue)."""

    name: ClassVar[str]

    @abc.abstractmethod
    def can_account(self, event: de.DpEvent) -> bool:
        """Whether :meth:`epsilon` has a bound for ``event`` (cheap: no accounting is done)."""

    @abc.abstractmethod
    def epsilon(self, events: Sequence[de.DpEvent], *, delta: float) -> float | None:
        """ε at ``delta`` of ``events`` composed, or None if :meth:`can_account` refuses one of them."""


class RdpAccountant(Accountant):
    """Rényi DP (``_rdp``): every dptune event, including random stopping."""

    name: ClassVar[str] = "rdp"

    def can_account(self, event: de.DpEvent) -> bool:
        return True

    def epsilon(self, events: Sequence[de.DpEvent], *, delta: float) -> float | None:
        return rdp_epsilon(events, delta)


class PldAccountant(Accountant):
    """Privacy-loss distributions (``_pld``): Gaussian, subsampled Gaussian, noisy max (pure DP); no random
    stopping or subsampled search."""

    name: ClassVar[str] = "pld"

    def can_account(self, event: de.DpEvent) -> bool:
        return has_pld(event)

    def epsilon(self, events: Sequence[de.DpEvent], *, delta: float) -> float | None:
        return pld_epsilon(events, delta)


class MixedAccountant(Accountant):
    """A composition with parts that have a PLD and parts that have only RDP (``_mixed``: the RDP part's
    profile convolved with the PLD part's loss distribution), e.g. final training after random stopping."""

    name: ClassVar[str] = "rdp+pld"

    def can_account(self, event: de.DpEvent) -> bool:
        return True  # every event is in one part or the other; epsilon() says None unless both parts exist

    def epsilon(self, events: Sequence[de.DpEvent], *, delta: float) -> float | None:
        return mixed_epsilon(events, delta)


class ProfileAccountant(Accountant):
    """A random-stopping search alone (``RepeatAndSelectDpEvent`` of trials with a PLD), from the trial's privacy
    profile (``_profile``); composed with anything else, None (the RDP-based bounds account for that)."""

    name: ClassVar[str] = "profile"

    def can_account(self, event: de.DpEvent) -> bool:
        return has_profile(event) or isinstance(event, de.NoOpDpEvent)

    def epsilon(self, events: Sequence[de.DpEvent], *, delta: float) -> float | None:
        return profile_epsilon(events, delta)


class ProfileMixedAccountant(MixedAccountant):
    """``rdp+pld`` when its RDP part is one random-stopping search: that part's profile is the smaller of its RDP
    conversion and its ``profile`` bound (``_mixed.profile_mixed_epsilon``). Never beside a noisy max: the profile
    bound covers a search that releases only its best trial, not one that also releases a noisy max over its
    trials' counts (no theorem here bounds that pair from the trial's profile; RDP and ``rdp+pld`` do)."""

    name: ClassVar[str] = "profile+pld"

    def can_account(self, event: de.DpEvent) -> bool:
        return not has_noisy_max(event)

    def epsilon(self, events: Sequence[de.DpEvent], *, delta: float) -> float | None:
        return profile_mixed_epsilon(events, delta)


ACCOUNTANTS: Mapping[str, Accountant] = MappingProxyType({a.name: a for a in (
    RdpAccountant(), PldAccountant(), MixedAccountant(), ProfileAccountant(), ProfileMixedAccountant())})


def accountant(name: str) -> Accountant:
    """The accountant called ``name`` (a key of :data:`ACCOUNTANTS`); ``ValueError`` for any other name."""
    found = ACCOUNTANTS.get(name) if isinstance(name, str) else None
    if found is None:
        raise ValueError(f"unknown accountant {name!r}: use one of {', '.join(ACCOUNTANTS)}")
    return found


@dataclass(frozen=True, kw_only=True)
class Bound:
    """An (ε, δ) guarantee of a whole composed mechanism and the accountant (``rdp``/``pld``) that proved it."""

    epsilon: float
    delta: float
    accountant: str


def certify(events: Sequence[de.DpEvent], delta: float) -> Bound:
    """The smallest ε at ``delta`` over the catalogued accountants that can bound all of ``events`` composed
    (RDP always can). A tie goes to the earlier accountant in the catalogue (RDP)."""
    if isinstance(events, de.DpEvent):
        raise TypeError("certify() takes a sequence of events: pass [event] for one")
    events = list(events)
    best: Bound | None = None
    for acc in ACCOUNTANTS.values():
        if not all(acc.can_account(e) for e in events):
            continue
        eps = acc.epsilon(events, delta=delta)
        if eps is not None and (best is None or eps < best.epsilon):
            best = Bound(epsilon=float(eps), delta=float(delta), accountant=acc.name)
    assert best is not None  # RDP accounts for every dptune event
    return Bound(epsilon=round_up_epsilon(best.epsilon), delta=best.delta, accountant=best.accountant)


def tight_epsilon(events: Sequence[de.DpEvent], delta: float) -> float | None:
    """The smallest bound other than RDP's (None if no other accountant has one): calibration's slow,
    tight cost beside RDP's fast one (``_calibrate.calibrate_tight``)."""
    found = [a.epsilon(list(events), delta=delta) for a in ACCOUNTANTS.values()
             if a.name != RdpAccountant.name and all(a.can_account(e) for e in events)]
    values = [e for e in found if e is not None]
    return min(values) if values else None


def epsilon(events: Sequence[de.DpEvent], delta: float) -> float:
    """ε at ``delta`` of ``events`` run one after another: :func:`certify`'s minimum over valid bounds."""
    return certify(events, delta).epsilon
