"""Which model and which data: the space-file syntax of ``model:`` and ``dataset:``, checked without torch (the
``planner:`` section, the verdict's priors, is ``dptune.config.planner``).

A trial config names its model with one string (``TrialConfig.model``) plus ``model_kwargs``:

* a built-in: ``gn_cnn``, ``tanh_cnn``, ``resnet9``, ``wrn16_4``, ``mlp``;
* ``torchvision:<name>``: a torchvision classification model, built with ``weights=None``;
* ``factory:<package.module>:<function>``: ``function(num_classes, input_shape, groups, **model_kwargs)``
  returning an ``nn.Module`` (importable where the search starts: the search ships the module's top-level
  package folder, or its single file, to Ray's workers; what it imports must be installed on every node).

In a space file: ``model: {name: gn_cnn}``, ``model: {torchvision: resnet18, fix_batchnorm: true}`` or
``model: {factory: "pkg.mod:fn", kwargs: {width: 64}}``. Whether the model builds and passes Opacus'
validation is checked by ``dptune.dpsgd.validate_model`` before anything is charged.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dptune.errors import ConfigError

__all__ = ["BUILTIN_MODELS", "DATASETS", "DATASET_SPLITS", "VISION_SIZES", "check_dataset_fields",
           "check_augmentation", "check_model", "check_model_kwargs", "check_pool_size", "model_from_section",
           "nominal_train_size", "pool_split"]

BUILTIN_MODELS = ("gn_cnn", "tanh_cnn", "resnet9", "wrn16_4", "mlp")
TORCHVISION_PREFIX = "torchvision:"
FACTORY_PREFIX = "factory:"
MODEL_KEYS = ("name", "torchvision", "factory", "kwargs", "scale_norm", "fix_batchnorm")
_FACTORY = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")
_TORCHVISION = re.compile(r"^[A-Za-z_]\w*$")

# (official train split, official test split) sizes of the torchvision datasets dptune reads
VISION_SIZES = {"mnist": (60000, 10000), "fashion_mnist": (60000, 10000), "cifar10": (50000, 10000),
                "cifar100": (50000, 10000), "svhn": (73257, 26032)}
DATASETS = ("digits", *VISION_SIZES, "imagefolder", "table")
# datasets whose classes the space declares (``dataset.classes``); the others declare their own, fixed lists
DECLARED_CLASSES = ("imagefolder", "table")
# official: the official train split gives train + validation, the official test split is the test split;
# train / test: that official split alone is the pool dptune splits into train / validation / test
DATASET_SPLITS = ("official", "train", "test")


# --------------------------------------------------------------------------------------------------
# models


def check_model(model: Any) -> None:
    """``model`` is a built-in name, ``torchvision:<name>`` or ``factory:<package.module>:<function>``."""
    if not isinstance(model, str):
        raise ConfigError("model", f"{model!r} is not a string", f"use one of: {', '.join(BUILTIN_MODELS)}")
    if model.startswith(FACTORY_PREFIX):
        target = model[len(FACTORY_PREFIX):]
        if not _FACTORY.match(target):
            raise ConfigError("model.factory", f"{target!r} is not 'package.module:function'",
                              "write e.g. model: {factory: \"mypackage.models:make_model\"}")
    elif model.startswith(TORCHVISION_PREFIX):
        if not _TORCHVISION.match(model[len(TORCHVISION_PREFIX):]):
            raise ConfigError("model.torchvision", f"{model[len(TORCHVISION_PREFIX):]!r} is not a model name",
                              "write e.g. model: {torchvision: resnet18}")
    elif model not in BUILTIN_MODELS:
        raise ConfigError("model", f"unknown model {model!r}",
                          f"use one of: {', '.join(BUILTIN_MODELS)}, or model: {{torchvision: NAME}} or "
                          "model: {factory: \"package.module:function\"}")


def _check_plain(field: str, value: Any) -> None:
    """YAML/JSON data only (so a config round-trips through best_config.yaml and JSON unchanged)."""
    if value is None or isinstance(value, str | bool | int):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ConfigError(field, f"{value!r} is not finite", "give a finite number")
        return
    if isinstance(value, list):
        for i, v in enumerate(value):
            _check_plain(f"{field}[{i}]", v)
        return
    if isinstance(value, Mapping):
        for k, v in value.items():
            if not isinstance(k, str):
                raise ConfigError(field, f"key {k!r} is not a string", "use string keys")
            _check_plain(f"{field}.{k}", v)
        return
    raise ConfigError(field, f"{value!r} is a {type(value).__name__}",
                      "use YAML data only: numbers, strings, true/false, null, lists and mappings")


def check_model_kwargs(kwargs: Any) -> None:
    if not isinstance(kwargs, Mapping):
        raise ConfigError("model.kwargs", f"{kwargs!r} is not a mapping", "write kwargs: {name: value, ...}")
    _check_plain("model.kwargs", dict(kwargs))
    for reserved in ("num_classes", "input_shape", "groups"):
        if reserved in kwargs:
            raise ConfigError(f"model.kwargs.{reserved}", "is set by dptune (from the data and the searched groups)",
                              f"remove {reserved} from model.kwargs")
    if "weights" in kwargs:
        raise ConfigError("model.kwargs.weights", "pretrained weights are not supported (nothing is downloaded "
                          "at run time, and a model is trained from scratch)", "remove weights from model.kwargs")


def model_from_section(section: Mapping[str, Any]) -> dict[str, Any]:
    """The TrialConfig values of a space's ``model:`` section (keys of :data:`MODEL_KEYS`)."""
    kinds = [k for k in ("name", "torchvision", "factory") if k in section]
    if len(kinds) > 1:
        raise ConfigError(f"model.{kinds[1]}", f"model.{kinds[0]} is given too", "give one of name, torchvision, factory")
    out: dict[str, Any] = {k: section[k] for k in ("scale_norm", "fix_batchnorm") if k in section}
    for kind, prefix in (("name", ""), ("torchvision", TORCHVISION_PREFIX), ("factory", FACTORY_PREFIX)):
        if kind in section:
            if not isinstance(section[kind], str):
                raise ConfigError(f"model.{kind}", f"{section[kind]!r} is not a string", "give a name")
            out["model"] = prefix + section[kind]
    if "kwargs" in section:
        kwargs = {} if section["kwargs"] is None else section["kwargs"]
        check_model_kwargs(kwargs)
        out["model_kwargs"] = dict(kwargs)
    return out


# --------------------------------------------------------------------------------------------------
# datasets


def check_dataset_fields(name: str, split: Any, download: Any, label: Any, features: Any, classes: Any) -> Any:
    """The dataset keys beyond name/path/sizes: ``split`` and ``download`` (torchvision datasets), and for
    ``table`` the ``label`` column, the ``features`` with their public bounds and optional declared
    ``classes``. Returns a copy of ``features`` (None for non-tables)."""
    if split not in DATASET_SPLITS:
        raise ConfigError("dataset.split", f"unknown split {split!r}", f"use one of: {', '.join(DATASET_SPLITS)}")
    for key, given in (("split", split != "official"), ("download", download is not False)):
        if given and name not in VISION_SIZES:
            raise ConfigError(f"dataset.{key}", f"applies to torchvision's datasets, not to {name!r}",
                              f"remove dataset.{key} (it applies to {', '.join(VISION_SIZES)})")
    table_keys = {"label": label, "features": features}
    if name != "table":
        given = [k for k, v in table_keys.items() if v is not None]
        if given:
            raise ConfigError(f"dataset.{given[0]}", f"applies to tables only, not to {name!r}",
                              f"remove dataset.{given[0]}")
    if name in DECLARED_CLASSES:
        _check_classes(name, classes)
    elif classes is not None:
        raise ConfigError("dataset.classes", f"{name!r} declares its own classes", "remove dataset.classes")
    if name != "table":
        return None
    if not isinstance(label, str) or not label:
        raise ConfigError("dataset.label", "a table needs its label column", "set dataset.label: <column name>")
    _check_features(features, label)
    return {col: list(bounds) for col, bounds in features.items()}


def _check_classes(name: str, classes: Any) -> None:
    """A table's or image folder's class list is declared, never read off the data: one record with a new
    label would otherwise change the released model's output layer (membership of that record)."""
    example = "[malignant, benign]" if name == "table" else "[cat, dog] (the class folder names)"
    if classes is None:
        raise ConfigError("dataset.classes", f"is required for {name!r}: a class list derived from the data "
                          "(its label values or class folders) decides the model's output layer and so reveals "
                          "whether a record with a new label is in it", f"declare the classes in order, e.g. {example}")
    if not _distinct_labels(classes) or (name == "imagefolder" and not all(isinstance(c, str) for c in classes)):
        raise ConfigError("dataset.classes", f"{classes!r} is not a list of >= 2 distinct labels",
                          f"list the label values in class order, e.g. {example}")


def check_id_column(name: str, id_column: Any, label: Any, features: Any) -> None:
    """``dataset.id_column``: a table's record identifier (what the ledger keys budgets on), neither the label
    nor a feature. Images have theirs (a built-in's index in its official split, an imagefolder's path)."""
    if id_column is None:
        return
    if name != "table":
        raise ConfigError("dataset.id_column", f"applies to tables only, not to {name!r}",
                          f"remove dataset.id_column ({name!r} records are identified by dptune itself)")
    if not isinstance(id_column, str) or not id_column:
        raise ConfigError("dataset.id_column", f"{id_column!r} is not a column name", "name the table's id column")
    if id_column == label or (isinstance(features, Mapping) and id_column in features):
        raise ConfigError("dataset.id_column", f"{id_column!r} is the label or a feature",
                          "name a column that identifies each record and is not used for training")


def _distinct_labels(classes: Any) -> bool:
    return (isinstance(classes, list) and len(classes) >= 2 and len(set(map(repr, classes))) == len(classes)
            and all(isinstance(c, str) or (isinstance(c, int) and not isinstance(c, bool)) for c in classes))


def _check_features(features: Any, label: str) -> None:
    if not isinstance(features, Mapping) or not features:
        raise ConfigError("dataset.features", "a table needs its feature columns with public bounds",
                          "write features: {column: [low, high], ...} with bounds from the data's documentation")
    for col, bounds in features.items():
        field = f"dataset.features.{col}"
        if not isinstance(col, str):
            raise ConfigError("dataset.features", f"column name {col!r} is not a string", "quote the column name")
        if col == label:
            raise ConfigError(field, "is the label column", "remove the label from the features")
        ok = (isinstance(bounds, list) and len(bounds) == 2 and all(
            isinstance(b, int | float) and not isinstance(b, bool) and math.isfinite(b) for b in bounds))
        if not ok or not bounds[0] < bounds[1]:
            raise ConfigError(field, f"{bounds!r} is not [low, high] with low < high",
                              "declare the column's public range, e.g. [0, 100] (never computed from the data)")


def pool_split(split: str) -> str:
    """The official split a torchvision dataset's pool is read from (``official``: the train split)."""
    return "test" if split == "test" else "train"


def nominal_train_size(name: str, split: str, validation_size: int, test_size: int,
                       pool_size: int | None = None) -> int | None:
    """The training split's size known without reading data: the pool dptune splits (digits: 1797; the
    official split chosen, or for ``official`` the official train split, whose test split is kept as is; a
    declared ``pool_size`` in their place) less the held-out splits. None when only the data can tell
    (imagefolder, tables)."""
    if name == "digits":
        return 1797 - validation_size - test_size
    sizes = VISION_SIZES.get(name)
    if sizes is None:
        return None
    pool = pool_size if pool_size is not None else sizes[1] if pool_split(split) == "test" else sizes[0]
    return pool - validation_size - (0 if split == "official" else test_size)


def check_pool_size(name: str, split: str, pool_size: Any, validation_size: int, test_size: int) -> None:
    """``dataset.pool_size``: torchvision datasets only, a subset of the official split that leaves a training
    split (it is what the plan and the search are sized on, never counted from the data)."""
    if pool_size is None:
        return
    if name not in VISION_SIZES:
        raise ConfigError("dataset.pool_size", f"applies to torchvision's datasets, not to {name!r}",
                          "remove dataset.pool_size (digits has its fixed size; folders and tables are counted)")
    official = VISION_SIZES[name][1 if pool_split(split) == "test" else 0]
    if isinstance(pool_size, bool) or not isinstance(pool_size, int) or not 1 <= pool_size <= official:
        raise ConfigError("dataset.pool_size", f"{pool_size!r} is not a number of images in 1..{official:,} (the "
                          f"official {pool_split(split)} split of {name})",
                          "give the number of images the folder holds, or remove it for the whole split")
    held = validation_size + (0 if split == "official" else test_size)
    if isinstance(held, int) and pool_size <= held:
        raise ConfigError("dataset.pool_size", f"{pool_size} images leave no training example after the "
                          f"{held} held out for validation{'' if split == 'official' else ' and test'}",
                          "declare the folder's true number of images, or hold out fewer")


def check_augmentation(dataset: str, augmult: int, searched: bool) -> None:
    if dataset == "table" and (augmult or searched):
        raise ConfigError("space.augmult" if searched else "fixed.augmult", "augmentation (crops, flips) applies "
                          "to images, not to table rows", "remove augmult (or set 0) for a table")


@dataclass(frozen=True)
class AlcSpec:
    """Adaptive layerwise clipping (``fixed.clipping: alc``; van Dijk et al. 2023): one clip norm C_l per layer,
    from the per-example gradient norms of a **public** dataset (the ``quantile`` of each layer's norms over at
    most ``examples`` public examples, on the model's data-independent seed-0 initialisation), scaled so that
    sqrt(Σ C_l²) = max_grad_norm. Computed before anything is charged, carried by every trial's config and the
    release (``TrialConfig.layer_clip``); each example's clipped gradient then has norm <= max_grad_norm, so the
    charge is flat clipping's.

    Attributes:
        public: The public dataset, with the keys of ``dataset:``; it must hold no record of a budgeted dataset.
        quantile: The quantile of each layer's per-example gradient norms taken as its clip norm (0.5: the median).
        examples: The most public examples the norms are measured on.
    """

    public: Any  # a DatasetSpec, declared public: it must overlap no budgeted dataset
    quantile: float = 0.5
    examples: int = 512

    def __post_init__(self) -> None:
        if not (isinstance(self.quantile, int | float) and 0 < self.quantile <= 1):
            raise ConfigError("alc.quantile", f"{self.quantile!r} is not in (0, 1]", "choose e.g. 0.5 (the median)")
        if isinstance(self.examples, bool) or not isinstance(self.examples, int) or self.examples < 2:
            raise ConfigError("alc.examples", f"{self.examples!r} is not an integer >= 2", "choose e.g. 512")


def parse_alc(raw: Any, parse_dataset: Any) -> AlcSpec | None:
    """The ``alc:`` section (None when absent); ``parse_dataset`` turns the ``public`` mapping into a DatasetSpec."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping) or "public" not in raw:
        raise ConfigError("alc", "must be a mapping with a public dataset", "write alc: {public: {name: digits}}")
    unknown = sorted(set(raw) - {"public", "quantile", "examples"})
    if unknown:
        raise ConfigError(f"alc.{unknown[0]}", "unknown key", "use one of: public, quantile, examples")
    try:
        public = parse_dataset({"dataset": raw["public"]})
    except ConfigError as e:
        raise ConfigError(f"alc.public.{e.field.removeprefix('dataset.')}", e.problem, e.fix) from e
    return AlcSpec(public=public, **{k: v for k, v in raw.items() if k != "public"})


def check_layer_clip(layer_clip: Any, clipping: str) -> None:
    if layer_clip is None:
        return
    from dptune.config.clipping import mode

    if not mode(clipping).layerwise:
        raise ConfigError("layer_clip", "per-layer clip norms apply to clipping: alc only", "remove layer_clip")
    if not isinstance(layer_clip, Mapping) or not layer_clip or not all(
            isinstance(k, str) and isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
            and v > 0 for k, v in layer_clip.items()):
        raise ConfigError("layer_clip", f"{layer_clip!r} is not layer: clip norm > 0", "let alc compute it")
