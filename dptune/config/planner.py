"""The ``planner:`` section of a space: the verdict's priors ("is this search expected to pay"), measured on a public
proxy task, never on the private data; ``accounting.advise_transfer`` reads them."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dptune.errors import ConfigError, check_positive

__all__ = ["PlannerSpec", "with_planner_baseline"]


@dataclass(frozen=True)
class PlannerSpec:
    """The planner's priors for the verdict "is this search expected to pay" (``accounting.advise_transfer``),
    measured on a public proxy task, never on the private data: ``proxy`` names the task and the command that
    measured them. Without a ``planner:`` section the generic priors below apply (and the verdict says so).

    Attributes:
        proxy: The public proxy task the priors were measured on, and how.
        accuracy_spread: The std of accuracy across the space's configs.
        loss_per_noise_doubling: The accuracy lost when the final model's noise-to-signal doubles.
        min_gain: The proxy gain a search must promise to be run (0.005: half a point).
        baseline: The config a search must beat, trained once with the whole budget (e.g. the literature's
            default): its hyperparameters over the space's default. Null: the space's default.
        rehearsal: The search rehearsed on the public proxy against the baseline (``bench/proxy_priors.py
            --rehearse``): total ε -> mean test-accuracy gain (accuracy units). When given it is the verdict:
            expected to pay iff the gain at the target ε (linear in log ε between rehearsed points, the nearest
            point outside them) is above its standard error (``rehearsal_se``; above 0 without one).
        rehearsal_se: The rehearsed gain's standard error over the proxy seeds, per total ε (the same keys as
            ``rehearsal``; ``bench/rehearsal_sim.py`` prints it beside the gain). A gain within one standard error
            of 0 is not expected to pay: the proxy cannot tell it from no gain.
        rehearsal_of: The key (``accounting.rehearsal_key``) of the search that was rehearsed: a space whose
            search differs from it (another range, rule, share, baseline or a flag's override) is judged by the
            analytic model instead, and the verdict says so.
        kind_gain: Where no rehearsal of this search applies: the measured gain over the baseline of searches
            made by the same rules on the public proxy of this kind of data (``space: auto``: digits for small grey
            images, the public MNIST training images for other grey images), total ε -> accuracy units. The verdict
            then reads it as a rehearsal: expected to pay iff the gain at the target ε is above ``kind_gain_se``.
        kind_gain_se: Its standard error over the proxy seeds, per total ε (the same keys).
    """

    proxy: str = "none: generic priors"
    accuracy_spread: float = 0.10  # std of accuracy across the space's configs
    loss_per_noise_doubling: float = 0.15  # accuracy lost when the final model's noise-to-signal doubles
    min_gain: float = 0.005  # the proxy gain a search must promise to be run (half a point)
    # the config a search must beat, trained once with the whole budget (e.g. the literature's default): its
    # hyperparameters; None: the space's default
    baseline: dict[str, Any] | None = None
    rehearsal: dict[float, float] | None = None  # total ε -> the rehearsed gain (accuracy units)
    rehearsal_of: str | None = None  # accounting.rehearsal_key of the search rehearsed
    rehearsal_se: dict[float, float] | None = None  # total ε -> the rehearsed gain's std error over proxy seeds
    kind_gain: dict[float, float] | None = None  # total ε -> this kind of search's measured gain on its kind's proxy
    kind_gain_se: dict[float, float] | None = None  # total ε -> its std error over the proxy seeds

    def __post_init__(self) -> None:
        if (self.kind_gain is None) != (self.kind_gain_se is None):
            raise ConfigError("planner.kind_gain_se" if self.kind_gain_se is None else "planner.kind_gain",
                              "kind_gain and kind_gain_se come together", "give both (per total ε), or neither")
        if self.kind_gain is not None:
            self._gains("kind_gain", "give one per epsilon of planner.kind_gain")
        if self.rehearsal_se is not None and self.rehearsal is None:
            raise ConfigError("planner.rehearsal_se", "is given without planner.rehearsal",
                              "give the rehearsed gains (planner.rehearsal) it is the standard error of, or remove it")
        if self.rehearsal is not None:
            self._gains("rehearsal", "copy the std errors bench/rehearsal_sim.py printed beside the gains")
            if not isinstance(self.rehearsal_of, str) or not re.fullmatch(r"[0-9a-f]{16}", self.rehearsal_of):
                raise ConfigError("planner.rehearsal_of", f"{self.rehearsal_of!r} is not the rehearsed search's key",
                                  "copy the rehearsal_of line bench/proxy_priors.py --rehearse printed with it")
        if not isinstance(self.proxy, str) or not self.proxy.strip():
            raise ConfigError("planner.proxy", f"{self.proxy!r} is not a name", "name the public proxy task")
        for key in ("accuracy_spread", "loss_per_noise_doubling"):
            check_positive(f"planner.{key}", getattr(self, key), "give a prior measured on a public proxy task")
        if not (math.isfinite(self.min_gain) and self.min_gain >= 0):
            raise ConfigError("planner.min_gain", f"{self.min_gain!r} must be >= 0", "choose e.g. 0.005")


    def _gains(self, name: str, fix: str) -> None:
        """``planner.<name>`` and its ``<name>_se`` (where given) parsed: gains per total ε, one std error > 0 each."""
        gain = _rehearsal(getattr(self, name), f"planner.{name}")
        object.__setattr__(self, name, gain)
        if getattr(self, f"{name}_se") is not None:
            se = _rehearsal(getattr(self, f"{name}_se"), f"planner.{name}_se")
            if set(se) != set(gain) or any(v <= 0 for v in se.values()):
                raise ConfigError(f"planner.{name}_se", f"{getattr(self, f'{name}_se')!r} is not a standard error > 0 "
                                  f"for each epsilon {sorted(gain)}", fix)
            object.__setattr__(self, f"{name}_se", se)


def _rehearsal(raw: Mapping[Any, Any], field: str = "planner.rehearsal") -> dict[float, float]:
    if not isinstance(raw, Mapping):
        raise ConfigError(field, f"{raw!r} is not a mapping", "write {epsilon: value, ...}, e.g. {1: -0.012, 2: 0.008}")
    out = {}
    for key, value in raw.items():
        e = _number(key)
        if not (math.isfinite(e) and e > 0):
            raise ConfigError(field, f"key {key!r} is not a total epsilon > 0",
                              "write {epsilon: value, ...}, e.g. {1: -0.012, 2: 0.008}")
        g = float(value) if isinstance(value, int | float) and not isinstance(value, bool) else math.nan
        if not (math.isfinite(g) and -1 <= g <= 1):
            raise ConfigError(f"{field}.{key}", f"{value!r} is not in accuracy units (-1..1)",
                              "give what bench/rehearsal_sim.py printed in points / 100, e.g. 0.008")
        out[e] = g
    if not out:
        raise ConfigError(field, "is empty", "give {epsilon: value, ...} or remove it")
    return dict(sorted(out.items()))


def with_planner_baseline(planner: PlannerSpec, fields: Mapping[str, Any], coerce: Any) -> PlannerSpec:
    """``planner`` with its baseline's values coerced to the config's field types (``fields``: TrialConfig's)."""
    if planner.baseline is None:
        return planner
    for key in planner.baseline:
        if key not in fields or key in ("seed", "sampling_basis", "layer_clip"):
            raise ConfigError(f"planner.baseline.{key}", "is not a hyperparameter",
                              "use the hyperparameters of space: (e.g. learning_rate, batch_size)")
    return dataclasses.replace(planner, baseline={k: coerce(f"planner.baseline.{k}", v, fields[k].type)
                                                  for k, v in planner.baseline.items()})


def _number(key: Any) -> float:
    """A table's key as a total ε: a number, or its decimal string (the form JSON gives a released space's keys)."""
    if isinstance(key, int | float) and not isinstance(key, bool):
        return float(key)
    if isinstance(key, str):
        try:
            return float(key)
        except ValueError:
            return math.nan
    return math.nan
