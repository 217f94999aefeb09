"""Every command of dptune, and the ``dptune`` console script: ``dptune <command> …`` is
``python -m dptune.cli.<command> …`` (search, plan, train, report, ledger; ``python -m dptune.<command> …`` for the
first four, whose entry points only run this package). Each command's module has a
``main(argv) -> exit status``; bad input is one line on stderr and status 2 (``_common.run_cli``).

The library never imports this package (``tests/test_architecture.py``); the commands call the library.
"""

from __future__ import annotations

import importlib
import sys

__all__ = ["COMMANDS", "main"]

COMMANDS = {
    "search": "private hyperparameter search on Ray Tune, charged before any trial",
    "plan": "what a search costs and whether it is expected to pay, before anything touches data",
    "train": "final DP training of a released config, composed with its search's charge",
    "report": "a curator-only HTML report of one search",
    "ledger": "budgets and charges of a privacy ledger (check, history, show, set-budget, new-budget, adopt, upgrade)",
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {what}" for name, what in COMMANDS.items()]
    return ("usage: dptune <command> [options]   (the same as python -m dptune.cli.<command>)\n\ncommands:\n"
            + "\n".join(lines) + "\n\n`dptune <command> --help` lists a command's options.")


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage(), file=sys.stdout if args else sys.stderr)
        return 0 if args else 2
    if args[0] == "--version":
        from dptune import __version__

        print(f"dptune {__version__}")
        return 0
    if args[0] not in COMMANDS:
        print(f"error: command: {args[0]!r} is not a dptune command; use one of: {', '.join(COMMANDS)}",
              file=sys.stderr)
        return 2
    module = importlib.import_module(f"dptune.cli.{args[0]}")
    return int(module.main(args[1:]))
