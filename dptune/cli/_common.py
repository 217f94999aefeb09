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

__all__ = ["add_space_arguments", "auto_text", "quiet_libraries", "run_cli", "space_from_args"]


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


def add_space_arguments(p: Any, *, required: bool = True) -> None:
    """``--space FILE`` or ``--data …`` (a space derived from the data's public facts), ``--target-epsilon`` and
    ``--hardware`` (``space: auto`` only)."""
    g = p.add_mutually_exclusive_group(required=required)
    g.add_argument("--space", help="search-space YAML, e.g. search_spaces/digits.yaml (space: auto derives it)")
    g.add_argument("--data", help="derive the whole space from the data's public facts (space: auto): digits, "
                   "NAME:PATH (e.g. mnist:data/mnist), or a YAML file with a dataset: section; with --target-epsilon")
    p.add_argument("--hardware", choices=("cpu", "gpu"), default="cpu",
                   help="space: auto: the hardware trials run on (sets only the examples per pass, never statistics)")


def space_from_args(args: Any, *, n_train: int | None = None, count: bool = False) -> Any:
    """The space of ``--space`` or ``--data`` (``--target-epsilon`` and ``--hardware``: a derived space's budget and
    hardware). ``count``: a derived space on a table or image folder is sized on its counted training split (the
    search reads the data anyway)."""
    from dptune.config import auto, load_space, parse_space

    derive: dict[str, Any] = {"n_train": n_train, "count_train": _counted_train_size if count else None,
                              "target_epsilon": getattr(args, "target_epsilon", None),
                              "hardware": getattr(args, "hardware", "cpu")}
    if getattr(args, "data", None) is None:
        return load_space(args.space, **derive)
    return parse_space({"dataset": _data_section(args.data), "space": auto.AUTO}, None, **derive)


def _data_section(text: str) -> dict[str, Any]:
    """``--data``: a YAML file (its ``dataset:`` section, or the file itself), ``NAME`` or ``NAME:PATH``."""
    from pathlib import Path

    import yaml

    if text.endswith((".yaml", ".yml")):
        p = Path(text)
        if not p.is_file():
            raise ConfigError("--data", f"file {text!r} does not exist", "pass a YAML file with a dataset: section")
        raw = yaml.safe_load(p.read_text())
        section = raw.get("dataset", raw) if isinstance(raw, dict) else None
        if not isinstance(section, dict):
            raise ConfigError("--data", f"{text!r} holds no dataset: mapping", "write dataset: {name: …, path: …}")
        return dict(section)
    name, _, path = text.partition(":")
    return {"name": name, **({"path": path} if path else {})}


def _counted_train_size(spec: Any) -> int:
    """A table's or image folder's training split, counted (its size only; the search reads the same data)."""
    from dptune.data import train_size

    return train_size(spec)


def auto_text(released: dict[str, Any]) -> str:
    """A derived space (``release.public_auto``) as the terminal shows it: the facts, then the space file."""
    import yaml

    facts = released["facts"]
    head = (f"space: auto (rules v{released['rules']}), derived from public facts only: {facts['kind']} "
            f"{'x'.join(str(d) for d in facts['shape'])}, {facts['classes']} classes, {facts['n_train']} training / "
            f"{facts['validation_size']} validation examples, total epsilon {facts['target_epsilon']:g}, delta "
            f"{facts['delta']:g}, {facts['hardware']}")
    body = yaml.safe_dump({k: v for k, v in released["space"].items() if k != "dataset"}, sort_keys=False,
                          default_flow_style=None, width=116)
    return head + "\n" + "\n".join("  " + line for line in body.rstrip().splitlines())
