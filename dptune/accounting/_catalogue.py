"""The catalogue of stopping rules: the one place that names them (``privacy.stopping`` of a search space).

Everything that chooses, lists or recognises rules goes through here — the planner, the advice, the plan
CLI, plots and reports — so a new rule is its subclass in ``_rules`` plus one ``register_rule`` line below, which
also tells the config layer (``dptune.stopping``) its name, settings and the accounting it implies.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from dp_accounting import dp_event as de

from dptune import stopping
from dptune.accounting._rules import Composed, Poisson, StoppingRule, TruncatedNegativeBinomial
from dptune.config import PrivacySpec
from dptune.errors import ConfigError

__all__ = ["STOPPING_RULES", "alternative_rules", "comparison_rules", "register_rule", "rule_of", "rule_of_search_event",
           "stopping_rule"]

_RULES: dict[str, type[StoppingRule]] = {}
STOPPING_RULES: Mapping[str, type[StoppingRule]] = MappingProxyType(_RULES)  # read-only view, in registration order


def register_rule(cls: type[StoppingRule]) -> type[StoppingRule]:
    """Register a stopping rule: here (its events and draws) and with the config layer (its name, settings and
    the accounting it implies: ``dptune.stopping``)."""
    _RULES[cls.name] = cls
    stopping.register(stopping.RuleInfo(name=cls.name, summary=cls.summary(), random_stopping=cls.random_stopping,
                                        settings=cls.setting_names(), build=cls.from_settings))
    return cls


register_rule(Poisson)
register_rule(TruncatedNegativeBinomial)
register_rule(Composed)


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
    """Every rule's standard variants at mean ``mean`` (composition at the rounded mean), in catalogue order."""
    return [rule for cls in STOPPING_RULES.values() for rule in cls.variants(mean)]


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
