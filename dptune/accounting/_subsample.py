"""Tuning on a Poisson subsample of the training data, and moving the result to the full data.

Koskela & Kulkarni, "Practical Differentially Private Hyperparameter Tuning with Subsampling" (NeurIPS 2023,
arXiv:2301.11989), Sec. 3: the search runs on a tuning set X₁ drawn from the training data by Poisson
subsampling with rate f (each example kept independently w.p. f, drawn once, kept secret); its RDP follows
from the RDP of the tuning algorithm *on X₁* by Zhu & Wang's amplification (2019, Thm. 6; ``_amplify``), which
needs only the RDP curve of the whole random-stopping search.

Two details that make the charge an upper bound of what dptune runs:

* **Which data the search touches.** dptune's trials score on the full (private) validation split, which is
  *not* subsampled. A neighbour differs in one example, either in the training split — then the validation
  split is fixed and the whole search is a mechanism of X₁ (amplified) — or in the validation split — then
  every trial's training is identically distributed on both sides and only the score releases differ: the
  random-stopping transform of the score-only trial curve, not amplified. The search is charged at the
  maximum of the two (:func:`subsampled_search_event`; :func:`search_parts` is its inverse).
* **Sampling rate inside X₁.** |X₁| ~ Binomial(n, f) is random and data-dependent; the trainer samples
  batches with the data-independent rate q = B / (f·n) and runs T = ⌈epochs·f·n / B⌉ steps — ``dptune.config.params``
  with ``basis = f·n``, as the planner charges (``reachable_points(..., tune_fraction=f)``) — not B/|X₁|, so
  that M's RDP curve holds on every X₁ and the amplification theorem applies exactly, with no extra δ.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dp_accounting import dp_event as de

from dptune.accounting._amplify import check_fraction
from dptune.accounting._catalogue import rule_of_search_event
from dptune.accounting._events import SubsampledMechanismDpEvent, WorstCaseDpEvent, split_selection
from dptune.accounting._rules import StoppingRule
from dptune.errors import ConfigError

__all__ = ["min_subsample_size", "search_parts", "subsampled_search_event", "transfer_config", "validation_part"]


def validation_part(event: de.DpEvent) -> de.DpEvent:
    """The part of a dptune search event that reads the validation split: its score releases.

    dptune's convention (``trial_event``): the Poisson-sampled Gaussians are DP-SGD on the training split;
    a bare Gaussian is the validation correct-count. Training parts become no-ops; the structure (worst
    case, composition, random stopping) is kept, so the result is the search's cost for a neighbour that
    differs in the validation split.
    """
    if isinstance(event, de.NoOpDpEvent | de.PoissonSampledDpEvent):
        return de.NoOpDpEvent()
    if isinstance(event, de.GaussianDpEvent):
        return event
    if isinstance(event, de.SelfComposedDpEvent):
        inner = validation_part(event.event)
        return inner if isinstance(inner, de.NoOpDpEvent) else de.SelfComposedDpEvent(inner, event.count)
    if isinstance(event, de.ComposedDpEvent):
        parts = [p for p in (validation_part(e) for e in event.events) if not isinstance(p, de.NoOpDpEvent)]
        return de.NoOpDpEvent() if not parts else parts[0] if len(parts) == 1 else de.ComposedDpEvent(parts)
    if isinstance(event, WorstCaseDpEvent):
        uniq = list(dict.fromkeys(validation_part(e) for e in event.events))
        return uniq[0] if len(uniq) == 1 else WorstCaseDpEvent(tuple(uniq))
    if isinstance(event, de.RepeatAndSelectDpEvent):
        inner = validation_part(event.event)
        if isinstance(inner, de.NoOpDpEvent):
            return inner
        return de.RepeatAndSelectDpEvent(inner, event.mean, event.shape)
    raise TypeError(f"cannot split {type(event).__name__} into training and validation parts")


def subsampled_search_event(search_event: de.DpEvent, *, fraction: float) -> de.DpEvent:
    """The whole search run on a Poisson subsample of the training split (rate ``fraction``).

    Worst case over where the differing example lies (module docstring): the amplified search for a
    training-split neighbour, the unamplified score releases for a validation-split neighbour.
    ``fraction = 1`` returns ``search_event`` itself.
    """
    f = check_fraction(fraction)
    if f == 1.0:
        return search_event
    train = SubsampledMechanismDpEvent(search_event, f)
    val = validation_part(search_event)
    return train if isinstance(val, de.NoOpDpEvent) else WorstCaseDpEvent((train, val))


def search_parts(search_event: de.DpEvent) -> tuple[de.DpEvent, StoppingRule, float]:
    """(worst-case trial event, stopping rule, tune fraction) of a search's charge — the inverse of
    ``subsampled_search_event(rule.search_event(trial), fraction=f)`` (what ``plan_search`` charges).

    A noisy-max selection composed with the trials (``with_selection``) is set aside: the trials' part is
    returned. ``ValueError`` for an event that is not such a charge.
    """
    search_event, _ = split_selection(search_event)
    inner, fraction = search_event, 1.0
    head = search_event.events[0] if isinstance(search_event, WorstCaseDpEvent) and search_event.events else None
    if isinstance(head, SubsampledMechanismDpEvent):
        inner, fraction = head.event, head.fraction
    elif isinstance(search_event, SubsampledMechanismDpEvent):
        inner, fraction = search_event.event, search_event.fraction
    trial, rule = rule_of_search_event(inner)
    if subsampled_search_event(rule.search_event(trial), fraction=fraction) != search_event:
        raise ValueError(f"{type(search_event).__name__} is not the charge of a dptune search")
    return trial, rule, float(fraction)


def min_subsample_size(n: int, *, fraction: float, failure_prob: float) -> int:
    """A size m with P[Binomial(n, f) < m] ≤ ``failure_prob`` (exact binomial quantile).

    Privacy does not need it (the rate q = B/(f·n) is data-independent). If a caller *refuses to run* when
    |X₁| < m, the refusal is a data-dependent output: the mechanism is within total variation
    ``failure_prob`` =: p of the unconditioned one on every dataset, so an (ε, δ) guarantee becomes
    (ε, δ + (1 + e^ε)·p) — add that to δ (or, better, never refuse: warn the curator in sealed/ and run).
    """
    f = check_fraction(fraction)
    if not (isinstance(n, int) and n >= 1):
        raise ConfigError("n_train", f"{n!r} is not a positive integer", "give the training-set size")
    if not 0 < failure_prob < 1:
        raise ConfigError("failure_prob", f"{failure_prob!r} is not in (0, 1)", "choose e.g. 1e-6")
    if f == 1.0:
        return n
    from scipy import stats  # ≈ 0.4 s to import: only here, not on every planner start

    # ppf(p) is the smallest k with P[X <= k] >= p, so P[X < k] = P[X <= k-1] < p
    return max(0, int(stats.binom.ppf(failure_prob, n, f)))


def transfer_config(params: Mapping[str, Any], *, fraction: float, n_train: int | None = None) -> dict[str, Any]:
    """Hyperparameters found on the subsample, moved to final training on the full training split.

    Rule: keep the sampling rate q = B/n (so ``batch_size`` is scaled by 1/f), ``epochs`` (hence the step
    count T = epochs/q and the schedule length), ``learning_rate``, ``noise_multiplier`` and every other
    setting. The final run is then the tuned trial with f⁻¹ times more examples per step: the same expected
    clipped-gradient sum per example, the same RDP per unit of σ as the trial on X₁, and a per-step noise
    std on the averaged gradient σ·C/B smaller by the factor f — the selected trial's conditions, with less
    noise (the direction Koskela & Kulkarni's extrapolation from X₁ to X takes: keep q and the epochs, let
    the batch grow with the data). The final σ is then set by what the budget leaves
    (dptune.train / the advice); σ/f would keep the trial's update noise exactly.
    """
    f = check_fraction(fraction)
    out = dict(params)
    if "batch_size" in out:
        b = max(1, round(int(out["batch_size"]) / f))
        out["batch_size"] = min(b, n_train) if n_train is not None else b
    return out
