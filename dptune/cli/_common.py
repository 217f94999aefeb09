"""Shared CLI plumbing: bad input becomes one clear line on stderr and exit status 2; a reader that leaves the
pipe early (``dptune ledger show | head``) ends the output, not the command."""

from __future__ import annotations

import contextlib
import errno
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any, TextIO

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


class _PipeSafeStdout:
    """stdout that outlives its reader: on a broken pipe it points the descriptor at /dev/null and goes on, so
    ``dptune plan … | head`` prints no traceback and a search piped into ``head`` still runs to its release."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def _gone(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())  # also what child processes and the exit-time flush see
            os.close(devnull)

    def _retry(self, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except OSError as e:
            if e.errno != errno.EPIPE:
                raise
            self._gone()
            with contextlib.suppress(OSError):
                return call()  # the buffered text now drains into /dev/null
            return None

    def write(self, text: str) -> int:
        self._retry(lambda: self._stream.write(text))
        return len(text)

    def flush(self) -> None:
        self._retry(self._stream.flush)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextlib.contextmanager
def _pipe_safe_stdout() -> Iterator[None]:
    before = sys.stdout
    sys.stdout = _PipeSafeStdout(before)  # type: ignore[assignment]
    try:
        yield
        sys.stdout.flush()
    finally:
        sys.stdout = before


def run_cli(main: Callable[[], int]) -> int:
    quiet_libraries()
    try:
        with _pipe_safe_stdout():
            return main()
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
