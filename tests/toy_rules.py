"""Stopping rules written the way docs/adding-a-stopping-rule.md says, for the registry tests (not registered here:
each test registers what it needs, in a fresh interpreter or with ``registered``, since the registry is global)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from dp_accounting import dp_event as de

from dptune.accounting._rules import Poisson, StoppingRule
from dptune.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class Rounds(Poisson):
    """``rounds`` independent Poisson(mean) searches, each charged by Papernot-Steinke Thm. 6 and composed."""

    name: ClassVar[str] = "rounds"
    rounds: float = 1.0  # a setting of its own (settings are read as floats)

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.rounds, bool) or self.rounds != int(self.rounds) or self.rounds < 1:
            raise ConfigError("privacy.rounds", f"{self.rounds!r} is not a whole number >= 1", "choose rounds >= 1")

    @classmethod
    def variants(cls, mean: float) -> tuple[StoppingRule, ...]:
        return (cls(mean=mean),)

    @classmethod
    def from_search_event(cls, event: de.DpEvent) -> tuple[de.DpEvent, StoppingRule] | None:
        if not (isinstance(event, de.ComposedDpEvent) and event.events):
            return None
        first = event.events[0]
        if not (isinstance(first, de.RepeatAndSelectDpEvent) and math.isinf(first.shape)
                and all(e == first for e in event.events)):
            return None
        return first.event, cls(mean=float(first.mean), rounds=float(len(event.events)))

    def search_event(self, trial_event: de.DpEvent) -> de.DpEvent:
        return de.ComposedDpEvent([de.RepeatAndSelectDpEvent(trial_event, float(self.mean), math.inf)]
                                  * int(self.rounds))

    def search_rdp(self, trial_rdp: np.ndarray) -> np.ndarray:
        return int(self.rounds) * super().search_rdp(trial_rdp)

    def draw_k(self, rng: np.random.Generator) -> int:
        return sum(int(rng.poisson(self.mean)) for _ in range(int(self.rounds)))

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "rounds": float(self.rounds)}

    def label(self) -> str:
        return f"rounds(rounds={self.rounds:g}, mean={self.mean:g})"

    def family(self) -> str:
        return f"{self.rounds:g} Poisson rounds"


@contextlib.contextmanager
def registered(*names: str) -> Iterator[None]:
    """Afterwards, the registries hold what they held before (a test registers a rule or tries to)."""
    from dptune.accounting import _catalogue
    from dptune.config import stopping

    try:
        yield
    finally:
        for name in names:
            _catalogue._RULES.pop(name, None)
            stopping._RULES.pop(name, None)
