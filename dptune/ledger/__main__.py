"""``python -m dptune.ledger {show,set-budget}``: budgets and charges of a ledger file (curator only)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from dptune._cli import run_cli
from dptune.errors import ConfigError, check_delta, check_positive
from dptune.ledger import Ledger, default_ledger_path


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m dptune.ledger", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    show = sub.add_parser("show", help="budgets and charges")
    show.add_argument("--ledger", help="default: the per-user ledger searches use")
    show.add_argument("--json", action="store_true")
    sb = sub.add_parser("set-budget", help="set a dataset's (ε, δ) budget")
    sb.add_argument("--ledger", help="default: the per-user ledger searches use")
    sb.add_argument("--dataset-id", "--fingerprint", dest="dataset_id", required=True,
                    help="the budget's id, as `show` prints it (only an existing budget can be changed)")
    sb.add_argument("--epsilon", type=float, required=True)
    sb.add_argument("--delta", type=float, required=True)
    sb.add_argument("--label", default="")
    return parser


def _show(ledger: Ledger) -> list[dict[str, Any]]:
    """Every budget and its charges, by public random id and label: the key (a hash of the data) stays inside."""
    out: list[dict[str, Any]] = []
    for fp in ledger.fingerprints():
        b = ledger.budget(fp)
        out.append({"dataset_id": ledger.dataset_id(fp) if b else None, "label": ledger.label(fp) if b else None,
                    "budget_epsilon": b[0] if b else None, "budget_delta": b[1] if b else None,
                    "spent_epsilon": ledger.spent(fp),
                    "charges": [{"id": c.id, "token": c.token, "name": c.name, "epsilon": c.epsilon,
                                 "status": c.status, "created": c.created} for c in ledger.charges(fp)]})
    return out


def _main(args: argparse.Namespace) -> int:
    path = Path(args.ledger).expanduser() if args.ledger else default_ledger_path()
    if not path.is_file():  # Ledger() would create it: a typo must be an error, not an empty ledger
        raise ConfigError("--ledger", f"{str(path)!r} does not exist", "give the ledger file a search wrote")
    ledger = Ledger(path)
    print(f"ledger: {ledger.path}", file=sys.stderr)
    if args.command == "set-budget":
        check_positive("--epsilon", args.epsilon, "choose a total budget, e.g. 8")
        check_delta("--delta", args.delta)
        key = ledger.budget_key(args.dataset_id)  # refuses an id that names no budget (no phantom budget)
        ledger.set_budget(key, args.epsilon, args.delta, args.label)
        print(f"budget of {ledger.label(key)}: ε = {args.epsilon:g}, δ = {args.delta:g}")
        return 0
    out = _show(ledger)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    for d in out:
        name = d["label"] or "charges without a budget"
        print(f"{name}: budget ε = {d['budget_epsilon']}, δ = {d['budget_delta']}; "
              f"spent ε = {d['spent_epsilon']:.4g} (RDP composition)")
        for c in d["charges"]:
            print(f"  #{c['id']:<4} {c['status']:<9} ε = {c['epsilon']:.4g}  {c['name']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return run_cli(lambda: _main(args))


if __name__ == "__main__":
    sys.exit(main())
