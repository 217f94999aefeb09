"""Which model and which data: the space-file syntax of ``model:`` and ``dataset:``, checked without torch; and
the ``planner:`` section (the verdict's priors, measured on a public proxy task).

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

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dptune.errors import ConfigError, check_positive

__all__ = ["BUILTIN_MODELS", "DATASETS", "DATASET_SPLITS", "VISION_SIZES", "PlannerSpec", "check_dataset_fields",
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
        if self.kind_gain is not None and self.kind_gain_se is not None:
            gain, se = _rehearsal(self.kind_gain, "planner.kind_gain"), _rehearsal(self.kind_gain_se, "planner.kind_gain_se")
            if set(se) != set(gain) or any(v <= 0 for v in se.values()):
                raise ConfigError("planner.kind_gain_se", f"{self.kind_gain_se!r} is not a standard error > 0 for "
                                  f"each epsilon of planner.kind_gain {sorted(gain)}", "give one per epsilon")
            object.__setattr__(self, "kind_gain", gain)
            object.__setattr__(self, "kind_gain_se", se)
        if self.rehearsal_se is not None and self.rehearsal is None:
            raise ConfigError("planner.rehearsal_se", "is given without planner.rehearsal",
                              "give the rehearsed gains (planner.rehearsal) it is the standard error of, or remove it")
        if self.rehearsal is not None:
            object.__setattr__(self, "rehearsal", _rehearsal(self.rehearsal))
            if self.rehearsal_se is not None:
                se = _rehearsal(self.rehearsal_se, "planner.rehearsal_se")
                if set(se) != set(self.rehearsal) or any(v <= 0 for v in se.values()):
                    raise ConfigError("planner.rehearsal_se", f"{self.rehearsal_se!r} is not a standard error > 0 for "
                                      f"each rehearsed epsilon {sorted(self.rehearsal)}",
                                      "copy the std errors bench/rehearsal_sim.py printed beside the gains")
                object.__setattr__(self, "rehearsal_se", se)
            if not isinstance(self.rehearsal_of, str) or not re.fullmatch(r"[0-9a-f]{16}", self.rehearsal_of):
                raise ConfigError("planner.rehearsal_of", f"{self.rehearsal_of!r} is not the rehearsed search's key",
                                  "copy the rehearsal_of line bench/proxy_priors.py --rehearse printed with it")
        if not isinstance(self.proxy, str) or not self.proxy.strip():
            raise ConfigError("planner.proxy", f"{self.proxy!r} is not a name", "name the public proxy task")
        for key in ("accuracy_spread", "loss_per_noise_doubling"):
            check_positive(f"planner.{key}", getattr(self, key), "give a prior measured on a public proxy task")
        if not (math.isfinite(self.min_gain) and self.min_gain >= 0):
            raise ConfigError("planner.min_gain", f"{self.min_gain!r} must be >= 0", "choose e.g. 0.005")


def _rehearsal(raw: Mapping[Any, Any], field: str = "planner.rehearsal") -> dict[float, float]:
    if not isinstance(raw, Mapping):
        raise ConfigError(field, f"{raw!r} is not a mapping", "write {epsilon: value, ...}, e.g. {1: -0.012, 2: 0.008}")
    out = {}
    for key, value in raw.items():
        e = float(key) if isinstance(key, int | float) and not isinstance(key, bool) else math.nan
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
