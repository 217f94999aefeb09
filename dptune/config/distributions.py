"""Search-space distributions (Optuna's): parsing from YAML, and the values a distribution can take."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import optuna.distributions as od

from dptune.errors import ConfigError

__all__ = ["in_support", "parse_distribution", "sample_params", "support_extremes", "support_values"]

_DIST_KEYS = {"float": ("type", "low", "high", "log", "step"), "int": ("type", "low", "high", "log", "step"),
              "categorical": ("type", "choices")}


def parse_distribution(name: str, spec: Any) -> od.BaseDistribution:
    if isinstance(spec, list):
        spec = {"type": "categorical", "choices": spec}
    if not isinstance(spec, Mapping) or spec.get("type") not in _DIST_KEYS:
        raise ConfigError(name, f"{spec!r} is not a distribution",
                          "write {type: float|int, low: .., high: .., log: false} or {type: categorical, choices: [..]}")
    unknown = sorted(set(spec) - set(_DIST_KEYS[spec["type"]]))
    if unknown:
        raise ConfigError(f"{name}.{unknown[0]}", "unknown key", f"use: {', '.join(_DIST_KEYS[spec['type']])}")
    try:
        if spec["type"] == "categorical":
            choices = spec.get("choices")
            if not isinstance(choices, list) or not choices:
                raise ConfigError(f"{name}.choices", "must be a non-empty list", "list the values to try")
            return od.CategoricalDistribution(choices)
        if "low" not in spec or "high" not in spec:
            raise ConfigError(name, "needs low and high", "give both bounds")
        cls = od.FloatDistribution if spec["type"] == "float" else od.IntDistribution
        kwargs = {k: spec[k] for k in ("low", "high", "log", "step") if k in spec}
        if spec["type"] == "int" and kwargs.get("step") is None:
            kwargs["step"] = 1
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(name, str(e), "fix the distribution bounds (low <= high, low > 0 with log)") from e


def in_support(dist: od.BaseDistribution, value: Any) -> bool:
    if isinstance(dist, od.CategoricalDistribution):
        return any(value == c for c in dist.choices)
    try:
        return bool(dist._contains(dist.to_internal_repr(value)))
    except (ValueError, TypeError):
        return False


def support_extremes(dist: od.BaseDistribution) -> list[Any]:
    """Values that bound a distribution: choices of a categorical, the bounds of a range."""
    if isinstance(dist, od.CategoricalDistribution):
        return list(dist.choices)
    if isinstance(dist, od.FloatDistribution | od.IntDistribution):
        return [dist.low, dist.high]
    raise ConfigError("space", f"unsupported distribution {dist!r}", "use float, int or categorical")


def support_values(dist: od.BaseDistribution, limit: int = 4096) -> list[Any]:
    """Every value a finite distribution can take (categorical, int, stepped float)."""
    if isinstance(dist, od.CategoricalDistribution):
        return list(dist.choices)
    if isinstance(dist, od.IntDistribution):
        count = (dist.high - dist.low) // dist.step + 1
        if count > limit:
            raise ConfigError("space", f"int range {dist.low}..{dist.high} has {count} values",
                              f"use a step or categorical choices (at most {limit} values)")
        return list(range(dist.low, dist.high + 1, dist.step))
    if isinstance(dist, od.FloatDistribution) and dist.step is not None:
        count = int(round((dist.high - dist.low) / dist.step)) + 1
        return [dist.low + i * dist.step for i in range(count)]
    raise ConfigError("space", f"{dist!r} is continuous", "only finite distributions can be enumerated")


def sample_params(space: dict[str, od.BaseDistribution], rng: np.random.Generator) -> dict[str, Any]:
    """One i.i.d. draw from the space's distributions (data-independent random search)."""
    out: dict[str, Any] = {}
    for name in sorted(space):
        d = space[name]
        if isinstance(d, od.CategoricalDistribution):
            out[name] = d.choices[int(rng.integers(len(d.choices)))]
        elif isinstance(d, od.IntDistribution):
            if d.log:  # floor(exp(U[log low, log(high + 1)))): every value of low..high, log-uniformly
                v = math.floor(math.exp(rng.uniform(math.log(d.low), math.log(d.high + 1))))
                out[name] = int(min(max(v, d.low), d.high))
            else:
                out[name] = int(d.low + d.step * rng.integers((d.high - d.low) // d.step + 1))
        elif isinstance(d, od.FloatDistribution):
            if d.step is not None:
                out[name] = float(d.low + d.step * rng.integers(int(round((d.high - d.low) / d.step)) + 1))
            elif d.log:
                out[name] = float(math.exp(rng.uniform(math.log(d.low), math.log(d.high))))
            else:
                out[name] = float(rng.uniform(d.low, d.high))
        else:  # pragma: no cover - config validation admits only these
            raise TypeError(f"unsupported distribution {d!r}")
    return out
