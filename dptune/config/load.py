"""Loading a space: a YAML file or a dict parsed into the records (:mod:`dptune.config.schema`), then the
cross-field rules (:mod:`dptune.config.checks`). Every problem is a :class:`ConfigError` that names the field and
says how to fix it; the CLIs turn it into exit status 2 before anything is charged or run.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import optuna.distributions as od
import yaml

from dptune.config import auto, specs, stopping
from dptune.config.checks import (
    INTERNAL_FIELDS,
    SCHEDULERS,
    SEARCHABLE,
    SEARCHERS,
    check_accounting,
    check_dataset,
    check_privacy,
    check_space,
)
from dptune.config.distributions import in_support, parse_distribution
from dptune.config.planner import PlannerSpec, with_planner_baseline
from dptune.config.schema import (
    DatasetSpec,
    PrivacySpec,
    SearchSpace,
    TrialConfig,
    coerce_value,
)
from dptune.errors import ConfigError, check_unit_interval

__all__ = ["load_space", "nominal_train_size", "official_pool", "parse_dataset", "parse_space"]


_TOP_KEYS = ("name", "dataset", "model", "fixed", "space", "default", "privacy", "search", "planner", "alc")


def load_space(path: str | Path, **derive: Any) -> SearchSpace:
    """The space file at ``path``; ``derive``: :func:`parse_space`'s settings for a ``space: auto`` file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError("--space", f"file {str(p)!r} does not exist", "pass an existing YAML file, "
                          "e.g. search_spaces/digits.yaml")
    try:
        raw = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(str(p), f"malformed YAML ({str(e).splitlines()[0]})", "fix the YAML syntax") from e
    return parse_space(raw, source=str(p), **derive)


_AUTO_KEYS = ("name", "dataset", "privacy", "space")


def _derive_auto(raw: Mapping[str, Any], n_train: int | None, count_train: Callable[[DatasetSpec], int] | None,
                 target_epsilon: float | None, hardware: str) -> tuple[dict[str, Any], auto.PublicFacts]:
    """``space: auto``: the space file the rules derive from the data's public facts and the budget."""
    extra = sorted(set(raw) - set(_AUTO_KEYS))
    if extra:
        raise ConfigError(extra[0], "space: auto derives it from public facts",
                          f"remove {extra[0]}: (or write the whole space by hand without space: auto)")
    pr = _section(raw, "privacy", ("target_epsilon", "delta"))
    if target_epsilon is not None:
        pr["target_epsilon"] = target_epsilon
    if "target_epsilon" not in pr:
        raise ConfigError("privacy.target_epsilon", "space: auto needs the total budget",
                          "give privacy.target_epsilon (or --target-epsilon), e.g. 2")
    eps = float(coerce_value("privacy.target_epsilon", pr["target_epsilon"], float))
    delta = float(coerce_value("privacy.delta", pr.get("delta", PrivacySpec.delta), float))
    if not (math.isfinite(eps) and eps > 0):
        raise ConfigError("privacy.target_epsilon", f"{eps!r} must be > 0", "choose e.g. 2")
    dataset = parse_dataset(raw)
    n = nominal_train_size(dataset) or n_train
    if n is None and count_train is not None:
        n = count_train(dataset)
    if n is None:
        raise ConfigError("dataset", f"space: auto sizes the search on the training split, and a {dataset.name}'s "
                          "size is counted, not published", "pass --n-train N (dptune plan); dptune search counts it")
    ds_raw = {k: v for k, v in dataclasses.asdict(dataset).items()
              if v != DatasetSpec.__dataclass_fields__[k].default or k in (raw.get("dataset") or {})}
    facts = auto.facts_of(dataclasses.asdict(dataset), n_train=n, target_epsilon=eps, delta=delta,
                          hardware=hardware)
    return auto.derive(ds_raw, facts, name=raw.get("name")), facts


def _section(raw: Mapping[str, Any], key: str, allowed: tuple[str, ...]) -> dict[str, Any]:
    value = raw.get(key) or {}
    if not isinstance(value, Mapping):
        raise ConfigError(key, f"must be a mapping, got {type(value).__name__}", f"write `{key}:` with keys")
    unknown = sorted(set(value) - set(allowed))
    if unknown:
        raise ConfigError(f"{key}.{unknown[0]}", "unknown key", f"use one of: {', '.join(allowed)}")
    return dict(value)


def parse_space(raw: Any, source: str | None = None, *, n_train: int | None = None,
                count_train: Callable[[DatasetSpec], int] | None = None, target_epsilon: float | None = None,
                hardware: str = "cpu") -> SearchSpace:
    """A validated :class:`SearchSpace` from a YAML mapping (ConfigError naming the key otherwise). ``space: auto``
    derives everything but the data and the budget from public facts (:mod:`dptune.config.auto`), with these
    settings (a hand-written space ignores them): ``n_train`` the training split's size where the dataset's reader
    does not publish it (a table's or folder's), else ``count_train(dataset)`` counts it; ``target_epsilon`` the
    total budget in place of the file's ``privacy.target_epsilon``; ``hardware`` the hardware named (cpu or gpu)."""
    if not isinstance(raw, Mapping):
        raise ConfigError("search space", "the file is not a YAML mapping", "see search_spaces/digits.yaml")
    if auto.is_auto(raw):
        derived, facts = _derive_auto(raw, n_train, count_train, target_epsilon, hardware)
        space_obj = parse_space(derived, source)
        return dataclasses.replace(space_obj, auto={"rules": auto.RULES_VERSION, "facts": facts.to_dict(),
                                                    "space": derived})
    unknown = sorted(set(raw) - set(_TOP_KEYS))
    if unknown:
        raise ConfigError(unknown[0], "unknown top-level key", f"use only: {', '.join(_TOP_KEYS)}")
    name = raw.get("name") or (Path(source).stem if source else "space")
    dataset = parse_dataset(raw)
    privacy = _parse_privacy(raw)
    check_privacy(privacy, public_validation=dataset.public_validation)
    fixed, space = _parse_trials(raw, None if dataset.public_validation else privacy.trial_score_noise)
    specs.check_augmentation(dataset.name, fixed.augmult, "augmult" in space)
    planner_raw = _section(raw, "planner", tuple(f.name for f in dataclasses.fields(PlannerSpec)))
    planner = PlannerSpec(**{k: coerce_value(f"planner.{k}", v, PlannerSpec.__dataclass_fields__[k].type)
                             for k, v in planner_raw.items()})
    planner = with_planner_baseline(planner, TrialConfig.__dataclass_fields__, coerce_value)
    space_obj = SearchSpace(name=str(name), dataset=dataset, fixed=fixed, space=space, default=fixed,
                            privacy=privacy, source=source, planner=planner, **_parse_search(raw, privacy),
                            alc=specs.parse_alc(raw.get("alc"), parse_dataset))
    check_space(space_obj)  # the rules every space obeys, however it was built (the API and CLIs call it too)
    return space_obj


def _parse_privacy(raw: Mapping[str, Any]) -> PrivacySpec:
    """``privacy:``. The stopping rule is a name with its settings beside it (``stopping: tnb``, ``mean: 3``,
    ``eta: 0``: every older file) or a mapping (``stopping: {rule: tnb, mean: 3, eta: 0}``); the rule's own
    settings (all but ``mean``) go to ``stopping_settings`` and the rule itself checks them (``check_privacy``)."""
    own = tuple(f.name for f in dataclasses.fields(PrivacySpec) if f.name != "stopping_settings")
    pr = _section(raw, "privacy", own + tuple(n for n in stopping.setting_names() if n not in own))
    rule = pr.get("stopping", PrivacySpec.stopping)
    settings: dict[str, Any] = {}
    if isinstance(rule, Mapping):
        rule = dict(rule)
        if "rule" not in rule:
            raise ConfigError("privacy.stopping.rule", "a stopping mapping needs the rule's name",
                              "e.g. stopping: {rule: tnb, mean: 3, eta: 0}")
        if "mean" in rule and "mean" in pr:
            raise ConfigError("privacy.mean", "given twice (also in privacy.stopping)", "keep one")
        pr["stopping"] = rule.pop("rule")
        pr.update({"mean": rule.pop("mean")} if "mean" in rule else {})
        settings = {k: coerce_value(f"privacy.stopping.{k}", v, float) for k, v in rule.items()}
    flat = {k: pr.pop(k) for k in list(pr) if k not in own}
    if not settings:  # an older file's flat settings; one that is not its rule's was ignored before, and still is
        names = stopping.rule_info(pr.get("stopping", PrivacySpec.stopping)).settings
        settings = {k: coerce_value(f"privacy.{k}", v, float) for k, v in flat.items() if k in names}
    privacy = PrivacySpec(**{k: coerce_value(f"privacy.{k}", v, PrivacySpec.__dataclass_fields__[k].type)
                             for k, v in pr.items()})
    return dataclasses.replace(privacy, stopping_settings=tuple(sorted(settings.items())))


def parse_dataset(raw: Mapping[str, Any]) -> DatasetSpec:
    ds = _section(raw, "dataset", tuple(f.name for f in dataclasses.fields(DatasetSpec)))
    dataset = DatasetSpec(**{k: coerce_value(f"dataset.{k}", v, DatasetSpec.__dataclass_fields__[k].type)
                             for k, v in ds.items()})
    check_dataset(dataset)
    return dataset


def _parse_trials(raw: Mapping[str, Any], score_noise: float | None
                  ) -> tuple[TrialConfig, dict[str, od.BaseDistribution]]:
    """The fixed settings with the searched keys at their default values (released when K = 0), and the
    searched distributions."""
    model_raw = _section(raw, "model", specs.MODEL_KEYS)
    for key in INTERNAL_FIELDS:
        for section in ("fixed", "default"):
            if isinstance(raw.get(section), Mapping) and key in raw[section]:
                raise ConfigError(f"{section}.{key}", "is internal to dptune (set per trial from the sealed draw "
                                  "and the planner), not a setting", f"remove {section}.{key} from the space")
    fixed_raw = _section(raw, "fixed", tuple(f.name for f in dataclasses.fields(TrialConfig)))
    if "score_noise" in fixed_raw:
        raise ConfigError("fixed.score_noise", "score noise is a privacy setting", "set privacy.score_noise")
    base: dict[str, Any] = dict(fixed_raw)
    from_model = specs.model_from_section(model_raw)
    both = sorted(set(from_model) & set(fixed_raw))
    if both:
        raise ConfigError(f"fixed.{both[0]}", "is set in the model section too", "set it in one place")
    base.update(from_model)
    base["score_noise"] = score_noise
    space = {k: parse_distribution(f"space.{k}", v) for k, v in _section(raw, "space", SEARCHABLE).items()}
    overlap = sorted(set(space) & set(fixed_raw))
    if overlap:
        raise ConfigError(f"fixed.{overlap[0]}", "is both fixed and searched", "remove it from `fixed` or `space`")
    default_raw = _section(raw, "default", SEARCHABLE)
    missing = sorted(set(space) - set(default_raw))
    if missing:
        raise ConfigError(f"default.{missing[0]}", "no default value for a searched hyperparameter",
                          "give the value released when the search draws no trial (K = 0)")
    fixed = TrialConfig.from_dict({**base, **default_raw}, where="fixed")
    for k, dist in space.items():
        if not in_support(dist, getattr(fixed, k)):
            raise ConfigError(f"default.{k}", f"{getattr(fixed, k)!r} is outside the searched range",
                              "choose a default inside space." + k)
    return fixed, space


def _parse_search(raw: Mapping[str, Any], privacy: PrivacySpec) -> dict[str, Any]:
    search_raw = _section(raw, "search", ("accounting", "searcher", "scheduler", "tune_fraction", "lr_reference_batch",
                                           "lr_batch_power", "grace_period", "reduction_factor"))
    out = {"searcher": search_raw.get("searcher", "random"), "scheduler": search_raw.get("scheduler", "fifo")}
    for key, allowed in (("searcher", SEARCHERS), ("scheduler", SCHEDULERS)):
        if out[key] not in allowed:
            raise ConfigError(f"search.{key}", f"unknown {key} {out[key]!r}", f"use one of: {', '.join(allowed)}")
    check_accounting("search.accounting", search_raw.get("accounting"), privacy.stopping)
    for key, low in (("grace_period", 1), ("reduction_factor", 2)):
        if key in search_raw:
            v = search_raw[key]
            if out["scheduler"] == "fifo" or isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ConfigError(f"search.{key}", f"{v!r} is a rung setting (scheduler asha or own_curve), a whole "
                                  f"number >= {low}", f"give a whole number >= {low} beside such a scheduler, or remove it")
            out[key] = v
    tune_fraction = coerce_value("search.tune_fraction", search_raw.get("tune_fraction", 1.0), float)
    out["tune_fraction"] = check_unit_interval("search.tune_fraction", tune_fraction, "choose e.g. 0.25, or 1 for off",
                                               include_one=True)
    ref = search_raw.get("lr_reference_batch")
    if ref is not None:
        if isinstance(ref, bool) or not isinstance(ref, int) or ref < 1:
            raise ConfigError("search.lr_reference_batch", f"{ref!r} is not a batch size",
                              "give the batch size the searched learning rate is meant at, e.g. 256")
        out["lr_reference_batch"] = ref
    if "lr_batch_power" in search_raw:
        power = search_raw["lr_batch_power"]
        if ref is None or isinstance(power, bool) or not (isinstance(power, int | float) and math.isfinite(power)
                                                          and 0 < power <= 2):
            raise ConfigError("search.lr_batch_power", f"{power!r} scales the lr with batch size only beside "
                              "search.lr_reference_batch, and only by a power in (0, 2]",
                              "give search.lr_reference_batch and a power such as 1 (linear) or 0.5, or remove it")
        out["lr_batch_power"] = power
    return out


def official_pool(spec: DatasetSpec) -> tuple[str, int] | None:
    """The official split a torchvision dataset's pool is read from and its size (``official``: the train split),
    e.g. ``("test", 10000)`` for MNIST's test split; None for the other datasets."""
    sizes = specs.VISION_SIZES.get(spec.name)
    if sizes is None:
        return None
    split = specs.pool_split(spec.split)
    return split, sizes[1] if split == "test" else sizes[0]


def nominal_train_size(spec: DatasetSpec) -> int | None:
    """Training-split size known without reading the data (digits: 1797 images; the torchvision datasets'
    official splits, e.g. MNIST's test split: 10,000, or a declared ``pool_size``, less the held-out splits); None
    for folders and tables."""
    return specs.nominal_train_size(spec.name, spec.split, spec.validation_size, spec.test_size, spec.pool_size)
