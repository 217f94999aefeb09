"""Shared CLI plumbing: bad input becomes one clear line on stderr and exit status 2."""

from __future__ import annotations

import sys
from collections.abc import Callable

from dptune.config import ConfigError

__all__ = ["quiet_libraries", "run_cli"]


def quiet_libraries() -> None:
    """dp_accounting logs a warning per RDP order whose series does not converge (that order is then
    excluded, which is safe); Ray Tune warns about per-trial files dptune deliberately does not write —
    and such warnings can name trial counts, which must not reach the terminal."""
    import logging

    logging.getLogger("absl").setLevel(logging.ERROR)
    try:
        from absl import logging as absl_logging

        absl_logging.set_verbosity(absl_logging.ERROR)
    except ImportError:  # pragma: no cover
        pass
    for name in ("ray.tune", "ray.train", "ray.air"):
        logging.getLogger(name).setLevel(logging.ERROR)


def run_cli(main: Callable[[], int]) -> int:
    quiet_libraries()
    try:
        return main()
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
