"""Privacy accounting for dptune: trial events, worst case over a space, random stopping, planning.

Pure functions and frozen values; no torch, no ray, no I/O. Events are values (``_events``); two
accountants interpret them — RDP (:func:`rdp_of`, :func:`rdp_epsilon`) and PLD (:func:`pld_of`,
:func:`pld_epsilon`) — behind one interface (:class:`Accountant`, catalogue :data:`ACCOUNTANTS`), and one
function gives the ε dptune charges (:func:`epsilon`: the smaller valid bound; :func:`certify` also names the
accountant); stopping rules are the subclasses of :class:`StoppingRule` named in one catalogue
(:func:`stopping_rule`).

Modules, each importing only those above it: ``_lazy``; ``_strictmath`` (exp and log the same on every CPU);
``_grid`` (the charge grid: ε and σ rounded up); ``_roots`` (the bracket searches' crossing guess);
``_convert`` (orders, RDP → ε/δ); ``_events``;
``_amplify`` (Zhu & Wang); ``_stopping`` (Papernot & Steinke); ``_rdp`` (the RDP interpreter); ``_pld`` (the
PLD interpreter); ``_profile`` (random stopping from the trial's privacy profile); ``_mixed`` (RDP part ⊗ PLD
part); ``_accountant`` (the interface and the minimum); ``_rules``;
``_catalogue``; ``_subsample``; ``_calibrate``; ``_planner``; ``_advice``; ``_transfer``.
"""

from dptune.accounting import _lazy

_lazy.install()  # before anything imports dp_accounting: its PLD modules load on first use

# ruff: noqa: E402

from dptune.accounting._accountant import (
    ACCOUNTANTS,
    Accountant,
    Bound,
    accountant,
    certify,
    epsilon,
    tight_epsilon,
)
from dptune.accounting._advice import Advice, Candidate, advise
from dptune.accounting._amplify import poisson_subsampled_rdp
from dptune.accounting._calibrate import calibrate_noise_multiplier, calibrate_sigma, calibrate_tight
from dptune.accounting._catalogue import (
    STOPPING_RULES,
    alternative_rules,
    comparison_rules,
    register_rule,
    rule_of,
    stopping_rule,
)
from dptune.accounting._convert import ORDERS, rdp_to_epsilon
from dptune.accounting._events import (
    FILTER_SLACK,
    NoisyMaxDpEvent,
    RdpFilterDpEvent,
    SubsampledMechanismDpEvent,
    WorstCaseDpEvent,
    event_from_json,
    event_to_json,
    score_event,
    split_selection,
    trial_event,
    with_selection,
)
from dptune.accounting._filter import (
    RdpFilter,
    admits,
    filter_bound,
    filter_schedule,
    filter_text,
    segment_costs,
    segment_events,
)
from dptune.accounting._grid import EPSILON_DIGITS, SIGMA_DIGITS, round_up_epsilon, round_up_sigma
from dptune.accounting._planner import (
    Plan,
    TrialPoint,
    clipping_sensitivity,
    plan_search,
    reachable_points,
    selection_event,
    sigma_floor,
    transfer_trial_sigma,
    worst_case_event,
)
from dptune.accounting._pld import pld_epsilon, pld_of
from dptune.accounting._profile import profile_epsilon
from dptune.accounting._rdp import rdp_epsilon, rdp_of
from dptune.accounting._rules import Composed, Filter, Poisson, StoppingRule, TruncatedNegativeBinomial
from dptune.accounting._stopping import random_stopping_rdp, tnb_gamma, tnb_mean
from dptune.accounting._subsample import (
    min_subsample_size,
    search_parts,
    subsampled_search_event,
    transfer_config,
)
from dptune.accounting._transfer import (
    TransferAdvice,
    TransferPlan,
    advise_transfer,
    lr_batch_scale,
    plan_transfer,
    rehearsal_key,
)

__all__ = [
    "ACCOUNTANTS",
    "EPSILON_DIGITS",
    "SIGMA_DIGITS",
    "round_up_epsilon",
    "round_up_sigma",
    "ORDERS",
    "STOPPING_RULES",
    "Accountant",
    "Advice",
    "Bound",
    "Candidate",
    "Composed",
    "NoisyMaxDpEvent",
    "Plan",
    "Poisson",
    "TransferAdvice",
    "TransferPlan",
    "StoppingRule",
    "SubsampledMechanismDpEvent",
    "TrialPoint",
    "TruncatedNegativeBinomial",
    "WorstCaseDpEvent",
    "accountant",
    "advise",
    "alternative_rules",
    "calibrate_noise_multiplier",
    "calibrate_sigma",
    "calibrate_tight",
    "certify",
    "comparison_rules",
    "register_rule",
    "rule_of",
    "epsilon",
    "event_from_json",
    "event_to_json",
    "min_subsample_size",
    "advise_transfer",
    "clipping_sensitivity",
    "lr_batch_scale",
    "plan_transfer",
    "rehearsal_key",
    "plan_search",
    "pld_epsilon",
    "pld_of",
    "poisson_subsampled_rdp",
    "profile_epsilon",
    "random_stopping_rdp",
    "rdp_epsilon",
    "rdp_of",
    "reachable_points",
    "score_event",
    "search_parts",
    "selection_event",
    "sigma_floor",
    "split_selection",
    "stopping_rule",
    "subsampled_search_event",
    "tnb_gamma",
    "tight_epsilon",
    "tnb_mean",
    "transfer_config",
    "transfer_trial_sigma",
    "trial_event",
    "with_selection",
    "worst_case_event",
]

# Appended (the modules above are listed in the docstring): q and T from their one definition (``dptune.config.params``)
# for callers outside the library, and ``_final_run``: a final training run calibrated after the events charged
# before it, the one routine ``dptune train`` and the benches share.
from dptune.accounting._final_run import FinalCalibration, calibrate_final
from dptune.config.params import sampling_rate, trial_steps

__all__ += ["FinalCalibration", "calibrate_final", "sampling_rate", "trial_steps"]
__all__ += ["rdp_to_epsilon", "FILTER_SLACK", "Filter", "RdpFilter", "RdpFilterDpEvent", "admits", "filter_bound", "filter_schedule", "filter_text", "segment_costs",
            "segment_events"]
