"""The catalogue of stopping rules: the one place that names them (``privacy.stopping`` of a search space).

Everything that chooses, lists or recognises rules goes through here — the planner, the advice, the plan
CLI, plots and reports — so a new rule is its subclass in ``_rules`` plus one ``register_rule`` line below, which
also tells the config layer (``dptune.config.stopping``) its name, settings and the accounting it implies.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from types import MappingProxyType

from dp_accounting import dp_event as de

from dptune.accounting._rules import Composed, Filter, Poisson, StoppingRule, TruncatedNegativeBinomial
from dptune.config import PrivacySpec, stopping
from dptune.errors import ConfigError

__all__ = ["STOPPING_RULES", "alternative_rules", "comparison_rules", "register_rule", "rule_of", "rule_of_search_event",
           "stopping_rule"]

_RULES: dict[str, type[StoppingRule]] = {}
STOPPING_RULES: Mapping[str, type[StoppingRule]] = MappingProxyType(_RULES)  # read-only view, in registration order


# a trial event to probe a rule's search event with at registration (any event will do: a rule never looks inside)
_PROBE_TRIAL = de.PoissonSampledDpEvent(0.01, de.GaussianDpEvent(1.0))


def register_rule(cls: type[StoppingRule]) -> type[StoppingRule]:
    """Register a stopping rule: here (its events and draws) and with the config layer (its name, settings and
    the accounting it implies: ``dptune.config.stopping``).

    Everything that can be checked without a space is checked here, so a mistake fails at import and never after a
    charge (ValueError naming the rule): a concrete ``StoppingRule`` subclass, a name registered once, ``mean``
    first, no setting or ``describe()`` key a certificate must refuse (``stopping.reveals_k``); and one search event
    per rule: each of its variants' search events reads back as exactly that variant (``from_search_event``) and is
    claimed by no other rule, nor does it claim theirs (``rule_of_search_event`` must name one rule for every
    stored charge).
    """
    if not (isinstance(cls, type) and issubclass(cls, StoppingRule)) or inspect.isabstract(cls):
        raise ValueError(f"{cls!r} is not a concrete StoppingRule subclass")
    info = stopping.RuleInfo(name=cls.name, summary=cls.summary(), random_stopping=cls.random_stopping,
                             settings=cls.setting_names(), build=cls.from_settings, mode=cls.accounting)
    stopping.check(info)
    clash = sorted(set(info.settings[1:]) & {f.name for f in dataclasses.fields(PrivacySpec)})
    if clash:
        raise ValueError(f"stopping rule {cls.name!r}: setting {clash[0]!r} is a privacy key of its own "
                         "(privacy.<setting> would be ambiguous): rename it")
    _check_events(cls)
    stopping.register(info)
    _RULES[cls.name] = cls
    return cls


def _check_events(cls: type[StoppingRule]) -> None:
    """A rule's variants: a certificate could carry their descriptions, and each search event is this rule's alone."""
    mine = [v for mean in (1.0, 3.0) for v in cls.variants(mean)]
    if not mine:
        raise ValueError(f"stopping rule {cls.name!r}: variants() gives no rule to price")
    theirs = [v for other in _RULES.values() for v in other.variants(3.0)]
    for rule in mine:
        if type(rule) is not cls:
            raise ValueError(f"stopping rule {cls.name!r}: variants() gives a {type(rule).__name__}")
        described = rule.describe()
        revealing = sorted(k for k in described if stopping.reveals_k(k))
        if revealing or described.get("rule") != cls.name:
            raise ValueError(f"stopping rule {cls.name!r}: describe() of {rule.label()} is "
                             f"{sorted(described)}: it needs rule = {cls.name!r} and no key that reads as the drawn "
                             f"number of trials ({revealing})")
        if cls.from_settings({n: getattr(rule, n) for n in cls.setting_names()}) != rule:
            raise ValueError(f"stopping rule {cls.name!r}: {rule.label()} does not rebuild from its settings")
        event = rule.search_event(_PROBE_TRIAL)
        if cls.from_search_event(event) != (_PROBE_TRIAL, rule):
            raise ValueError(f"stopping rule {cls.name!r}: from_search_event does not read back the search event "
                             f"of {rule.label()} ({event})")
        for other in _RULES.values():
            if other.from_search_event(event) is not None:
                raise ValueError(f"stopping rule {cls.name!r}: the search event of {rule.label()} reads as a "
                                 f"{other.name!r} search too; give it an event of its own")
    for rule in theirs:
        if cls.from_search_event(rule.search_event(_PROBE_TRIAL)) is not None:
            raise ValueError(f"stopping rule {cls.name!r}: it reads the search event of {rule.label()} as its own")


register_rule(Poisson)
register_rule(TruncatedNegativeBinomial)
register_rule(Composed)
register_rule(Filter)


def stopping_rule(name: str, *, mean: float, **settings: float) -> StoppingRule:
    """The rule called ``name`` with E[K] (or the number of trials) ``mean`` and its own ``settings`` (TNB: ``eta``).

    Raises :class:`ConfigError` naming the field (``privacy.stopping``, ``privacy.mean``, ``privacy.<setting>``).
    """
    cls = STOPPING_RULES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ConfigError("privacy.stopping", f"unknown stopping rule {name!r}",
                          f"use one of: {', '.join(STOPPING_RULES)}")
    return cls.from_settings({"mean": mean, **settings})


def rule_of(privacy: PrivacySpec) -> StoppingRule:
    """The stopping rule a space's ``privacy`` settings name."""
    return stopping_rule(privacy.stopping, mean=privacy.mean, **dict(privacy.stopping_settings))


def comparison_rules(mean: float) -> list[StoppingRule]:
    """Every rule's standard variants at mean ``mean`` (composition at the rounded mean), in catalogue order; not the
    RDP filter's, which prices ASHA's segments and no search of whole trials."""
    return [rule for cls in STOPPING_RULES.values() if cls.accounting != "filter" for rule in cls.variants(mean)]


def alternative_rules(rule: StoppingRule) -> list[StoppingRule]:
    """The other rules at the same mean, for side-by-side prices."""
    return [r for r in comparison_rules(rule.mean) if r.label() != rule.label()]


def rule_of_search_event(event: de.DpEvent) -> tuple[de.DpEvent, StoppingRule]:
    """(trial event, rule) of a search event some rule's ``search_event`` made; ``ValueError`` otherwise."""
    found = [parts for cls in STOPPING_RULES.values() if (parts := cls.from_search_event(event)) is not None]
    if len(found) != 1:
        raise ValueError(f"{type(event).__name__} is not the search event of exactly one stopping rule "
                         f"({', '.join(STOPPING_RULES)})")
    return found[0]
