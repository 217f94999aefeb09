"""What a search checks before anything is charged, beside the space's own rules: every model and clipping engine
it can run (``dpsgd.validate_model`` and its clipping guard), and — for a search that plans its final run — the
planner's verdict, priced with priors from the space's public proxy task. Adaptive layerwise clipping's per-layer
clip norms are computed here too, from the space's public data only (``with_layer_clip``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dptune.accounting import Plan, TransferPlan, advise_transfer
from dptune.config import SearchSpace
from dptune.errors import ConfigError

__all__ = ["check_public", "validate_models", "verdict", "with_layer_clip"]


def validate_models(space: SearchSpace, data: Any) -> tuple[str, ...]:
    """Every model and clipping engine the space can run (each searched value of the keys that change them)
    passes ``dpsgd.validate_model`` and its clipping guard: a bad model is exit 2 before anything is charged,
    not a crashed or under-clipped trial inside a charged search. Returns the guard's notes (auto fallbacks)."""
    import itertools

    from dptune.config import support_values
    from dptune.dpsgd import validate_model

    options: dict[str, list[Any]] = {}
    for key in _ENGINE_KEYS:
        if key in space.space:
            values = sorted(set(support_values(space.space[key])), key=str)
            # batch sizes decide the physical batch the guard probes at (and ghost vs hooks): every value of a short
            # list, the extremes of a long range (every trial start probes its own batch again)
            if key in ("batch_size", "physical_batch_size") and len(values) > 16:
                values = [min(values), max(values)]
            options[key] = values
    notes: list[str] = []
    for combo in itertools.product(*options.values()):
        _, note = validate_model(space.fixed.replace(**dict(zip(options, combo, strict=True))),
                                 data.num_classes, data.input_shape)
        if note is not None and note not in notes:
            notes.append(note)
    return tuple(notes)


_ENGINE_KEYS = ("model", "groups", "scale_norm", "fix_batchnorm", "clipping", "augmult", "optimizer",
                "batch_size", "physical_batch_size")


def verdict(space: SearchSpace, n_train: int, n_val: int, planned: tuple[Plan, TransferPlan], *, tune_anyway: bool,
            say: Callable[[str], None]) -> None:
    """A search that plans its final run is priced before anything is charged (priors from the space's public
    proxy, never from this data); one not expected to pay is refused (exit 2) unless the user tunes anyway."""
    a = advise_transfer(space, n_train, n_val=n_val, planned=planned)
    say(f"  planner (priors from {space.planner.proxy}): {a.verdict}")
    if a.pays:
        return
    if not tune_anyway:
        measured = (f"its public proxy measured {100 * a.rehearsed:+.2f} points (std error "
                    f"{100 * (a.rehearsed_se or 0.0):.2f}) for this search over the baseline: the accuracy refusing "
                    "gives up, within the proxy's noise" if a.rehearsed is not None else
                    f"its analytic proxy says {100 * a.proxy:+.2f} points, under the {100 * a.min_gain:.2f} it asks for")
        raise ConfigError("--tune-anyway", "the planner does not expect this search to beat training the baseline "
                          f"config (planner.baseline, else the default) once with the whole budget: {measured} (its "
                          "verdict above); nothing was charged",
                          ("raise --target-epsilon (a derived space's rules are fixed: space: auto)" if space.auto
                           else "raise privacy.target_epsilon, widen privacy.search_share or the space")
                          + ", or pass --tune-anyway (API: tune_anyway=True) to search anyway")
    say("  --tune-anyway: searching although the planner does not expect it to pay")


def with_layer_clip(space: SearchSpace, data: Any) -> SearchSpace:
    """``space`` with every config's per-layer clip norms (``TrialConfig.layer_clip``) computed from its public
    data (``alc:``), resized to the private data's input shape: a function of the public data and the model's
    seed-0 initialisation only. The private ``data`` gives its shape and class count, both public by declaration
    (the space's dataset and model are built for them)."""
    import dataclasses

    from dptune.dpsgd import layer_constants, public_examples

    assert space.alc is not None
    public = public_examples(space.alc.public, tuple(data.input_shape))
    clip = layer_constants(space.fixed, public, data.num_classes, space.alc.quantile, space.alc.examples)
    return dataclasses.replace(space, fixed=space.fixed.replace(layer_clip=clip),
                               default=space.default.replace(layer_clip=clip))


def check_public(space: SearchSpace, ledger: Any) -> None:
    """A dataset declared public for alc holds no record of any budgeted dataset, by the ledger's test of what a
    dataset is (its records' content, whatever their ids or format; record ids within it): otherwise its per-layer
    norms would be an un-noised statistic of private data. Refused before anything is charged."""
    from dptune.data import load_dataset
    from dptune.ledger import budget_match

    assert space.alc is not None
    public = load_dataset(space.alc.public)
    found = budget_match(ledger, public, public.pool_fingerprint())
    if found.overlapped:
        raise ConfigError("alc.public", "holds records of a budgeted dataset (" + "; ".join(
            ledger.label(k) for k in found.overlapped) + ", known by their content whatever their format or "
            "edits): it is not public; nothing was charged",
            "declare a dataset that no budget covers as alc.public")


def ledger_warnings(location: Any) -> list[str]:
    """Before anything is charged: a ledger that is a local file on a node the Ray cluster launcher created
    (``ray up`` leaves ``~/ray_bootstrap_config.yaml`` on the head) is deleted with the node by ``ray down``, and
    every budget and charge in it with it: the team's database outlives the cluster."""
    from pathlib import Path

    if location.is_postgres or not (Path.home() / "ray_bootstrap_config.yaml").exists():
        return []
    return [f"  WARNING: the ledger {location} is a file on a node that `ray up` created: `ray down` deletes it, and "
            "with it every budget and charge (the next search would find no spend). Point searches at the team "
            "ledger: export DPTUNE_LEDGER=postgresql://USER@HOST:PORT/DB (from a secret; docs/operations.md, "
            "\"A team ledger\"), or pass --ledger postgresql://..."]
