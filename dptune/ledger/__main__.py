"""``python -m dptune.ledger {show,set-budget}``: budgets and charges of a ledger file (curator only)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from dptune._cli import run_cli
from dptune.errors import ConfigError
from dptune.ledger import Ledger


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m dptune.ledger", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    show = sub.add_parser("show", help="budgets and charges")
    show.add_argument("--ledger", required=True)
    show.add_argument("--json", action="store_true")
    sb = sub.add_parser("set-budget", help="set a dataset's (ε, δ) budget")
    sb.add_argument("--ledger", required=True)
    sb.add_argument("--fingerprint", required=True)
    sb.add_argument("--epsilon", type=float, required=True)
    sb.add_argument("--delta", type=float, required=True)
    sb.add_argument("--label", default="")
    return parser


def _reader(path: Path) -> Ledger:
    """The ledger for reading: opened as usual (upgrading an older schema), or read-only when its folder or
    file cannot be written (SQLite would need to create its -wal/-shm files beside it)."""
    import sqlite3

    try:
        ledger = Ledger(path)
        ledger.fingerprints()
        return ledger
    except (sqlite3.OperationalError, PermissionError):
        return Ledger(path, read_only=True)


def _show(ledger: Ledger) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for fp in ledger.fingerprints():
        b = ledger.budget(fp)
        out.append({"fingerprint": fp, "dataset_id": ledger.dataset_id(fp) if b else None,
                    "budget_epsilon": b[0] if b else None, "budget_delta": b[1] if b else None,
                    "spent_epsilon": ledger.spent(fp),
                    "charges": [{"id": c.id, "token": c.token, "name": c.name, "epsilon": c.epsilon,
                                 "status": c.status, "created": c.created} for c in ledger.charges(fp)]})
    return out


def _main(args: argparse.Namespace) -> int:
    if args.command == "show" and not Path(args.ledger).is_file():
        raise ConfigError("--ledger", f"{args.ledger!r} does not exist", "give the ledger file a search wrote")
    if args.command == "show":
        ledger = _reader(Path(args.ledger))
    else:
        ledger = Ledger(args.ledger)
    if args.command == "set-budget":
        ledger.set_budget(args.fingerprint, args.epsilon, args.delta, args.label)
        print(f"budget for {args.fingerprint[:12]}: ε = {args.epsilon:g}, δ = {args.delta:g}")
        return 0
    out = _show(ledger)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    for d in out:
        print(f"dataset {d['fingerprint'][:12]}: budget ε = {d['budget_epsilon']}, δ = {d['budget_delta']}; "
              f"spent ε = {d['spent_epsilon']:.4g} (RDP composition)")
        for c in d["charges"]:
            print(f"  #{c['id']:<4} {c['status']:<9} ε = {c['epsilon']:.4g}  {c['name']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return run_cli(lambda: _main(args))


if __name__ == "__main__":
    sys.exit(main())
