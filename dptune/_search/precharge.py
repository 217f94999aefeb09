"""What a search checks before anything is charged, beside the space's own rules: every model and clipping engine
it can run (``dpsgd.validate_model`` and its clipping guard), and — for a search that plans its final run — the
planner's verdict, priced with priors from the space's public proxy task."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dptune.accounting import Plan, TransferPlan, advise_transfer
from dptune.config import SearchSpace
from dptune.errors import ConfigError

__all__ = ["validate_models", "verdict"]


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
            # batch sizes only decide between ghost and hooks (B + 4 sqrt(B) vs the physical batch): extremes
            options[key] = [min(values), max(values)] if key in ("batch_size", "physical_batch_size") else values
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
        raise ConfigError("--tune-anyway", "the planner does not expect this search to beat training the baseline "
                          "config (planner.baseline, else the default) once with the whole budget (see its verdict "
                          "above); nothing was charged",
                          "raise privacy.target_epsilon, widen privacy.search_share or the space, or pass "
                          "--tune-anyway (API: tune_anyway=True) to search anyway")
    say("  --tune-anyway: searching although the planner does not expect it to pay")
