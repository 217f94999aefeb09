"""The clipping modes: one registry of what each mode is and what it costs (config layer: no torch).

Every list of clipping names (``fixed.clipping``'s check, error messages, the engines ``dpsgd`` builds) and every
question the rest of the code asks about a mode comes from here:

* ``sensitivity``: how far one example can move what the noise is added to, in units of the clip norm C. The
  accountant charges a step that adds N(0, (σ·C)²) as a Poisson-subsampled Gaussian at σ / sensitivity (planner
  points, the trial's charge check from the mode that runs, final training's calibration, σ floors);
* ``per_example``: the mode clips each example's own gradient (the clipping guard checks it against each example
  alone); otherwise only its own invariant holds, and BatchNorm may train;
* ``accumulates``: a logical Poisson batch may be split into physical chunks before the one noised step;
* ``layerwise``: the mode clips layer by layer to per-layer norms computed from public data (``alc:``).

A new mode = its engine (an ``Engine`` subclass in ``dptune/dpsgd/`` registered with ``@engine("name")``, which
checks it implements the interface) and one ``register(ClippingMode(...))`` line below (docs/adding-a-clipping-mode.md);
``tests/test_registry_contracts.py`` holds every registered mode to the same contract (its engine, proven by the
clipping guard, documented).
"""

from __future__ import annotations

from dataclasses import dataclass

from dptune.errors import ConfigError

__all__ = ["AUTO", "MODES", "ClippingMode", "choices", "mode", "register", "sensitivity"]

AUTO = "auto"  # the fastest mode proven exact for the model (dpsgd.resolve_clipping): always a per-example mode


@dataclass(frozen=True)
class ClippingMode:
    name: str
    summary: str
    sensitivity: float = 1.0
    per_example: bool = True
    accumulates: bool = True
    layerwise: bool = False


MODES: dict[str, ClippingMode] = {}


def register(m: ClippingMode) -> ClippingMode:
    if m.name in MODES or m.name == AUTO:
        raise ValueError(f"clipping mode {m.name!r} is registered twice")
    if not m.sensitivity >= 1:
        raise ValueError(f"clipping mode {m.name!r}: sensitivity {m.sensitivity} < 1 C is not a clipping bound")
    MODES[m.name] = m
    return m


def choices() -> tuple[str, ...]:
    """Every value ``fixed.clipping`` accepts."""
    return (AUTO, *MODES)


def mode(name: str) -> ClippingMode:
    """The registered mode ``name`` (``auto`` resolves to a per-example mode: its properties are per-example
    clipping's); ConfigError naming ``clipping`` otherwise."""
    if name == AUTO:
        return ClippingMode(AUTO, "the fastest exact per-example mode")
    if name not in MODES:
        raise ConfigError("clipping", f"unknown clipping mode {name!r}", f"use one of: {', '.join(choices())}")
    return MODES[name]


def sensitivity(name: str) -> float:
    """How far one example moves what a step's noise is added to, in units of C (see the module docstring)."""
    return mode(name).sensitivity


register(ClippingMode("bookkeeping", "dptune's book-keeping (Bu et al. 2023): per-layer norms, one backward"))
register(ClippingMode("hooks", "Opacus' per-layer grad_sample hooks"))
register(ClippingMode("functorch", "whole-model vmap(grad): each example alone, exact for any per-example model"))
register(ClippingMode("ghost", "Opacus' ghost clipping (norms, then a second backward)", accumulates=False))
# van Dijk et al. 2023 (arXiv 2307.11939): the batch's mean gradient clipped to C; one example moves it by up to 2C
register(ClippingMode("batch", "batch clipping: the batch's mean gradient clipped to C (BatchNorm trains)",
                      sensitivity=2.0, per_example=False, accumulates=False))
register(ClippingMode("alc", "adaptive layerwise clipping: each layer to its C_l from public data, sqrt(sum C_l^2) = C",
                      layerwise=True))
