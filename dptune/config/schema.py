"""The records of user input: one trial's config (:class:`TrialConfig`), the data (:class:`DatasetSpec`), the
privacy settings (:class:`PrivacySpec`) and a parsed search space (:class:`SearchSpace`), each checking its own
fields. Parsing a file into them and the cross-field rules live above (``dptune.config``,
``dptune.config.checks``), so this module imports neither: no cycle, not even for types.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import optuna.distributions as od

from dptune.config import clipping, params, specs, stopping
from dptune.config.planner import PlannerSpec
from dptune.errors import ConfigError, check_positive

__all__ = ["CLIPPING_MODES", "LATER_FIELDS", "MODELS", "OPTIMIZERS", "DatasetSpec", "PrivacySpec", "SearchSpace",
           "TrialConfig", "coerce_value", "later_defaults"]

MODELS = specs.BUILTIN_MODELS  # and "torchvision:<name>", "factory:<package.module>:<function>"
OPTIMIZERS = ("sgd", "nadam", "adam")
CLIPPING_MODES = clipping.choices()  # the registry's (dptune.config.clipping), with auto
# --------------------------------------------------------------------------------------------------
# one trial


@dataclass(frozen=True)
class TrialConfig:
    """Everything one DP-SGD trial needs besides the data. Privacy-relevant: batch_size, epochs,
    noise_multiplier, score_noise (None = validation split declared public).

    In a space file these are the keys of ``fixed:``; ``space:`` and ``default:`` take the searchable ones, and
    ``model:`` sets model, model_kwargs, scale_norm and fix_batchnorm. (``docs/gen_spaces.py`` turns the
    attributes below into the key reference of ``docs/spaces.md``.)

    Attributes:
        model: The network: a built-in name, ``torchvision:<name>`` or ``factory:<package.module>:<function>``;
            a space file usually names it in ``model:``.
        groups: GroupNorm groups of the built-in models (a factory receives it as ``groups``).
        scale_norm: ResNet-9 only: ScaleNorm, an extra GroupNorm after each of its two residual adds.
        learning_rate: The optimizer's learning rate. In a search that plans its final run, the final run's
            learning rate L (at batch size ``search.lr_reference_batch`` when given): each trial runs at
            L·σ_f/σ_c.
        batch_size: The expected batch size B of Poisson sampling (sampling rate q = B/n). Privacy-relevant.
        epochs: Training length in epochs, fractions allowed: T = ⌈epochs·n/B⌉ steps. Privacy-relevant.
        noise_multiplier: σ, the noise std in units of the clip norm. Privacy-relevant. Set by the budget (and
            refused in ``space:``) in a search that plans its final run.
        max_grad_norm: The clip norm C of each example's gradient (batch clipping: of the batch's mean gradient).
        optimizer: The optimizer.
        momentum: SGD's momentum, in [0, 1); nadam and adam do not use it.
        weight_decay: The optimizer's weight decay (>= 0).
        augmult: Augmentation multiplicity (De et al. 2022): augmented views of each example (random crops,
            flips for RGB images), its gradient averaged over them before clipping; 0 is off. Not for tables.
        ema_decay: Decay of an exponential moving average of the weights, which is what gets evaluated; null
            is off.
        clipping: How per-example gradient norms are computed (``docs/clipping.md``); ``batch`` and ``alc``
            change what is clipped and what is charged.
        physical_batch_size: The most examples (augmented views counted) per forward and backward pass: memory
            only, not privacy.
        score_noise: Std of the Gaussian noise on the trial's released validation correct-count; null when the
            trial releases no score. Derived from ``privacy:``, refused in ``fixed:``.
        seed: Internal: the trial's secret entropy (128 bits from the OS), drawn per trial; refused in a space.
        fix_batchnorm: Replace the model's BatchNorm layers with GroupNorm (a model with BatchNorm is refused
            otherwise, except under batch clipping).
        model_kwargs: Keyword arguments of the model's constructor or factory (``model.kwargs``; YAML data only).
        layer_clip: Clipping alc only: each layer's clip norm C_l, computed by the search from ``alc.public`` and
            carried into the release.
    """

    model: str = "gn_cnn"
    groups: int = 4
    scale_norm: bool = False
    learning_rate: float = 0.5
    batch_size: int = 128
    epochs: float = 15.0
    noise_multiplier: float = 1.0
    max_grad_norm: float = 1.0
    optimizer: str = "sgd"
    momentum: float = 0.9
    weight_decay: float = 0.0
    augmult: int = 0
    ema_decay: float | None = None
    clipping: str = "auto"
    physical_batch_size: int = 256
    score_noise: float | None = 6.0
    # Secret entropy of the trial's random streams (training noise, Poisson batches, augmentation, score
    # noise): >= 128 bits from the OS (see dpsgd.TrialStreams). It is never released: a narrow seed can be
    # enumerated to strip the Gaussian noise off a released score.
    seed: int = 0
    fix_batchnorm: bool = False
    # keyword arguments of the model's constructor or factory (YAML data only; see dptune.config.specs)
    model_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    layer_clip: dict[str, float] | None = None  # clipping alc: layer -> C_l, from public data (see specs.AlcSpec)

    def __post_init__(self) -> None:
        object.__setattr__(self, "model_kwargs", copy.deepcopy(self.model_kwargs))  # a frozen config owns it
        object.__setattr__(self, "layer_clip", None if self.layer_clip is None else copy.deepcopy(self.layer_clip))
        _check_trial(self)

    def replace(self, **changes: Any) -> TrialConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_public_dict(self) -> dict[str, Any]:
        """Everything but ``seed``: a trial's seed reproduces its DP noise, so it never leaves sealed/ or
        goes next to a model; whoever trains the config draws a fresh secret seed."""
        out = self.to_dict()
        del out["seed"]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "config") -> TrialConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"{where}.{unknown[0]}", "unknown key", f"use one of: {', '.join(sorted(known))}")
        values = {}
        for f in dataclasses.fields(cls):
            if f.name in data:
                values[f.name] = coerce_value(f"{where}.{f.name}", data[f.name], f.type)
        return cls(**values)


def coerce_value(name: str, value: Any, type_: Any) -> Any:
    t = str(type_)
    if value is None:
        if "None" in t:
            return None
        raise ConfigError(name, "is missing (null)", "give a value")
    if t.startswith("int"):
        if isinstance(value, int) and not isinstance(value, bool):
            return value  # exact at any width (a trial's 128-bit entropy does not survive a float)
        if not isinstance(value, float) or not value.is_integer():
            raise ConfigError(name, f"{value!r} is not an integer", "give a whole number")
        return int(value)
    if t.startswith("float"):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(name, f"{value!r} is not a number", "give a number")
        return float(value)
    if t.startswith("bool"):
        if not isinstance(value, bool):
            raise ConfigError(name, f"{value!r} is not true/false", "write true or false")
        return value
    if t.startswith("str"):
        if not isinstance(value, str):
            raise ConfigError(name, f"{value!r} is not a string", "give a name")
        return value
    if t.startswith("dict"):
        if not isinstance(value, Mapping):
            raise ConfigError(name, f"{value!r} is not a mapping", "write {key: value, ...}")
        return dict(value)
    if t.startswith("list"):
        if not isinstance(value, list):
            raise ConfigError(name, f"{value!r} is not a list", "write [value, ...]")
        return list(value)
    return value


def _check_trial(c: TrialConfig) -> None:
    specs.check_model(c.model)
    specs.check_model_kwargs(c.model_kwargs)
    if c.optimizer not in OPTIMIZERS:
        raise ConfigError("optimizer", f"unknown optimizer {c.optimizer!r}", f"use one of: {', '.join(OPTIMIZERS)}")
    clipping.mode(c.clipping)  # a registered mode, or ConfigError naming clipping and listing them
    specs.check_layer_clip(c.layer_clip, c.clipping)
    if not isinstance(c.groups, int) or c.groups < 1:
        raise ConfigError("groups", f"{c.groups!r} must be a positive integer", "choose e.g. 4, 8, 16 or 32")
    check_positive("noise_multiplier", c.noise_multiplier, "choose sigma > 0, e.g. 1.0")
    check_positive("max_grad_norm", c.max_grad_norm, "choose a clip norm > 0, e.g. 1.0")
    check_positive("learning_rate", c.learning_rate, "choose a learning rate > 0, e.g. 0.5 for SGD, 1e-3 for NAdam")
    check_positive("epochs", c.epochs, "choose epochs > 0")
    if not isinstance(c.batch_size, int) or c.batch_size < 1:
        raise ConfigError("batch_size", f"{c.batch_size!r} must be a positive integer", "choose e.g. 128")
    if not isinstance(c.physical_batch_size, int) or c.physical_batch_size < 1:
        raise ConfigError("physical_batch_size", f"{c.physical_batch_size!r} must be a positive integer",
                          "choose the largest batch that fits in memory, e.g. 256")
    if not 0 <= c.momentum < 1:
        raise ConfigError("momentum", f"{c.momentum!r} is not in [0, 1)", "choose e.g. 0.9, or 0 for none")
    if c.weight_decay < 0:
        raise ConfigError("weight_decay", f"{c.weight_decay!r} is negative", "choose >= 0")
    if not isinstance(c.augmult, int) or c.augmult < 0:
        raise ConfigError("augmult", f"{c.augmult!r} must be an integer >= 0", "use 0 (off) or e.g. 4, 8, 16")
    if c.ema_decay is not None and not 0 < c.ema_decay < 1:
        raise ConfigError("ema_decay", f"{c.ema_decay!r} is not in (0, 1)", "use e.g. 0.999, or null for off")
    if c.score_noise is not None:
        check_positive("score_noise", c.score_noise,
                  "choose a noise std > 0 for the released correct-count, or declare the validation split public")


# --------------------------------------------------------------------------------------------------
# search spaces


@dataclass(frozen=True)
class DatasetSpec:
    """Which data, and how it is split (the ``dataset:`` section of a space file).

    Attributes:
        name: The dataset's reader (``docs/data-and-models.md``).
        path: Where it is read from, relative to the directory you run from; digits needs none.
        validation_size: Examples held out for the validation split that scores trials.
        test_size: Examples held out for the test split (the official test split replaces it under
            ``split: official``).
        public_validation: True: the validation split is public, its scores are released exactly and not charged.
        split_seed: Seed of the deterministic split into train, validation and test.
        split: Torchvision datasets: ``official`` (the official train split gives train and validation, the
            official test split is the test split), or ``train`` or ``test`` (that split alone is the pool).
        download: Torchvision datasets: let torchvision download a missing split into ``path``.
        label: Tables: the label column.
        features: Tables: the feature columns, each with its public bounds ``[low, high]`` (clipped and scaled
            to [-1, 1] by them).
        classes: Tables and image folders (required there): the declared classes, in class order.
        id_column: Tables: the column that identifies each record, the privacy unit the ledger keys budgets on.
        pool_size: Torchvision datasets whose folder holds a subset of the split dptune reads (the pool; under
            ``official``, the train split): its number of images, which ``dptune plan`` and the search then plan on.
            Without it they assume the official split's size, and a search on a folder holding another number of
            images is refused before anything is charged.
    """

    name: str = "digits"
    path: str | None = None
    validation_size: int = 180
    test_size: int = 360
    public_validation: bool = False
    split_seed: int = 0
    split: str = "official"  # torchvision datasets: official | train | test (see dptune.config.specs)
    download: bool = False  # torchvision datasets: download into `path` if absent (never in tests)
    label: str | None = None  # table: the label column
    features: dict[str, list[float]] | None = None  # table: column -> [low, high], public bounds
    classes: list[str | int] | None = None  # table / imagefolder: the declared classes in order (required)
    # table: the column naming each record (the privacy unit the ledger keys budgets on; see dptune.ledger)
    id_column: str | None = None
    pool_size: int | None = None  # torchvision datasets: the images of a folder holding a subset of the split read

    def __post_init__(self) -> None:  # checked, and the features copied (a frozen spec owns them)
        object.__setattr__(self, "features", specs.check_dataset_fields(
            self.name, self.split, self.download, self.label, self.features, self.classes))
        specs.check_id_column(self.name, self.id_column, self.label, self.features)
        specs.check_pool_size(self.name, self.split, self.pool_size, self.validation_size, self.test_size)


# Fields added after releases were first written. A release, checkpoint or sealed run spec from before one
# existed is read with it at its default, which is what ran then (no model kwargs, the official split, no
# table); every other field must be present: a defaulted privacy or model setting would train something else.
LATER_FIELDS = {"TrialConfig": ("model_kwargs", "layer_clip"), "DatasetSpec": ("split", "download", "label", "features", "classes",
                                                                "id_column", "pool_size"),
                "PrivacySpec": ("search_share", "selection")}


def later_defaults(cls: type[TrialConfig] | type[DatasetSpec] | type[PrivacySpec]) -> dict[str, Any]:
    """The fields of ``cls`` added after the first releases, at their defaults (fresh copies)."""
    return {k: getattr(cls(), k) for k in LATER_FIELDS[cls.__name__]}


@dataclass(frozen=True)
class PrivacySpec:
    """The privacy settings of a search (the ``privacy:`` section of a space file).

    Attributes:
        delta: The δ of every (ε, δ) the search reports; it must be below 1/n_train.
        stopping: The stopping rule that draws the number of trials K (poisson, tnb), or ``composed`` for a
            fixed number of trials, each charged: a name, its settings beside it (``mean``, tnb's ``eta``), or
            a mapping ``{rule: tnb, mean: 3, eta: 0}``. The rule decides the accounting (``dptune.config.stopping``).
        mean: The mean number of trials (poisson, tnb), or the number of trials (composed).
        stopping_settings: The rule's own settings besides ``mean`` (tnb: ``eta``, the shape η of the truncated
            negative binomial: 0 logarithmic, 1 geometric), as (name, value) pairs; checked by the rule itself.
        score_noise: Noise on the validation correct-count: the std of each released score's Gaussian (selection
            best_score), or the Gumbel scale of the one noisy-max selection (selection noisy_max); null only with a
            public validation split.
        target_epsilon: The total ε planned for search and final training: the search prints the final-training
            command calibrated to it. Null: chosen at final training.
        search_share: The share of target_epsilon the search may cost. Set, the search plans its final run
            (``docs/searchers.md``); the scaled searcher needs it.
        selection: ``best_score``: every trial releases a Gaussian-noised score and the best is released (any
            searcher); ``noisy_max``: trials release nothing and one report-noisy-max picks the candidate (a
            searcher with fixed candidates: the scaled one).
    """

    delta: float = 1e-5
    stopping: str = "poisson"
    mean: float = 3.0  # mean number of trials (poisson, tnb) or the fixed number of trials (composed)
    stopping_settings: tuple[tuple[str, float], ...] = ()  # the rule's own settings besides mean (tnb: eta)
    # noise on the validation correct-count: the std of each released score's Gaussian (selection: best_score),
    # or the Gumbel scale of the one noisy-max selection (selection: noisy_max)
    score_noise: float | None = 6.0
    # the total ε the curator plans for search + final training (the search prints the final-training
    # command calibrated to it); None: the curator chooses at final training
    target_epsilon: float | None = None
    # share of target_epsilon for the search: set, the search plans its final run (every trial at a cheap σ per (B, E),
    # lr scaled to the final run's update noise: accounting.TransferPlan); the scaled searcher needs it
    search_share: float | None = None
    # best_score: every trial releases a Gaussian-noised score, the best is released (any searcher);
    # noisy_max: trials release nothing, one report-noisy-max picks the candidate (the scaled searcher)
    selection: str = "best_score"

    @property
    def trial_score_noise(self) -> float | None:
        """The noise of each trial's own score release: None when none is released per trial."""
        return None if self.selection == "noisy_max" else self.score_noise


@dataclass(frozen=True)
class SearchSpace:
    """A validated search-space file.

    Attributes:
        name: The space's name, the first part of a run's name (default: the file's name without .yaml).
        dataset: The data (``dataset:``).
        fixed: The trial settings every trial shares (``model:`` and ``fixed:``), the searched keys at their
            default values.
        space: The searched hyperparameters and their distributions (``space:``).
        default: The config released when the search draws K = 0 trials (``fixed:`` with ``default:``).
        privacy: The privacy settings (``privacy:``).
        searcher: How trials are chosen (``docs/searchers.md``).
        scheduler: ``fifo``, every trial runs to its end; ``asha``, Ray Tune's ASHAScheduler stops the trials whose
            noised rung scores lag (with ``privacy.stopping: filter``: an RDP filter admits each rung segment);
            ``own_curve``, each trial stops itself at the first rung whose noised score is not above its previous
            rung's (random stopping, every rung's score charged).
        grace_period: ASHA's (and own_curve's) first rung, in epochs.
        reduction_factor: ASHA's η: a trial goes on past a rung when its noised score is in the top 1/η there.
        tune_fraction: Run the search on a Poisson subsample of this fraction of the training split (1: off).
        lr_reference_batch: With a search that plans its final run: the searched learning rate L is the final
            run's at this batch size, and a config of batch size B trains at L·(B/``lr_reference_batch``)^p
            (p: ``lr_batch_power``, 1: the linear scaling rule; its trials at that lr times σ_f/σ_c). None: L
            is every batch size's lr.
        lr_batch_power: p above (with ``lr_reference_batch`` only; default 1).
        source: Internal: the file the space was read from.
        planner: The priors of the verdict "is this search expected to pay" (``planner:``).
        alc: Adaptive layerwise clipping's public data (``alc:``; with clipping alc only).
        auto: ``space: auto``: the public facts the space was derived from (``dptune.config.auto``), the rules'
            version and the derived space file; None for a space written by hand.
    """

    name: str
    dataset: DatasetSpec
    fixed: TrialConfig  # fixed settings; the searched keys hold their default values here
    space: dict[str, od.BaseDistribution]
    default: TrialConfig  # released when K = 0
    privacy: PrivacySpec
    searcher: str = "random"
    scheduler: str = "fifo"
    grace_period: int = 1  # asha: the first rung (epochs)
    reduction_factor: int = 3  # asha: η
    tune_fraction: float = 1.0
    lr_reference_batch: int | None = None  # the searched lr is the final run's at this batch size (linear scaling)
    lr_batch_power: float = 1.0  # lr = L·(B/lr_reference_batch)^lr_batch_power
    source: str | None = None
    planner: PlannerSpec = PlannerSpec()
    alc: specs.AlcSpec | None = None  # adaptive layerwise clipping: its public data (fixed.clipping: alc)
    # space: auto: the public facts it was derived from, the rules' version and the derived space file (a mapping)
    auto: dict[str, Any] | None = None

    @property
    def accounting(self) -> str:
        """How the search is charged, which its stopping rule decides (``dptune.config.stopping``): ``random_stopping``
        (Papernot-Steinke, K secret) or ``composed`` (a fixed number of trials, each charged; what adaptive
        searchers need). A space file's ``search.accounting``, if given, must agree."""
        return stopping.accounting_of(self.privacy.stopping)

    @property
    def transfers(self) -> bool:
        """Whether the search plans its final run: trials at a cheap σ_c(B, E) with the noise-scaled transfer."""
        return self.privacy.search_share is not None

    @property
    def baseline(self) -> TrialConfig:
        """The config a search must beat, trained once with the whole budget: ``planner.baseline`` (e.g. the
        literature's default) over the space's default, or the default itself."""
        return self.default.replace(**(self.planner.baseline or {}))

    def with_privacy(self, **changes: Any) -> SearchSpace:
        """This space with ``privacy`` settings changed, its trials' own score noise derived again (a noisy-max
        selection or a public validation split: none per trial; otherwise ``privacy.score_noise``)."""
        privacy = dataclasses.replace(self.privacy, **changes)
        sn = None if self.dataset.public_validation else privacy.trial_score_noise
        return dataclasses.replace(self, privacy=privacy, fixed=self.fixed.replace(score_noise=sn),
                                   default=self.default.replace(score_noise=sn))

    @property
    def rungs(self) -> tuple[int, ...]:
        """The epochs at which a trial releases a noised score: ASHA's rungs, or its last epoch alone (fifo)."""
        epochs = self.fixed.epochs
        if self.scheduler == "fifo":
            return (int(math.ceil(epochs)),)
        return params.asha_rungs(epochs=epochs, grace_period=self.grace_period, reduction_factor=self.reduction_factor)

    def trial_config(self, params: Mapping[str, Any], seed: int) -> TrialConfig:
        """The trial config for sampled hyperparameters ``params``."""
        return self.fixed.replace(**dict(params), seed=seed)


