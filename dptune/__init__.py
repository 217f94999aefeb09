"""dptune: differentially private hyperparameter search that charges the search itself.

Random search on Ray Tune, each trial DP-SGD (Opacus), the whole search charged with the
Papernot–Steinke random-stopping theorem (ICLR 2022). Importing this package is light: torch, Opacus
and Ray load only in the modules that need them.
"""

import logging as _logging

# dp_accounting logs one warning per RDP order whose series does not converge (that order is then left
# out of the minimum, which is safe): noise for dptune's users, dropped here and only here.
_logging.getLogger("absl").addFilter(lambda record: "failed to converge" not in record.getMessage())

from dptune.accounting import Plan, StoppingRule, plan_search, sigma_floor  # noqa: E402
from dptune.api import SearchResult, plan, search, train  # noqa: E402
from dptune.certificate import Certificate, load_certificate  # noqa: E402
from dptune.config import SearchSpace, TrialConfig, load_space  # noqa: E402
from dptune.errors import ConfigError  # noqa: E402
from dptune.ledger import Ledger  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "Certificate",
    "ConfigError",
    "Ledger",
    "Plan",
    "SearchResult",
    "SearchSpace",
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
