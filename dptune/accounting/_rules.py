"""Stopping rules: how many trials K a search runs, and what the whole search then costs.

One documented base, :class:`StoppingRule` (the shape of Optuna's ``BaseSampler``), and one subclass per
rule; ``_catalogue`` chooses among them by name. Each rule owns everything that depends on it:

* ``search_event(trial)``: the whole search as one event (what the ledger and the certificate store), and
  its inverse ``from_search_event(event)`` → (trial event, rule), or None when the event is not its kind;
* ``search_rdp(trial_rdp)``: the same charge on RDP curves, vectorised over a batch of per-trial curves
  (``search_rdp(rdp_of(t)) == rdp_of(search_event(t))``, which the tests check for every rule);
* ``draw_k(rng)``: K from exactly the distribution the theorem assumes (drawn once per search, never capped);
* ``describe()``: the public description for certificates — the distribution, never the drawn K;
* ``label()`` (one rule) and ``family()`` (the rule without its mean, for legends).

A rule's dataclass fields are its settings (``mean`` and its own, e.g. TNB's ``eta``), read from a space's
``privacy.stopping`` by the generic :meth:`StoppingRule.from_settings` and checked by the rule's
``__post_init__`` alone. A new rule is a subclass here plus one ``register_rule`` line in ``_catalogue``.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from dp_accounting import dp_event as de

from dptune.accounting._convert import ORDERS
from dptune.accounting._events import FILTER_SLACK, RdpFilterDpEvent
from dptune.accounting._stopping import draw_tnb, random_stopping_rdp, tnb_gamma
from dptune.errors import ConfigError

__all__ = ["Composed", "Filter", "Poisson", "StoppingRule", "TruncatedNegativeBinomial"]


@dataclass(frozen=True, kw_only=True)
class StoppingRule(abc.ABC):
    """How many trials a search runs, and the charge of the whole search. Construct rules through
    ``dptune.accounting.stopping_rule(name, mean=…, eta=…)``; the fields are the rule's privacy settings."""

    name: ClassVar[str]  # the catalogue key (``privacy.stopping`` of a search space) and describe()["rule"]
    random_stopping: ClassVar[bool]  # K random (Papernot-Steinke): valid for non-adaptive search only
    accounting: ClassVar[str] = ""  # the accounting mode it implies, when not random_stopping/composed
    mean: float  # E[K], or the fixed number of trials

    def __post_init__(self) -> None:
        m = self.mean
        if isinstance(m, bool) or not isinstance(m, int | float) or not math.isfinite(m) or m < 1:
            raise ConfigError("privacy.mean", f"{m!r} is < 1", "choose a mean number of trials >= 1")

    @classmethod
    def setting_names(cls) -> tuple[str, ...]:
        """The rule's settings: its dataclass fields (``mean`` first)."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.init)

    @classmethod
    def summary(cls) -> str:
        return (cls.__doc__ or cls.name).strip().splitlines()[0]

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> StoppingRule:
        """The rule from a space's settings for it; a setting it does not have is refused, naming it. The values
        are checked by the rule itself (``__post_init__``: ConfigError naming ``privacy.<setting>``)."""
        names = cls.setting_names()
        unknown = sorted(set(settings) - set(names))
        if unknown:
            raise ConfigError(f"privacy.stopping.{unknown[0]}", f"the {cls.name} rule has no setting {unknown[0]!r}",
                              f"give only its settings: {', '.join(names)}")
        if "mean" not in settings:
            raise ConfigError("privacy.mean", f"the {cls.name} rule needs a mean", "set privacy.mean, e.g. 3")
        return cls(**settings)

    @classmethod
    @abc.abstractmethod
    def variants(cls, mean: float) -> tuple[StoppingRule, ...]:
        """The instances of this rule priced side by side with others at mean ``mean``."""

    @classmethod
    @abc.abstractmethod
    def from_search_event(cls, event: de.DpEvent) -> tuple[de.DpEvent, StoppingRule] | None:
        """Inverse of :meth:`search_event`: (trial event, rule), or None if ``event`` is not this rule's."""

    @abc.abstractmethod
    def search_event(self, trial_event: de.DpEvent) -> de.DpEvent:
        """The whole search of trials ``trial_event`` as one event."""

    @abc.abstractmethod
    def search_rdp(self, trial_rdp: np.ndarray) -> np.ndarray:
        """RDP of the whole search at ``ORDERS`` from per-trial curves ``[..., len(ORDERS)]`` (a batch)."""

    @abc.abstractmethod
    def draw_k(self, rng: np.random.Generator) -> int:
        """K from exactly the distribution the theorem assumes. Called once per search; never redrawn."""

    @abc.abstractmethod
    def label(self) -> str:
        """Short name of this rule with its settings, e.g. ``poisson(mean=3)``."""

    @abc.abstractmethod
    def family(self) -> str:
        """This rule without its mean (legend of a plot against the mean)."""

    def describe(self) -> dict[str, Any]:
        """Public description (goes into certificates): the distribution, never the drawn K."""
        return {"rule": self.name, "mean": float(self.mean)}


@dataclass(frozen=True, kw_only=True)
class Poisson(StoppingRule):
    """K ~ Poisson(mean), K ≥ 0 (K = 0 releases the default config): Papernot & Steinke Thm. 6."""

    name: ClassVar[str] = "poisson"
    random_stopping: ClassVar[bool] = True


    @classmethod
    def variants(cls, mean: float) -> tuple[StoppingRule, ...]:
        return (cls(mean=mean),)

    @classmethod
    def from_search_event(cls, event: de.DpEvent) -> tuple[de.DpEvent, StoppingRule] | None:
        if isinstance(event, de.RepeatAndSelectDpEvent) and math.isinf(event.shape):
            return event.event, cls(mean=float(event.mean))
        return None

    def search_event(self, trial_event: de.DpEvent) -> de.DpEvent:
        return de.RepeatAndSelectDpEvent(trial_event, float(self.mean), math.inf)

    def search_rdp(self, trial_rdp: np.ndarray) -> np.ndarray:
        return random_stopping_rdp(ORDERS, trial_rdp, mean=self.mean, shape=math.inf)

    def draw_k(self, rng: np.random.Generator) -> int:
        return int(rng.poisson(self.mean))

    def label(self) -> str:
        return f"poisson(mean={self.mean:g})"

    def family(self) -> str:
        return "Poisson"


@dataclass(frozen=True, kw_only=True)
class TruncatedNegativeBinomial(StoppingRule):
    """K ~ TNB(eta, γ) with E[K] = mean, K ≥ 1 (eta 0: logarithmic, 1: geometric): Papernot & Steinke Thm. 2."""

    name: ClassVar[str] = "tnb"
    random_stopping: ClassVar[bool] = True
    eta: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.eta, bool) or not isinstance(self.eta, int | float) or not (
                math.isfinite(self.eta) and self.eta >= 0):
            raise ConfigError("privacy.eta", f"{self.eta!r} is negative",
                              "choose eta >= 0 (0 logarithmic, 1 geometric)")


    @classmethod
    def variants(cls, mean: float) -> tuple[StoppingRule, ...]:
        return (cls(mean=mean, eta=0.0), cls(mean=mean, eta=1.0))

    @classmethod
    def from_search_event(cls, event: de.DpEvent) -> tuple[de.DpEvent, StoppingRule] | None:
        if isinstance(event, de.RepeatAndSelectDpEvent) and math.isfinite(event.shape):
            return event.event, cls(mean=float(event.mean), eta=float(event.shape))
        return None

    @property
    def gamma(self) -> float:
        return tnb_gamma(mean=self.mean, eta=self.eta)

    def search_event(self, trial_event: de.DpEvent) -> de.DpEvent:
        return de.RepeatAndSelectDpEvent(trial_event, float(self.mean), float(self.eta))

    def search_rdp(self, trial_rdp: np.ndarray) -> np.ndarray:
        return random_stopping_rdp(ORDERS, trial_rdp, mean=self.mean, shape=self.eta)

    def draw_k(self, rng: np.random.Generator) -> int:
        return draw_tnb(float(rng.random()), gamma=self.gamma, eta=self.eta)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "eta": float(self.eta), "gamma": self.gamma}

    def label(self) -> str:
        return f"{self._kind()}(eta={self.eta:g}, mean={self.mean:g})"

    def family(self) -> str:
        kind = self._kind()
        return f"TNB η={self.eta:g}" + ("" if kind == "tnb" else f" ({kind})")

    def _kind(self) -> str:
        return {0.0: "logarithmic", 1.0: "geometric"}.get(float(self.eta), "tnb")


@dataclass(frozen=True, kw_only=True)
class Composed(StoppingRule):
    """Exactly ``mean`` trials, every one charged (adaptive RDP composition): valid for adaptive search."""

    name: ClassVar[str] = "composed"
    random_stopping: ClassVar[bool] = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mean != int(self.mean):
            raise ConfigError("privacy.mean", f"{self.mean!r} is not a whole number of trials",
                              "composed accounting runs a fixed number of trials")


    @classmethod
    def variants(cls, mean: float) -> tuple[StoppingRule, ...]:
        return (cls(mean=max(1, round(mean))),)  # composition needs a whole number of trials

    @classmethod
    def from_search_event(cls, event: de.DpEvent) -> tuple[de.DpEvent, StoppingRule] | None:
        if isinstance(event, de.SelfComposedDpEvent):
            return event.event, cls(mean=float(event.count))
        return None

    def search_event(self, trial_event: de.DpEvent) -> de.DpEvent:
        return de.SelfComposedDpEvent(trial_event, int(self.mean))

    def search_rdp(self, trial_rdp: np.ndarray) -> np.ndarray:
        return int(self.mean) * np.asarray(trial_rdp, dtype=np.float64)

    def draw_k(self, rng: np.random.Generator) -> int:
        return int(self.mean)

    def label(self) -> str:
        return f"composed({int(self.mean)} trials)"

    def family(self) -> str:
        return "composition (K fixed, every trial charged)"


@dataclass(frozen=True, kw_only=True)
class Filter(StoppingRule):
    """An RDP filter of ``mean`` full-length trials' worth: ASHA's rung segments run while they fit (fully adaptive)."""

    name: ClassVar[str] = "filter"
    random_stopping: ClassVar[bool] = False
    accounting: ClassVar[str] = "filter"  # not composed: the trials are not fixed in advance, their segments are admitted
    max_configs: int = 0  # the most configurations the sealed draw prepares (0: 27 per full trial's worth)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mean != int(self.mean):
            raise ConfigError("privacy.mean", f"{self.mean!r} is not a whole number of full trials",
                              "give the filter's bound as a whole number of full-length trials")
        if isinstance(self.max_configs, bool) or not isinstance(self.max_configs, int) or self.max_configs < 0:
            raise ConfigError("privacy.max_configs", f"{self.max_configs!r} is not a whole number >= 0",
                              "give the most configurations to draw, or 0 for 27 per full trial's worth")

    @classmethod
    def variants(cls, mean: float) -> tuple[StoppingRule, ...]:
        return (cls(mean=max(1, round(mean))),)

    @classmethod
    def from_search_event(cls, event: de.DpEvent) -> tuple[de.DpEvent, StoppingRule] | None:
        if isinstance(event, RdpFilterDpEvent) and isinstance(event.budget, de.SelfComposedDpEvent):
            return event.budget.event, cls(mean=float(event.budget.count))
        return None

    def search_event(self, trial_event: de.DpEvent) -> de.DpEvent:
        """The filter's bound: the RDP curve of ``mean`` full-length worst-case trials (every rung's score released),
        which the admitted segments' curves never exceed at any order."""
        return RdpFilterDpEvent(de.SelfComposedDpEvent(trial_event, int(math.ceil(self.mean))))

    def search_rdp(self, trial_rdp: np.ndarray) -> np.ndarray:
        return int(math.ceil(self.mean)) * np.asarray(trial_rdp, dtype=np.float64) * (1 + FILTER_SLACK)

    def draw_k(self, rng: np.random.Generator) -> int:
        """Not a number of trials (the filter decides how many run, curator-side): the configurations drawn."""
        return self.max_configs or 27 * int(math.ceil(self.mean))

    def describe(self) -> dict[str, Any]:
        return {"rule": self.name, "mean": float(self.mean), "full_trials_worth": int(math.ceil(self.mean)),
                "orders": [float(a) for a in ORDERS],
                "accounting": "RDP filter (Feldman & Zrnic 2021, Thm. 3.1): rung segments and rung scores admitted "
                              "while their RDP sum stays within the bound at every order; converted from RDP only"}

    def label(self) -> str:
        return f"filter({self.mean:g} full trials)"

    def family(self) -> str:
        return "RDP filter (ASHA)"
