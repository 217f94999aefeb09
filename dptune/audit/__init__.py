"""Empirical privacy audits of dptune: a developer tool (``bench/audit.py``, ``tests/test_audit.py``); no search,
release or CLI uses it.

Steinke, Nasr & Jagielski's one-run audit (NeurIPS 2023): m canaries, each included with probability 1/2, one
real dptune training run (``dptune.dpsgd.run_trial`` with its audit-only hooks), a score per canary, guesses on
the highest and lowest scores, and the number of correct guesses turned into an ε lower bound at 95 %
confidence. A lower bound above a certificate's ε means the trainer does not do what its certificate claims.

Modules: ``_bound`` (guesses → ε lower bound, pure math), ``_fdp`` (the sharper f-DP bound of Mahloujifar,
Melis & Chaudhuri 2024 on the same guesses), ``_canaries`` (Dirac and input canaries and the audited training
split), ``_features`` (feature canaries: white-box canaries that are ordinary training examples of an audit model,
so every clipping engine, bookkeeping and ghost included, is audited on its own code path), ``_observe`` (audited
trials and searches, what each threat model sees, canary scores).
"""

from dptune.audit._bound import (
    Audit,
    Guesses,
    audit_epsilon,
    epsilon_lower_bound,
    guess_grid,
    guesses,
    p_value,
)
from dptune.audit._canaries import Canaries, audit_basis, audit_splits, draw_canaries
from dptune.audit._fdp import FdpAudit, audit_fdp, fdp_epsilon_lower_bound, gdp_epsilon, gdp_mu_lower_bound
from dptune.audit._features import (
    AUDIT_MODEL,
    FEATURE_VALUE,
    FeatureCanaries,
    FeatureCanaryModel,
    column_directions,
    draw_feature_canaries,
    feature_audit_basis,
    feature_audit_config,
    feature_audit_splits,
)
from dptune.audit._observe import (
    CANARY_GRADIENT,
    FeatureObservation,
    Observation,
    SearchObservation,
    black_box_scores,
    column_sums,
    feature_signals,
    feature_white_box_scores,
    ideal_white_box_scores,
    noised_sums,
    observed_feature_trial,
    observed_search,
    observed_trial,
    white_box_scores,
)
from dptune.config.params import (  # the trainer's q and T, for benches (public imports only)
    sampling_rate,
    trial_steps,
)

__all__ = [
    "AUDIT_MODEL",
    "CANARY_GRADIENT",
    "FEATURE_VALUE",
    "Audit",
    "FdpAudit",
    "FeatureCanaries",
    "FeatureCanaryModel",
    "FeatureObservation",
    "Canaries",
    "Guesses",
    "Observation",
    "SearchObservation",
    "audit_basis",
    "audit_epsilon",
    "audit_fdp",
    "audit_splits",
    "black_box_scores",
    "column_directions",
    "column_sums",
    "draw_canaries",
    "draw_feature_canaries",
    "epsilon_lower_bound",
    "fdp_epsilon_lower_bound",
    "feature_audit_basis",
    "feature_audit_config",
    "feature_audit_splits",
    "feature_signals",
    "feature_white_box_scores",
    "gdp_epsilon",
    "gdp_mu_lower_bound",
    "guess_grid",
    "guesses",
    "ideal_white_box_scores",
    "noised_sums",
    "observed_feature_trial",
    "observed_search",
    "observed_trial",
    "p_value",
    "sampling_rate",
    "trial_steps",
    "white_box_scores",
]
