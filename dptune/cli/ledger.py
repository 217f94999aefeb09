"""``python -m dptune.cli.ledger {check,history,show,set-budget,new-budget,adopt,upgrade}``: budgets and charges of a ledger (curator only).

``check`` answers in about a second whether this machine and login can charge the ledger: the server reachable, the
login, its role, the ledger's id, this machine's key, writable (not a standby, not read-only); exit 2 if any fails.

``new-budget --space S`` is the one explicit way to open a budget for data that partly overlaps a budgeted
dataset, or shares a budget's record ids but not its content: it reads the space's dataset, lists every existing
budget and those whose records the data holds (by content, and record ids within a dataset), then opens the
budget; searches are charged to those too (not to a budget whose ids alone it shares: the curator declared it other
data). ``adopt --space S --dataset-id ID`` is the curator's word that the space's dataset holds budget ID's records
(a copy changed beyond the content signatures, e.g. a feature column added): the budget takes its signatures, and
its searches are charged to it. ``set-budget --dataset-id`` changes an existing budget only.

``--ledger`` is a SQLite file or a team's ``postgresql://`` URL (default: ``$DPTUNE_LEDGER``, else the per-user file).
``setup-team --ledger URL`` (the database's owner, once) creates the team ledger's tables, its triggers, the roles
``dptune_curator`` (searches) and ``dptune_admin`` (also changes budgets) and the team's curator key file; ``migrate --ledger FILE --to URL`` copies a SQLite ledger
into it (docs/operations.md, "A team ledger")."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from dptune.cli._common import run_cli
from dptune.errors import ConfigError, check_delta, check_positive, python_m
from dptune.ledger import (
    ADMIN_ROLE,
    Ledger,
    LedgerLocation,
    adopt_records,
    budget_changes,
    budget_key,
    budget_match,
    check,
    grant_roles,
    history,
    ledger_location,
    migrate,
    open_budget,
    same_records_keys,
    setup_missing,
    upgrade_schema,
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m dptune.cli.ledger", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    ck = sub.add_parser("check", help="can this machine and login charge the ledger? (reachable, login, role, key, "
                                      "writable; about a second; exit 2 if not)")
    ck.add_argument("--ledger", help="a file or postgresql:// URL (default: the ledger searches use)")
    ck.add_argument("--json", action="store_true")
    hi = sub.add_parser("history", help="every charge: when (UTC), who (the database login), what, where it stands")
    hi.add_argument("--ledger", help="a file or postgresql:// URL (default: the ledger searches use)")
    hi.add_argument("--dataset-id", help="only this budget's charges (its id, as `show` prints it)")
    hi.add_argument("--since", help="only charges made since (an ISO date or time, UTC: 2026-12-01T09:30)")
    hi.add_argument("--login", help="only charges this database login made")
    hi.add_argument("--budgets", action="store_true", help="every change of a budget instead (a team ledger's change "
                    "log: who, when, old -> new)")
    hi.add_argument("--json", action="store_true")
    up = sub.add_parser("upgrade", help="bring a team ledger's schema to this release's (as its owner; migrations "
                                        "in one transaction)")
    up.add_argument("--ledger", required=True, help="the team ledger's postgresql:// URL")
    show = sub.add_parser("show", help="budgets and charges")
    show.add_argument("--ledger", help="a file or postgresql:// URL (default: the ledger searches use)")
    show.add_argument("--json", action="store_true")
    sb = sub.add_parser("set-budget", help="set a dataset's (ε, δ) budget")
    sb.add_argument("--ledger", help="default: the per-user ledger searches use")
    sb.add_argument("--dataset-id", "--fingerprint", dest="dataset_id", required=True,
                    help="the budget's id, as `show` prints it (only an existing budget can be changed)")
    sb.add_argument("--epsilon", type=float, required=True)
    sb.add_argument("--delta", type=float, required=True)
    sb.add_argument("--label", default="")
    nb = sub.add_parser("new-budget", help="open the budget of a space's dataset (lists existing budgets first)")
    nb.add_argument("--ledger", help="default: the per-user ledger searches use")
    nb.add_argument("--space", required=True, help="the search space whose dataset gets the budget")
    nb.add_argument("--epsilon", type=float, required=True)
    nb.add_argument("--delta", type=float, required=True)
    nb.add_argument("--label", default="", help="a name for the budget (default: the dataset's name)")
    ad = sub.add_parser("adopt", help="charge a space's dataset to an existing budget (the same records, changed)")
    ad.add_argument("--ledger", help="default: the per-user ledger searches use")
    ad.add_argument("--space", required=True, help="the search space whose dataset holds the budget's records")
    ad.add_argument("--dataset-id", required=True, help="the budget's id, as `show` and the search's refusal print it")
    st = sub.add_parser("setup-team", help="create a team ledger on PostgreSQL: tables, curator role, team key")
    st.add_argument("--ledger", required=True, help="postgresql://OWNER@HOST:PORT/DB (the database's owner)")
    st.add_argument("--role", default="dptune_curator", help="the group role curators' logins are granted")
    mg = sub.add_parser("migrate", help="copy a SQLite ledger (budgets, charges, ids, key) into a team ledger")
    mg.add_argument("--ledger", help="the SQLite ledger (default: the per-user file)")
    mg.add_argument("--to", required=True, help="the team ledger: postgresql://USER@HOST:PORT/DB")
    return parser


def _reader(path: LedgerLocation) -> Ledger:
    """The ledger for reading: opened as usual (upgrading an older schema), or read-only when its folder or
    file cannot be written (SQLite would need to create its -wal/-shm files beside it). A team ledger is only
    read (it needs no key to be shown)."""
    import sqlite3

    if path.is_postgres:
        return _team_ledger(path)
    try:
        ledger = Ledger(path)
        ledger.fingerprints()
        return ledger
    except (sqlite3.OperationalError, PermissionError):
        return Ledger(path, read_only=True)


def _team_ledger(where: LedgerLocation) -> Ledger:
    """An existing team ledger, opened without setting anything up (a typo'd database is an error)."""
    ledger = Ledger(where, read_only=True)
    con = ledger._connect()
    try:
        ready = ledger._backend.set_up(con)
    finally:
        con.close()
    if not ready:
        raise ConfigError("--ledger", f"{where} holds no dptune ledger",
                          f"set it up with `{python_m('dptune.cli.ledger')} setup-team --ledger {where}`, or give the "
                          "team ledger's URL")
    return ledger


def _setup_team(args: argparse.Namespace) -> int:
    where = ledger_location(args.ledger)
    if not where.is_postgres:
        raise ConfigError("--ledger", f"{where} is not a postgresql:// URL", "give the team database's URL")
    missing = setup_missing(where, args.role)  # every privilege first: a refusal halfway would leave tables and a key
    if missing:
        raise ConfigError("--ledger", f"this login may not set the team ledger {where} up: nothing was created",
                          "ask the database's administrator to run: " + " ".join(missing))
    ledger = Ledger(where)  # tables, trigger, and the team key (written here unless DPTUNE_LEDGER_KEY names one)
    ledger.key()
    con = ledger._connect()
    try:
        grant_roles(con, args.role)
    finally:
        con.close()
    print(f"ledger: {ledger.path}")
    print(f"  tables, triggers and the roles {args.role!r} (search: open budgets, charge, close its own charges) "
          f"and {ADMIN_ROLE!r} (also change budgets: set-budget, adopt; close any charge) are set up; grant one to "
          f"each login: GRANT {args.role} TO alice; GRANT {ADMIN_ROLE} TO carol;")
    print(f"  the team's curator key: {ledger.key_path} (0600). Give each curator a copy as you give credentials "
          "(never through the database, a repository or a chat log); they keep it at the same default path or "
          "point DPTUNE_LEDGER_KEY at it")
    return 0


def _migrate(args: argparse.Namespace) -> int:
    source, to = ledger_location(args.ledger), ledger_location(args.to)
    if source.is_postgres:
        raise ConfigError("--ledger", f"{source} is not a SQLite ledger", "give the ledger file to move")
    out = migrate(source, to)
    print(f"ledger: {source} -> {to} (the file is left as it was)")
    print(f"  copied {out.budgets} budgets and {out.charges} charges; {out.already} were there already")
    for name, (a, b) in sorted(out.totals.items()):
        print(f"  {name}: spent ε = {a:.6g} in the file, {b:.6g} in the team ledger")
    if any(abs(a - b) > 1e-9 * max(1.0, a) for a, b in out.totals.values()):
        print("error: the totals differ", file=sys.stderr)
        return 1
    print(f"  from now on search with --ledger {to} (or DPTUNE_LEDGER); retire the file: its searches' final training "
          "still charges it")
    return 0


def _show(ledger: Ledger) -> list[dict[str, Any]]:
    """Every budget and its charges, by public random id and label: the key (a hash of the data) stays inside."""
    out: list[dict[str, Any]] = []
    for fp in ledger.fingerprints():
        b = ledger.budget(fp)
        out.append({"dataset_id": ledger.dataset_id(fp) if b else None, "label": ledger.label(fp, with_id=False) if b else None,
                    "budget_epsilon": b[0] if b else None, "budget_delta": b[1] if b else None,
                    "spent_epsilon": ledger.spent(fp),
                    "charges": [{"id": c.id, "token": c.token, "name": c.name, "epsilon": c.epsilon,
                                 "status": c.status, "created": c.created} for c in ledger.charges(fp)]})
    return out


def _new_budget(args: argparse.Namespace, path: LedgerLocation) -> int:
    from dptune.config import load_space
    from dptune.data import load_dataset

    check_positive("--epsilon", args.epsilon, "choose a total budget, e.g. 8")
    check_delta("--delta", args.delta)
    dataset = load_space(args.space).dataset
    data = load_dataset(dataset)
    ledger = Ledger(path)
    print(f"ledger: {ledger.path}")
    key = budget_key(ledger, data)
    for same in same_records_keys(ledger, data):  # an older dptune keyed a budget on its ids alone
        if ledger.budget(same) is not None:
            raise ConfigError("--space", f"these very records already have a budget: {ledger.label(same)}",
                              f"change it with {python_m('dptune.cli.ledger')} set-budget --dataset-id "
                              f"{ledger.dataset_id(same)}")
    found = budget_match(ledger, data, data.pool_fingerprint())
    budgets = [d for d in _show(ledger) if d["dataset_id"]]
    print(f"existing budgets ({len(budgets)}):" if budgets else "no budgets yet")
    for d in budgets:
        print(f"  {d['label']} (id {d['dataset_id']}): ε = {d['budget_epsilon']:g}, δ = {d['budget_delta']:g}, spent ε = "
              f"{d['spent_epsilon']:.4g}")
    for other in found.overlapped:  # not `key`: that names the budget opened below
        how = " (by content, under other ids or in another format)" if other in found.by_content else ""
        print(f"  this data shares records with {ledger.label(other)}{how}: its searches are charged to that budget too")
    for other in found.by_ids:
        print(f"  this data shares record ids with {ledger.label(other)} but not their content: opened as other data, "
              "its searches are not charged to that budget. If these are its records (changed), do not open a budget: "
              f"{python_m('dptune.cli.ledger')} adopt --ledger {ledger.path} --space {args.space} --dataset-id "
              f"{ledger.dataset_id(other)}")
    if data.record_ids is None:
        print("  note: no dataset.id_column: the ledger knows this table's records by their content only")
    open_budget(ledger, data, args.epsilon, args.delta, label=args.label or dataset.name)
    print(f"opened the budget of {ledger.label(key)}: ε = {args.epsilon:g}, δ = {args.delta:g}")
    return 0


def _adopt(args: argparse.Namespace, path: LedgerLocation) -> int:
    from dptune.config import load_space
    from dptune.data import load_dataset

    if not path.is_postgres and not path.path.is_file():
        raise ConfigError("--ledger", f"{str(path)!r} does not exist", "give the ledger file a search wrote")
    ledger = Ledger(path)
    key = ledger.budget_key(args.dataset_id)  # refuses an id that names no budget
    data = load_dataset(load_space(args.space).dataset)
    found = budget_match(ledger, data, data.pool_fingerprint())
    adopt_records(ledger, key, data, command=f"adopt --space {args.space}")
    print(f"ledger: {ledger.path}")
    if key not in found.overlapped and key not in found.by_ids:
        print(f"  note: this data shared neither content nor record ids with {ledger.label(key)}: adopted as you said")
    print(f"this data's searches are charged to the budget of {ledger.label(key)} (it holds that budget's records)")
    return 0


def _check(args: argparse.Namespace) -> int:
    findings = check(args.ledger)
    if args.json:
        print(json.dumps([{"check": f.name, "ok": f.ok, "found": f.said} for f in findings], indent=2))
    else:
        print(f"ledger: {ledger_location(args.ledger)}")
        for f in findings:
            print(f"  {'ok  ' if f.ok else 'FAIL'}  {f.name}: {f.said}")
    return 0 if all(f.ok for f in findings) else 2


def _history(args: argparse.Namespace, ledger: Ledger) -> int:
    read = budget_changes if args.budgets else history
    rows = read(ledger, dataset_id=args.dataset_id, since=args.since, login=args.login)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for r in rows:
        if args.budgets:
            change = "; ".join(f"{k}: {_shown(old)} -> {_shown(new)}" for k, (old, new) in r["changes"].items())
            print(f"#{r['id']:<4} {r['at']}  {r['op']:<6} {r['login']:<16} budget {r['budget'] or '-'} (id "
                  f"{r['dataset_id'] or '-'})  {change}")
            continue
        closer = f" by {r['closed_by']}" if r["closed_by"] and r["closed_by"] != r["login"] else ""
        print(f"#{r['id']:<4} {r['created']}  {r['status']:<9} {r['login'] or '(before schema 2)':<16} "
              f"ε = {r['epsilon']:.4g}  {r['name']}  budget {r['budget'] or '-'}"
              + (f"  closed {r['closed']}{closer}" if r["closed"] else ""))
    return 0


def _shown(value: Any) -> str:
    return "-" if value is None else str(value)


def _upgrade(args: argparse.Namespace) -> int:
    where = ledger_location(args.ledger)
    if not where.is_postgres:
        raise ConfigError("--ledger", f"{where} is not a team ledger", "a file ledger upgrades itself when opened")
    before, after = upgrade_schema(_team_ledger(where))
    print(f"ledger: {where}: schema {before} -> {after}" + (" (already current)" if before == after else ""))
    return 0


def _main(args: argparse.Namespace) -> int:
    if args.command == "check":
        return _check(args)
    if args.command == "upgrade":
        return _upgrade(args)
    if args.command == "setup-team":
        return _setup_team(args)
    if args.command == "migrate":
        return _migrate(args)
    path = ledger_location(args.ledger)
    if args.command == "new-budget":
        return _new_budget(args, path)
    if args.command == "adopt":
        return _adopt(args, path)
    if not path.is_postgres and not path.path.is_file():  # Ledger() would create it: a typo must be an error
        raise ConfigError("--ledger", f"{str(path)!r} does not exist", "give the ledger file a search wrote")
    if path.is_postgres:
        _team_ledger(path)
    ledger = _reader(path) if args.command in ("show", "history") else Ledger(path)
    print(f"ledger: {ledger.path}", file=sys.stderr)
    if args.command == "history":
        return _history(args, ledger)
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
        name = f"{d['label']} (id {d['dataset_id']})" if d["dataset_id"] else "charges without a budget"
        print(f"{name}: budget ε = {d['budget_epsilon']}, δ = {d['budget_delta']}; "
              f"spent ε = {d['spent_epsilon']:.4g} (composed events; the smaller of the RDP and PLD bounds)")
        for c in d["charges"]:
            print(f"  #{c['id']:<4} {c['status']:<9} ε = {c['epsilon']:.4g}  {c['name']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return run_cli(lambda: _main(args))


if __name__ == "__main__":
    sys.exit(main())
