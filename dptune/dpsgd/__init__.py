"""One DP-SGD trial (the only Opacus importer): Poisson sampling, per-sample clipping, Gaussian noise.

The privacy-relevant numbers (q, σ, T) come from :mod:`dptune.config.params`, the one formula the accountant uses
too: q = sampling_rate(B, basis), T = trial_steps(epochs, B, basis) logical steps, counted here.

Modules: ``_trial`` (run_trial), ``_loop`` (the epoch loop), ``_engines`` (per-sample gradient engines; book-keeping's in ``_bookkeeping``),
``_malloc`` (glibc keeps a step's freed temporaries: no page faults each step), ``_streams`` (random streams), ``_state`` (trial state, checkpoint, model file),
``_release`` (the score's Gaussian mechanism), ``_optim`` (Opacus optimizers: noise measured,
non-finite examples dropped), ``_charge`` (a trial refuses what was not charged), ``_validate`` (a model
checked before anything is charged: BatchNorm, Opacus' ModuleValidator, one synthetic per-sample step),
``_alc`` (adaptive layerwise clipping's per-layer clip norms, from public data only),
``_group`` (several trials of one architecture as one computation: ``run_group``), ``_groupprobe`` (what a
group runs: ``group_probe``), ``_audit`` (audit-only hooks: gradient canaries, per-step observation, deliberate
bugs; only ``dptune.audit`` uses them).
"""

# the engines of batch clipping and layerwise clipping register on import (dptune.dpsgd._engines.ENGINES)
from dptune.dpsgd._alc import layer_constants, public_examples
from dptune.dpsgd._audit import BUGS, AuditHooks
from dptune.dpsgd._batchclip import BatchClipEngine
from dptune.dpsgd._bookkeeping import BookKeepingEngine
from dptune.dpsgd._charge import ChargeMismatch
from dptune.dpsgd._checked import checked_model
from dptune.dpsgd._engines import AUTO_CLIPPING, ENGINES, Engine, engine_mode, make_engine, resolve_clipping
from dptune.dpsgd._group import ACCELERATOR_LANES, TrialCrash, architecture_key, run_group
from dptune.dpsgd._groupprobe import group_probe
from dptune.dpsgd._guard import guarded_clipping
from dptune.dpsgd._loop import padded_rows, padded_size, physical_batches
from dptune.dpsgd._optim import NoiseMeter
from dptune.dpsgd._release import ScoreRelease
from dptune.dpsgd._rungs import FilterRefused, run_rungs
from dptune.dpsgd._state import load_model, save_model
from dptune.dpsgd._streams import TrialStreams
from dptune.dpsgd._trial import TrialResult, init_model, run_trial
from dptune.dpsgd._validate import validate_model

__all__ = [
    "ACCELERATOR_LANES",
    "AUTO_CLIPPING",
    "BUGS",
    "BatchClipEngine",
    "BookKeepingEngine",
    "AuditHooks",
    "ChargeMismatch",
    "NoiseMeter",
    "ENGINES",
    "Engine",
    "ScoreRelease",
    "TrialCrash",
    "TrialResult",
    "TrialStreams",
    "architecture_key",
    "engine_mode",
    "group_probe",
    "guarded_clipping",
    "checked_model",
    "init_model",
    "run_rungs",
    "FilterRefused",
    "layer_constants",
    "load_model",
    "make_engine",
    "padded_rows",
    "padded_size",
    "physical_batches",
    "public_examples",
    "resolve_clipping",
    "run_group",
    "run_trial",
    "save_model",
    "validate_model",
]
