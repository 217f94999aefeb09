"""The stopping-rule registry (config layer): each rule's name, its own settings, and the accounting it implies.

A rule itself — its search event, its RDP, its draw of K — is a ``dptune.accounting`` ``StoppingRule``
subclass whose dataclass fields are its settings; ``dptune.accounting`` registers each one here once
(``register_rule``; importing ``dptune`` imports it). So a space's ``privacy.stopping`` — a name with the settings
beside it (``stopping: tnb``, ``mean: 3``, ``eta: 0``) or a mapping (``stopping: {rule: tnb, mean: 3, eta: 0}``) —
is checked by the rule itself, and ``search.accounting`` follows from the rule instead of being a second key:
``random_stopping`` for a rule whose K is random (Papernot–Steinke), ``composed`` for one that charges every
trial by composition. A new rule with its own setting is its class plus one ``register_rule`` line.

Registration checks what can be checked before any charge (``check``; ``register_rule`` adds the checks that need
the rule's events): a name registered once, ``mean`` first, and no setting a certificate must not carry — a
certificate records the rule's settings, and a name that reads as the drawn number of trials (``k``,
``trials_run``; ``reveals_k``) would be refused there, after the trials had run and the charge was reserved.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from dptune.errors import ConfigError

__all__ = ["REVEALING_NAMES", "RuleInfo", "accounting_of", "check", "choices", "register", "reveals_k", "rule_info",
           "setting_names"]

# keys a certificate (its ``stopping`` record and ``details``) must not have: each would read as the drawn K
REVEALING_NAMES = frozenset({"k", "num_trials_drawn", "trials_drawn", "trials_run"})


def reveals_k(key: str) -> bool:
    """Whether a certificate key would read as the drawn number of trials (case-insensitive: ``K`` too)."""
    return key.casefold() in REVEALING_NAMES


@dataclass(frozen=True)
class RuleInfo:
    """``settings``: the rule's own settings (``mean`` first); ``random_stopping``: K random, charged by the
    Papernot–Steinke theorem (valid for non-adaptive search only); ``build``: the rule from its settings (it
    checks them, ConfigError naming ``privacy.<setting>``)."""

    name: str
    summary: str
    random_stopping: bool
    settings: tuple[str, ...]
    build: Callable[[Mapping[str, Any]], Any]
    mode: str = ""  # the accounting it implies when neither of the two below (the RDP filter: ``filter``)

    @property
    def accounting(self) -> str:
        return self.mode or ("random_stopping" if self.random_stopping else "composed")


_RULES: dict[str, RuleInfo] = {}


def check(info: RuleInfo) -> None:
    """What the config layer can check of a rule before it is registered; ValueError naming the rule otherwise."""
    if not isinstance(info.name, str) or not info.name.isidentifier():
        raise ValueError(f"stopping rule name {info.name!r} is not an identifier")
    if info.name in _RULES:
        raise ValueError(f"stopping rule {info.name!r} is registered twice")
    if info.settings[:1] != ("mean",):
        raise ValueError(f"stopping rule {info.name!r}: its first setting must be mean, not {info.settings[:1]}")
    for s in info.settings:
        if not isinstance(s, str) or not s.isidentifier() or s == "rule":
            raise ValueError(f"stopping rule {info.name!r}: setting {s!r} cannot be a key of privacy.stopping")
        if reveals_k(s):
            raise ValueError(f"stopping rule {info.name!r}: setting {s!r} would read as the drawn number of trials, "
                             "which a certificate must not carry (it records the rule's settings): rename it")


def register(info: RuleInfo) -> None:
    check(info)
    _RULES[info.name] = info


def choices() -> tuple[str, ...]:
    return tuple(_RULES)


def setting_names() -> tuple[str, ...]:
    """Every registered rule's settings (a flat ``privacy.<setting>`` key of an older space file)."""
    return tuple(dict.fromkeys(s for info in _RULES.values() for s in info.settings))


def rule_info(name: Any) -> RuleInfo:
    info = _RULES.get(name) if isinstance(name, str) else None
    if info is None:
        raise ConfigError("privacy.stopping", f"unknown stopping rule {name!r}", f"use one of: {', '.join(_RULES)}")
    return info


def accounting_of(name: str) -> str:
    """The accounting a rule implies: ``random_stopping`` or ``composed``."""
    return rule_info(name).accounting
