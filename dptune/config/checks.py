"""The cross-field rules of a search space, checked once it is parsed (``config.parse_space``) and again after
a CLI's overrides: the privacy settings, the accounting each searcher needs (rule 7), and the shape the scaled
searcher runs. Every problem is a :class:`ConfigError` naming the field and the fix (exit 2, nothing charged).
"""

from __future__ import annotations

import math
from typing import Any

import optuna.distributions as od

from dptune.config import searchers as _searchers
from dptune.config import stopping
from dptune.config.clipping import mode as clipping_mode
from dptune.config.schema import PrivacySpec, SearchSpace
from dptune.errors import ConfigError, check_delta, check_positive, check_unit_interval

__all__ = ["ACCOUNTING_MODES", "INTERNAL_FIELDS", "SCHEDULERS", "SEARCHABLE", "SEARCHERS", "SELECTIONS",
           "check_accounting", "check_adaptive", "check_privacy", "check_selection", "check_space", "check_transfer",
           "check_trial_score_noise"]

SELECTIONS = ("best_score", "noisy_max")
ACCOUNTING_MODES = ("random_stopping", "composed", "filter")
SEARCHERS = _searchers.SEARCHERS  # the live registry (dptune.config.searchers): a searcher registered later is a valid name
SCHEDULERS = ("fifo", "asha", "own_curve")  # asha: under the RDP filter; own_curve: each trial stops itself
# Fields that dptune sets itself and that no space or release may set: the trial's secret entropy, and
# the basis of q = B/basis (a search on a subsample passes f·n to the trainer, never through a config).
INTERNAL_FIELDS = ("seed", "sampling_basis")
# Hyperparameters a space may search over (everything else of TrialConfig is fixed per space).
SEARCHABLE = ("learning_rate", "batch_size", "groups", "noise_multiplier", "epochs", "max_grad_norm",
              "momentum", "ema_decay", "augmult", "clipping")


def check_space(s: SearchSpace) -> None:
    """Every rule of a search space, checked on the object itself: the one validation path for a YAML file,
    a dict and a ``SearchSpace`` built or changed in Python (``parse_space`` ends with it; the search CLI,
    the API and the search driver call it again after their overrides)."""
    import dataclasses

    from dptune.config import specs
    from dptune.config.distributions import in_support, support_extremes
    from dptune.config.schema import DatasetSpec, TrialConfig

    for name, value, cls in (("dataset", s.dataset, DatasetSpec), ("fixed", s.fixed, TrialConfig),
                             ("default", s.default, TrialConfig), ("privacy", s.privacy, PrivacySpec)):
        if not isinstance(value, cls):
            raise ConfigError(name, f"is a {type(value).__name__}, not a {cls.__name__}",
                              "build spaces with dptune.config.load_space / parse_space, or pass a YAML path or dict")
    for key, allowed in (("accounting", ACCOUNTING_MODES), ("searcher", SEARCHERS), ("scheduler", SCHEDULERS)):
        if getattr(s, key) not in allowed:
            raise ConfigError(f"search.{key}", f"unknown {key} {getattr(s, key)!r}", f"use one of: {', '.join(allowed)}")
    check_dataset(s.dataset)
    for section, cfg in (("fixed", s.fixed), ("default", s.default)):
        if cfg.seed != 0:
            raise ConfigError(f"{section}.seed", "is internal to dptune (set per trial from the sealed draw), not a "
                              "setting", f"leave {section}.seed at its default (0)")
    unsearchable = sorted(set(s.space) - set(SEARCHABLE))
    if unsearchable:
        what = " (the score noise is a privacy setting: privacy.score_noise)" if unsearchable[0] == "score_noise" else ""
        raise ConfigError(f"space.{unsearchable[0]}", "cannot be searched" + what,
                          f"search only: {', '.join(SEARCHABLE)}")
    kinds = (od.FloatDistribution, od.IntDistribution, od.CategoricalDistribution)
    for k, dist in s.space.items():
        if not isinstance(dist, kinds):
            raise ConfigError(f"space.{k}", f"{dist!r} is not a float, int or categorical distribution",
                              "use optuna.distributions.FloatDistribution / IntDistribution / CategoricalDistribution")
        if not in_support(dist, getattr(s.default, k)):
            raise ConfigError(f"default.{k}", f"{getattr(s.default, k)!r} is outside the searched range",
                              "choose a default inside space." + k)
        for v in support_extremes(dist):  # every reachable config must itself be valid
            s.fixed.replace(**{k: v})
    differ = sorted(f.name for f in dataclasses.fields(TrialConfig)
                    if f.name not in s.space and getattr(s.fixed, f.name) != getattr(s.default, f.name))
    if differ:
        raise ConfigError(f"default.{differ[0]}", "differs from fixed but is not searched (a K = 0 search releases "
                          "the default, which must be a config of the space)", f"set default.{differ[0]} as fixed")
    check_unit_interval("search.tune_fraction", s.tune_fraction, "choose e.g. 0.25, or 1 for off", include_one=True)
    check_privacy(s.privacy, public_validation=s.dataset.public_validation)
    specs.check_augmentation(s.dataset.name, s.fixed.augmult, "augmult" in s.space)
    _check_alc(s)
    check_adaptive(s)


def check_dataset(dataset: Any) -> None:
    """A dataset's cross-field rules (its own fields are checked when it is built)."""
    from dptune.config import specs

    if dataset.name not in specs.DATASETS:
        raise ConfigError("dataset.name", f"unknown dataset {dataset.name!r}",
                          f"use one of: {', '.join(specs.DATASETS)}")
    if dataset.name != "digits" and not dataset.path:
        raise ConfigError("dataset.path", f"dataset {dataset.name!r} needs a path",
                          "set dataset.path to its folder (a table: its .parquet or .csv file)")
    for k in ("validation_size", "test_size"):
        if getattr(dataset, k) < 1:
            raise ConfigError(f"dataset.{k}", "must be >= 1", "choose a positive number of examples")


def check_accounting(field: str, given: str | None, rule: str) -> None:
    """An accounting mode named beside the stopping rule (an older file's ``search.accounting``, the search's
    ``--accounting``) must be the one the rule implies: the rule decides it (``dptune.config.stopping``)."""
    if given is None:
        return
    if given not in ACCOUNTING_MODES:
        raise ConfigError(field, f"unknown accounting {given!r}", f"use one of: {', '.join(ACCOUNTING_MODES)}")
    implied = stopping.accounting_of(rule)
    if given != implied:
        fix = ("set privacy.stopping: composed and privacy.mean to the number of trials (--trials N)"
               if given == "composed" else "set privacy.stopping to a random-stopping rule: "
               + ", ".join(n for n in stopping.choices() if stopping.accounting_of(n) == "random_stopping"))
        raise ConfigError(field, f"{given} accounting, but privacy.stopping {rule!r} implies {implied}",
                          f"drop it (the stopping rule decides the accounting), or {fix}")


def check_privacy(p: PrivacySpec, public_validation: bool = False) -> None:
    # privacy.stopping names a registered rule, which checks its own settings (dptune.config.stopping)
    check_delta("privacy.delta", p.delta)
    stopping.rule_info(p.stopping).build({"mean": p.mean, **dict(p.stopping_settings)})
    if not public_validation and p.score_noise is None:
        raise ConfigError("privacy.score_noise", "a private validation score needs noise",
                          "set privacy.score_noise > 0, or dataset.public_validation: true")
    if p.score_noise is not None and not (math.isfinite(p.score_noise) and p.score_noise > 0):
        raise ConfigError("privacy.score_noise", f"{p.score_noise!r} must be > 0", "choose e.g. 6.0")
    if p.selection not in SELECTIONS:
        raise ConfigError("privacy.selection", f"unknown selection {p.selection!r}",
                          f"use one of: {', '.join(SELECTIONS)}")
    if p.selection == "noisy_max" and public_validation:
        raise ConfigError("privacy.selection", "noisy_max protects a private validation split, but this one is "
                          "declared public (its best score is released free)", "remove privacy.selection")
    if p.target_epsilon is not None:
        check_positive("privacy.target_epsilon", p.target_epsilon, "give the total ε for search + final training, "
                       "e.g. 8, or leave it out")
    if p.search_share is not None:
        check_unit_interval("privacy.search_share", p.search_share, "choose e.g. 0.3 (30 % of privacy.target_epsilon "
                            "for the search's cheap trials)")


def check_adaptive(s: SearchSpace) -> None:
    """Rule 7: a searcher runs only under an accounting mode valid for it (``Searcher.accounting``): an adaptive
    one is not covered by random stopping; a searcher whose choice depends on a fixed set of trials' private
    scores (the scaled searcher) is charged by composition. The ASHA scheduler is adaptive too."""
    sr = _searchers.searcher(s.searcher)
    if s.accounting not in sr.accounting:
        why = ("is adaptive: trials depend on earlier private scores, which the Papernot-Steinke random-stopping "
               "theorem does not cover" if sr.adaptive else "chooses among a fixed number of trials by their "
               "private scores")
        raise ConfigError("privacy.stopping", f"the {sr.name} searcher {why}; {s.privacy.stopping!r} implies "
                          f"{s.accounting} accounting", "set privacy.stopping: composed and privacy.mean to the "
                          "number of trials (every trial charged; search --trials N)"
                          + (", or use the random searcher" if sr.adaptive else ""))
    check_asha(s)
    check_transfer(s)
    check_selection(s)
    sr.check(s)


def check_asha(s: SearchSpace) -> None:
    """Rule 7 for the scheduler: ASHA compares trials by their noised rung scores, so which trial trains on depends on
    the others' releases; random stopping does not cover it, an RDP filter does (``privacy.stopping: filter``, the
    only mode it runs under; docs/accountant.md). ``own_curve``: each trial stops itself on its own noised rung
    scores, one run of a fixed mechanism charged at its worst case (every rung's score): any non-adaptive accounting.
    Both run rung segments of one fixed schedule: a random searcher's configs, fixed whole epochs, no subsample
    tuning, transfer or noisy max."""
    if s.scheduler != "asha" and s.accounting == "filter":
        raise ConfigError("privacy.stopping", f"the filter admits ASHA's rung segments; with scheduler {s.scheduler} "
                          "no scheduler compares trials", "set search.scheduler: asha, or another privacy.stopping")
    if s.scheduler == "fifo":
        return
    if s.scheduler == "asha" and s.accounting != "filter":
        raise ConfigError("search.scheduler", f"ASHA is adaptive (which trial trains on depends on the others' noised "
                          f"scores), which {s.accounting} accounting does not cover", "set privacy.stopping: filter "
                          "and privacy.mean to the full-length trials' worth it may spend (an RDP filter: the valid "
                          "mode for ASHA), or search.scheduler: fifo")
    for bad, field, fix in ((s.searcher != "random", "search.searcher", f"use the random searcher with {s.scheduler}"),
                            ("epochs" in s.space, "space.epochs", "fix epochs: ASHA's rungs are epochs of one schedule"),
                            (s.fixed.epochs != int(s.fixed.epochs) or s.fixed.epochs < s.grace_period,
                             "fixed.epochs", f"give whole epochs >= search.grace_period ({s.grace_period})"),
                            (s.tune_fraction != 1, "search.tune_fraction", "remove it (1) with ASHA"),
                            (s.transfers, "privacy.search_share", "remove it with ASHA"),
                            (s.privacy.selection != "best_score", "privacy.selection", "use best_score with ASHA")):
        if bad:
            raise ConfigError(field, f"is not supported with search.scheduler: {s.scheduler}", fix)


def check_selection(s: SearchSpace) -> None:
    """``noisy_max`` chooses once among candidates fixed in advance, after all of them ran: the scaled
    searcher. Random stopping's theorem and adaptive searchers need every trial's own released score. And
    the trials' own score noise is the one the privacy settings imply (:func:`check_trial_score_noise`)."""
    check_trial_score_noise(s)
    if s.privacy.selection == "noisy_max" and not _searchers.searcher(s.searcher).fixed_candidates:
        fixed = ", ".join(n for n, x in _searchers.SEARCHERS.items() if x.fixed_candidates)
        raise ConfigError("privacy.selection", f"noisy_max needs fixed candidates, not the {s.searcher} searcher "
                          "(whose trials each release a score)",
                          f"set search.searcher to one with fixed candidates ({fixed}), or privacy.selection: best_score")


def check_trial_score_noise(s: SearchSpace) -> None:
    """What every trial runs (``fixed.score_noise``, charged per trial) must be what ``privacy`` says: a space
    whose privacy was replaced without its trials (use ``SearchSpace.with_privacy``) would release a raw or
    differently noised score."""
    expected = None if s.dataset.public_validation else s.privacy.trial_score_noise
    for which, cfg in (("fixed", s.fixed), ("default", s.default)):
        if cfg.score_noise != expected:
            raise ConfigError("privacy.score_noise", f"the trials' own score noise ({which}: {cfg.score_noise}) is not "
                              f"what privacy.score_noise and privacy.selection imply ({expected})",
                              "change privacy settings with SearchSpace.with_privacy(...), or load the space file")


def check_transfer(s: SearchSpace) -> None:
    """A search that plans its final run (``privacy.search_share`` with ``privacy.target_epsilon``; the scaled
    searcher always does) runs every trial at a cheap σ_c(B, E) with the noise-scaled transfer
    lr = L·σ_f(B, E)/σ_c(B, E) (``accounting.TransferPlan``): the noise multiplier is set by the budget, not searched, and the final
    run's σ_f must be known for every reachable batch size and epochs."""
    p = s.privacy
    if p.search_share is None and s.lr_reference_batch is not None:
        raise ConfigError("search.lr_reference_batch", "scales the final run's learning rate with its batch size, "
                          "which only a search that plans its final run has", "set privacy.target_epsilon and "
                          "privacy.search_share, or remove search.lr_reference_batch")
    if p.search_share is None:
        if _searchers.searcher(s.searcher).needs_final_plan:
            raise ConfigError("privacy.search_share", f"the {s.searcher} searcher sizes its trials and the final run "
                              "from it", "give the share of privacy.target_epsilon for the cheap trials, e.g. 0.3")
        return
    if p.target_epsilon is None:
        raise ConfigError("privacy.target_epsilon", "privacy.search_share is a share of it: the search sizes its "
                          "trials and the final run from it", "give the total ε for search + final training, e.g. 2")
    if "noise_multiplier" in s.space:
        raise ConfigError("space.noise_multiplier", "is set by the budget when the search plans its final run "
                          "(privacy.search_share): trials run at a cheap noise multiplier, the final run at what "
                          "privacy.target_epsilon leaves", "remove space.noise_multiplier (or remove "
                          "privacy.search_share and privacy.target_epsilon to search it directly)")
    epochs = s.space.get("epochs")
    if isinstance(epochs, od.FloatDistribution) and epochs.step is None:
        raise ConfigError("space.epochs", "a continuous range: the final run's noise multiplier is planned per "
                          "reachable number of epochs", "use categorical choices or an int range")
    if s.tune_fraction < 1:
        raise ConfigError("search.tune_fraction", "a search that plans its final run runs on the full training "
                          "split", "remove search.tune_fraction")
    clipping = s.space.get("clipping")
    if any(not clipping_mode(str(m)).per_example
           for m in (clipping.choices if isinstance(clipping, od.CategoricalDistribution) else [s.fixed.clipping])):
        raise ConfigError("space.clipping" if "clipping" in s.space else "fixed.clipping", "batch clipping is not "
                          "planned by a search that plans its final run (its noise sits on the batch mean, so the "
                          "transfer lr = L·σ_f/σ_c does not carry over)", "use per-example clipping here, or remove "
                          "privacy.search_share and set the noise multiplier (fixed or searched)")


def _check_alc(s: SearchSpace) -> None:
    """Adaptive layerwise clipping needs its public data (``alc:``), and ``alc:`` is only for it; the public data is
    never the private dataset itself (the ledger refuses one that overlaps any budgeted dataset at search time)."""
    clipping = s.space.get("clipping")
    modes = list(clipping.choices) if isinstance(clipping, od.CategoricalDistribution) else [s.fixed.clipping]
    layerwise = any(clipping_mode(str(m)).layerwise for m in modes)
    if layerwise and s.alc is None:
        raise ConfigError("alc", "clipping alc sets each layer's clip norm from a public dataset's gradient norms",
                          "add alc: {public: {name: digits}} (a dataset declared public), or choose another clipping")
    if s.alc is None:
        return
    if not layerwise:
        raise ConfigError("alc", "is set but no trial clips layerwise", "set fixed.clipping: alc, or remove alc")
    pub, own = s.alc.public, s.dataset
    if (pub.name, pub.path, pub.split) == (own.name, own.path, own.split):
        raise ConfigError("alc.public", "is the private dataset itself: its gradient norms would set the clip norms",
                          "name a dataset declared public (e.g. {name: digits}), disjoint from every budgeted one")
