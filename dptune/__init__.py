"""dptune: differentially private hyperparameter search that charges the search itself.

Random search on Ray Tune, each trial DP-SGD (Opacus), the whole search charged with the
Papernot–Steinke random-stopping theorem (ICLR 2022). Importing this package is light: torch, Opacus
and Ray load only in the modules that need them.
"""

import logging as _logging
import warnings as _warnings
from typing import TYPE_CHECKING

# dp_accounting logs one warning per RDP order whose series does not converge (that order is then left
# out of the minimum, which is safe): noise for dptune's users, dropped here and only here.
_logging.getLogger("absl").addFilter(lambda record: "failed to converge" not in record.getMessage())

try:
    from tqdm import TqdmWarning as _TqdmWarning
except ImportError:  # pragma: no cover (optuna requires tqdm)
    _TqdmWarning = UserWarning

with _warnings.catch_warnings():
    # optuna imports tqdm.auto, which in a Jupyter kernel without ipywidgets warns "IProgress not found": dptune
    # shows no progress bar (a search's progress would tell the number of trials), so it tells its users nothing
    _warnings.filterwarnings("ignore", message="IProgress not found", category=_TqdmWarning)
    from dptune.accounting import Plan, StoppingRule, plan_search, sigma_floor
    from dptune.config import SearchSpace, TrialConfig, load_space
    from dptune.errors import ConfigError

if TYPE_CHECKING:  # loaded on first use (__getattr__, _LAZY)
    from dptune.api import FinalModel, SearchResult, plan, search, train
    from dptune.certificate import Certificate, load_certificate
    from dptune.ledger import Ledger

__version__ = "0.1.0"

__all__ = [
    "Certificate",
    "ConfigError",
    "FinalModel",
    "Ledger",
    "Plan",
    "SearchResult",
    "SearchSpace",
    "SearchStopped",
    "StoppingRule",
    "TrialConfig",
    "load_certificate",
    "load_space",
    "plan",
    "plan_search",
    "search",
    "sigma_floor",
    "train",
]


# the API, certificate and ledger names load on first use (PEP 562): a command that needs none of them (dptune plan)
# starts without the API's, the ledger's and pyarrow's imports
_LAZY = {"FinalModel": "dptune.api", "SearchResult": "dptune.api", "plan": "dptune.api", "search": "dptune.api",
         "train": "dptune.api", "Certificate": "dptune.certificate", "load_certificate": "dptune.certificate",
         "Ledger": "dptune.ledger"}


def __getattr__(name: str) -> object:
    """The names of ``_LAZY`` on first use, and ``dptune.SearchStopped`` (what a search raises once charged): its
    module is orchestration, whose import sets Ray's token mode, which ``import dptune`` alone must not do."""
    if name == "SearchStopped":
        from dptune.tuning.failures import SearchStopped

        return SearchStopped
    if name in _LAZY:
        import importlib

        with _warnings.catch_warnings():
            _warnings.filterwarnings("ignore", message="IProgress not found", category=_TqdmWarning)
            value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'dptune' has no attribute {name!r}")
