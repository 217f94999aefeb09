"""The catalogue of stopping rules: the one place that names them (``privacy.stopping`` of a search space).

Everything that chooses, lists or recognises rules goes through here — the planner, the advice, the plan
CLI, plots and reports — so a new rule is its subclass in ``_rules`` plus one entry in ``STOPPING_RULES``.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from dp_accounting import dp_event as de

from dptune.accounting._rules import Composed, Poisson, StoppingRule, TruncatedNegativeBinomial
from dptune.errors import ConfigError

__all__ = ["STOPPING_RULES", "alternative_rules", "comparison_rules", "rule_of_search_event", "stopping_rule"]

STOPPING_RULES: Mapping[str, type[StoppingRule]] = MappingProxyType(
    {cls.name: cls for cls in (Poisson, TruncatedNegativeBinomial, Composed)}
)


def stopping_rule(name: str, *, mean: float, eta: float = 1.0) -> StoppingRule:
    """The rule called ``name`` with E[K] (or the number of trials) ``mean`` and TNB shape ``eta``.

    Raises :class:`ConfigError` naming the field (``privacy.stopping``, ``privacy.mean``, ``privacy.eta``).
    """
    cls = STOPPING_RULES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ConfigError("privacy.stopping", f"unknown stopping rule {name!r}",
                          f"use one of: {', '.join(STOPPING_RULES)}")
    return cls.from_settings(mean=mean, eta=eta)


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
