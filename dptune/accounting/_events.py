"""Privacy events of dptune as dp_accounting ``DpEvent`` values, and their JSON form.

Events are frozen, composable values (dp_accounting's design); accountants interpret them (``_rdp``). dptune
adds three event types, all defined here so the one JSON allow-list below names every event dptune writes:

* :class:`WorstCaseDpEvent`: a data-independent random choice among several mechanisms (a random search
  trial), whose Rényi divergence is at most the maximum of its components' at every order (quasi-convexity
  of Rényi divergence; Papernot & Steinke 2022, Sec. 3);
* :class:`SubsampledMechanismDpEvent`: a mechanism run on a Poisson subsample of the data, drawn once
  (Zhu & Wang 2019, Thm. 6; Koskela & Kulkarni 2023 for the whole search, see ``_subsample``);
* :class:`NoisyMaxDpEvent`: report-noisy-max with Gumbel noise over validation correct-counts — the
  exponential mechanism, whose one release (the index of the best candidate) costs the same however many
  candidates it chooses among (``privacy.selection: noisy_max``);
* :class:`RdpFilterDpEvent`: fully adaptive mechanisms admitted by an RDP filter (ASHA's rung segments,
  ``privacy.stopping: filter``), charged at the filter's bound, RDP only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import attr
from dp_accounting import dp_event as de

from dptune.errors import ConfigError, check_positive, check_unit_interval

__all__ = [
    "NoisyMaxDpEvent",
    "FILTER_SLACK",
    "RdpFilterDpEvent",
    "SubsampledMechanismDpEvent",
    "WorstCaseDpEvent",
    "event_from_json",
    "event_to_json",
    "score_event",
    "split_selection",
    "trial_event",
    "with_selection",
]


@attr.s(frozen=True, slots=True, auto_attribs=True)
class WorstCaseDpEvent(de.DpEvent):
    """One of ``events``, chosen independently of the data; charged at the pointwise-maximal RDP curve."""

    events: tuple[de.DpEvent, ...]


@attr.s(frozen=True, slots=True, auto_attribs=True)
class SubsampledMechanismDpEvent(de.DpEvent):
    """``event`` run on a Poisson subsample (rate ``fraction``) of the data, drawn once: Zhu & Wang 2019, Thm. 6."""

    event: de.DpEvent
    fraction: float


@attr.s(frozen=True, slots=True, auto_attribs=True)
class NoisyMaxDpEvent(de.DpEvent):
    """Release of argmax_i (u_i + G_i), G_i i.i.d. Gumbel(0, ``gumbel_scale``), over utilities u_i that one
    added or removed example changes by at most 1, all in the same direction (validation correct-counts:
    adding an example adds 0 or 1 to every count). Only the index is released, never a noised value.

    By the Gumbel-max trick this is the exponential mechanism P[i] ∝ exp(u_i/β), β = ``gumbel_scale``
    (McSherry & Talwar 2007). With monotone utilities of sensitivity 1 it is (1/β)-bounded-range (Dong,
    Durfee & Rogers 2020, "Optimal Differential Privacy Composition for Exponential Mechanisms"), hence
    1/(8β²)-zCDP (Cesar & Rogers, ALT 2021, "Bounding, Concentrating, and Truncating"), and (1/β)-DP.
    RDP at order λ: min(λ/(8β²), 1/β) — the Gaussian mechanism's curve at noise multiplier 2β, capped.
    """

    gumbel_scale: float


@attr.s(frozen=True, slots=True, auto_attribs=True)
class RdpFilterDpEvent(de.DpEvent):
    """Mechanisms chosen fully adaptively (which runs next, and its parameters, may depend on every earlier
    output), each admitted only while the sum of the admitted mechanisms' RDP curves stays at or below the RDP
    curve of ``budget`` at every order of ``dptune.accounting.ORDERS`` (fixed before the first is run): an RDP
    filter (Feldman & Zrnic 2021, Thm. 3.1; Whitehouse et al. 2023). The whole is (α, RDP_budget(α))-RDP at each
    order, and that is all: it is charged at ``budget``'s RDP curve (times 1 + ``FILTER_SLACK``, the admission's
    float tolerance) and converted from RDP only (no PLD)."""

    budget: de.DpEvent


# the filter's admission tolerance, relative: curves summed in floats may exceed the bound's own float by rounding
# (segments of N full trials sum to N trials' curve within ~1e-15); the charge includes it (``_rdp.rdp_of``)
FILTER_SLACK = 1e-12


def with_selection(search: de.DpEvent, selection: NoisyMaxDpEvent | None) -> de.DpEvent:
    """A search's charge: its trials, composed with the one selection release when it is a noisy max."""
    return search if selection is None else de.ComposedDpEvent([search, selection])


def split_selection(search: de.DpEvent) -> tuple[de.DpEvent, NoisyMaxDpEvent | None]:
    """The inverse of :func:`with_selection`: (the trials' event, the noisy-max selection or None)."""
    if (isinstance(search, de.ComposedDpEvent) and len(search.events) == 2
            and isinstance(search.events[1], NoisyMaxDpEvent)):
        return search.events[0], search.events[1]
    return search, None


def score_event(*, score_noise: float | None) -> de.DpEvent:
    """Release of a validation correct-count (sensitivity 1) with Gaussian noise of std ``score_noise``.

    ``None`` means the validation split was declared public: the release costs nothing.
    """
    if score_noise is None:
        return de.NoOpDpEvent()
    return de.GaussianDpEvent(noise_multiplier=float(score_noise))


def trial_event(*, noise_multiplier: float, sampling_rate: float, steps: int,
                score_noise: float | None, scores: int = 1) -> de.DpEvent:
    """One trial: T steps of Poisson-sampled Gaussian (DP-SGD) composed with its score releases (one; an ASHA
    trial one at each rung)."""
    check_positive("noise_multiplier", noise_multiplier, "choose sigma > 0")
    check_unit_interval("sampling_rate", sampling_rate, "choose q = B/n in (0, 1]", include_one=True)
    if isinstance(steps, bool) or int(steps) != steps or steps < 1:
        raise ConfigError("steps", f"{steps!r} is not an integer >= 1", "choose at least one step")
    if score_noise is not None:
        check_positive("score_noise", score_noise, "choose a noise std > 0 or declare the validation public")
    sgd = de.SelfComposedDpEvent(
        de.PoissonSampledDpEvent(float(sampling_rate), de.GaussianDpEvent(float(noise_multiplier))), int(steps)
    )
    if isinstance(scores, bool) or int(scores) != scores or scores < 1:
        raise ConfigError("scores", f"{scores!r} is not an integer >= 1", "release at least one score")
    score = score_event(score_noise=score_noise)
    if scores > 1 and score_noise is not None:
        score = de.SelfComposedDpEvent(score, int(scores))
    return de.ComposedDpEvent([sgd, score])


# ---------------------------------------------------------------------------------------------------
# JSON: one explicit, read-only allow-list, so a tampered file cannot name arbitrary classes to import.

_ALLOWED: Mapping[str, type[de.DpEvent]] = MappingProxyType({
    c.__name__: c
    for c in (de.NoOpDpEvent, de.GaussianDpEvent, de.PoissonSampledDpEvent, de.SelfComposedDpEvent,
              de.ComposedDpEvent, de.RepeatAndSelectDpEvent, WorstCaseDpEvent, SubsampledMechanismDpEvent,
              NoisyMaxDpEvent, RdpFilterDpEvent)
})


def _num(x: float) -> float | str:
    return "inf" if x == math.inf else float(x)


def event_to_json(event: de.DpEvent) -> dict[str, Any]:
    """The event as plain JSON data (every class on the allow-list, nothing else)."""
    name = type(event).__name__
    if _ALLOWED.get(name) is not type(event):
        raise TypeError(f"dptune cannot serialize {name}")
    out: dict[str, Any] = {"type": name}
    for f in attr.fields(type(event)):
        v = getattr(event, f.name)
        if isinstance(v, de.DpEvent):
            out[f.name] = event_to_json(v)
        elif isinstance(v, Sequence) and not isinstance(v, str):
            out[f.name] = [event_to_json(x) for x in v]
        elif isinstance(v, bool) or not isinstance(v, int | float):
            raise TypeError(f"unexpected field {f.name}={v!r} in {name}")
        else:
            out[f.name] = v if isinstance(v, int) else _num(v)
    return out


def event_from_json(data: Any) -> de.DpEvent:
    """The event :func:`event_to_json` wrote; ``ValueError`` for anything else."""
    if not isinstance(data, dict) or data.get("type") not in _ALLOWED:
        raise ValueError(f"not a dptune privacy event: {str(data)[:80]!r}")
    cls = _ALLOWED[data["type"]]
    kwargs: dict[str, Any] = {}
    for f in attr.fields(cls):
        if f.name not in data:
            raise ValueError(f"{data['type']} lacks field {f.name!r}")
        v = data[f.name]
        if isinstance(v, dict):
            kwargs[f.name] = event_from_json(v)
        elif isinstance(v, list):
            items = [event_from_json(x) for x in v]
            kwargs[f.name] = tuple(items) if cls is WorstCaseDpEvent else items
        elif v == "inf":
            kwargs[f.name] = math.inf
        elif isinstance(v, bool) or not isinstance(v, int | float):
            raise ValueError(f"{data['type']}.{f.name} is not a number: {v!r}")
        else:
            kwargs[f.name] = v
    return cls(**kwargs)
