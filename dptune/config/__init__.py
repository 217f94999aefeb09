"""What a valid search space is: user input (space files, trial configs) validated in one place.

Every problem is a :class:`ConfigError` that names the field and says how to fix it; the CLIs turn it into exit
status 2 before anything is charged or run. The package's files, bottom up:

* ``params``: the one definition of q = B/basis and T = ⌈epochs·basis/B⌉ (the trainer and the accountant call it);
* ``clipping``, ``stopping``: the clipping-mode and stopping-rule registries (what each mode costs; each rule's
  settings and the accounting it implies), filled where each mode's engine and each rule are written;
* ``specs``: the ``model:`` / ``dataset:`` / ``planner:`` / ``alc:`` syntax;
* ``distributions``: a space's distributions (parsing, support, sampling);
* ``schema``: the records (:class:`TrialConfig`, :class:`DatasetSpec`, :class:`PrivacySpec`, :class:`SearchSpace`),
  each checking its own fields;
* ``searchers/``: the searcher registry (each searcher's own space rules, the accounting it needs, its draw);
* ``checks``: a space's cross-field rules (privacy settings, rule 7, a space that plans its final run);
* ``load``: a YAML file or a dict parsed into the records, then the checks.

The names below are the package's public face (``from dptune.config import load_space``).
"""

from __future__ import annotations

from dptune.config.checks import (
    ACCOUNTING_MODES,
    INTERNAL_FIELDS,
    SCHEDULERS,
    SEARCHABLE,
    SEARCHERS,
    check_accounting,
    check_adaptive,
    check_privacy,
    check_space,
    check_trial_score_noise,
)
from dptune.config.distributions import support_extremes, support_values
from dptune.config.load import load_space, nominal_train_size, official_pool, parse_space
from dptune.config.planner import PlannerSpec
from dptune.config.schema import (
    CLIPPING_MODES,
    LATER_FIELDS,
    MODELS,
    OPTIMIZERS,
    DatasetSpec,
    PrivacySpec,
    SearchSpace,
    TrialConfig,
    coerce_value,
    later_defaults,
)
from dptune.errors import ConfigError

__all__ = ["ACCOUNTING_MODES", "CLIPPING_MODES", "INTERNAL_FIELDS", "LATER_FIELDS", "MODELS", "OPTIMIZERS",
           "SCHEDULERS", "SEARCHABLE", "SEARCHERS", "ConfigError", "DatasetSpec", "PlannerSpec", "PrivacySpec",
           "SearchSpace", "TrialConfig", "check_accounting", "check_adaptive", "check_privacy", "check_space",
           "check_trial_score_noise", "coerce_value", "later_defaults", "load_space", "nominal_train_size",
           "official_pool", "parse_space", "support_extremes", "support_values"]
