"""Budget contention on one ledger (issue 42): searches racing for a budget with room for exactly 5 of them.

    python -m bench.ledger_contention [--searches 8] [--room 5] [--reservations 25] [--out bench/results/ledger_contention]

PostgreSQL: two "machines" (separate HOMEs, each holding a copy of the team key; one real server started by
tests/pg.py on a loopback port) start ``--searches`` CLI searches at once (``python -m dptune.search`` on the digits
space, no --budget-epsilon: each finds the budget by its data's content; K = 0 by the test hook, so no trial runs and
the race is the ledger's), against a budget whose RDP composition fits exactly ``--room`` of them. Expected: exactly
``room`` charged (and committed), the rest refused with exit 2 before any trial (no run folder), total ≤ budget.
The same race on a SQLite file with one machine, side by side. Then reservations per second under contention: 8
processes (PostgreSQL: 4 per machine) each reserve-and-commit ``--reservations`` times on one budget with room.
Writes ``<out>.json`` and ``<out>.md``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

SPACE = ROOT / "search_spaces" / "digits.yaml"


def _budget_for(ledger: Any, room: int) -> tuple[str, float, float]:
    """Open the digits budget so that ``room`` searches compose under it and ``room + 1`` do not."""
    from dptune import accounting as A
    from dptune.accounting import plan_search
    from dptune.config import load_space
    from dptune.data import load_dataset
    from dptune.ledger import open_budget

    space = load_space(SPACE)
    data = load_dataset(space.dataset)
    event = plan_search(space, int(len(data.train[1])), compare=False).search_event
    delta = space.privacy.delta
    fits, over = A.epsilon([event] * room, delta), A.epsilon([event] * (room + 1), delta)
    budget = (fits + over) / 2
    return open_budget(ledger, data, budget, delta, label="digits"), budget, fits


def _env(home: Path, key: Path | None) -> dict[str, str]:
    from tests.conftest import digits_seed_with_k

    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "DPTUNE_"))}
    env.update(HOME=str(home), PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1",
               DPTUNE_TEST_DRAW_SEED=str(digits_seed_with_k(0, 0)))
    if key is not None:
        env["DPTUNE_LEDGER_KEY"] = str(key)
    return env


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def race(where: str, machines: list[dict[str, str]], n: int, work: Path) -> dict[str, Any]:
    """``n`` searches started at once, spread over ``machines``; what each ended with."""
    _say(f"race: {n} searches on {where}")
    procs = []
    t0 = time.perf_counter()
    for i in range(n):
        cmd = [sys.executable, "-m", "dptune.search", "--space", str(SPACE), "--name", f"s{i}", "--runs-dir",
               str(work / "runs"), "--ledger", where]
        procs.append(subprocess.Popen(cmd, env=machines[i % len(machines)], cwd=work, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=900) for p in procs]
    wall = time.perf_counter() - t0
    codes = [p.returncode for p in procs]
    refused = [i for i, c in enumerate(codes) if c == 2]
    return {"exit_codes": codes, "charged": sum(c == 0 for c in codes), "refused_exit_2": len(refused),
            "refused_over_budget": sum("over its budget" in outs[i][1] for i in refused),
            "refused_without_run_folder": sum(not (work / "runs" / f"s{i}").exists() for i in refused),
            "wall_s": round(wall, 1)}


def _hammer(where: str, key: str | None, fp: str, n: int, q: Any) -> None:
    import math as m

    from dp_accounting import dp_event as de

    from dptune import accounting as A
    from dptune.ledger import Ledger

    if key:
        os.environ["DPTUNE_LEDGER_KEY"] = key
    led = Ledger(where)
    ev = de.RepeatAndSelectDpEvent(A.trial_event(noise_multiplier=50.0, sampling_rate=0.01, steps=10,
                                                 score_noise=50.0), 1.0, m.inf)
    q.put("ready")
    t = time.perf_counter()
    for i in range(n):
        led.commit(led.reserve(fp, f"r{os.getpid()}-{i}", ev))
    q.put(time.perf_counter() - t)


def throughput(where: str, keys: list[str | None], n: int) -> dict[str, Any]:
    from dptune.ledger import Ledger

    if keys[0]:
        os.environ["DPTUNE_LEDGER_KEY"] = str(keys[0])
    _say(f"throughput: 8 processes x {n} reservations on {where}")
    fp = "bench-" + os.urandom(8).hex()
    Ledger(where).set_budget(fp, 1e9, 1e-5)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_hammer, args=(where, keys[i % len(keys)], fp, n, q)) for i in range(8)]
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    results = [q.get(timeout=900) for _ in range(16)]
    for p in procs:
        p.join(timeout=60)
    wall = time.perf_counter() - t0
    times = [r for r in results if r != "ready"]
    led = Ledger(where)
    total = len(led.charges(fp))
    closed = all(c.status == "committed" for c in led.charges(fp))
    return {"processes": 8, "reservations": total, "all_committed": closed,
            "reservations_per_s": round(total / max(times), 1), "wall_s_with_startup": round(wall, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--searches", type=int, default=8)
    ap.add_argument("--room", type=int, default=5)
    ap.add_argument("--reservations", type=int, default=25)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "ledger_contention"))
    args = ap.parse_args()
    from dptune.ledger import Ledger
    from tests.pg import pg_server

    work = Path(tempfile.mkdtemp(prefix="dptune-bench-ledger-"))
    result: dict[str, Any] = {"command": " ".join(["python -m bench.ledger_contention", *sys.argv[1:]]),
                              "cpus": os.cpu_count()}
    try:
        with pg_server() as pg:
            pg.sql('CREATE DATABASE "team"')
            url = pg.url("team")
            key = work / "team.key"
            os.environ["DPTUNE_LEDGER_KEY"] = str(key)
            fp, budget, fits = _budget_for(Ledger(url), args.room)
            machines = []
            for name in ("machine-a", "machine-b"):
                (work / name).mkdir()
                shutil.copy2(key, work / name / "team.key")
                machines.append(_env(work / name, work / name / "team.key"))
            (work / "pg").mkdir()
            r = race(url, machines, args.searches, work / "pg")
            led = Ledger(url)
            r.update(budget_epsilon=budget, room_epsilon=fits, spent_epsilon=led.spent(fp),
                     charges=len(led.charges(fp)), all_committed=all(c.status == "committed" for c in led.charges(fp)))
            result["postgresql_race"] = r
            result["postgresql_throughput"] = throughput(url, [str(work / m / "team.key") for m in
                                                               ("machine-a", "machine-b")], args.reservations)
        os.environ.pop("DPTUNE_LEDGER_KEY", None)
        (work / "sq").mkdir()
        path = str(work / "sq" / "ledger.sqlite")
        fp, budget, fits = _budget_for(Ledger(path), args.room)
        (work / "machine-s").mkdir()
        r = race(path, [_env(work / "machine-s", None)], args.searches, work / "sq")
        led = Ledger(path)
        r.update(budget_epsilon=budget, room_epsilon=fits, spent_epsilon=led.spent(fp), charges=len(led.charges(fp)),
                 all_committed=all(c.status == "committed" for c in led.charges(fp)))
        result["sqlite_race"] = r
        result["sqlite_throughput"] = throughput(path, [None], args.reservations)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(_markdown(result, args))
    print(out.with_suffix(".md").read_text())
    ok = all(result[f"{b}_race"]["charged"] == args.room and result[f"{b}_race"]["refused_exit_2"] ==
             args.searches - args.room and result[f"{b}_race"]["spent_epsilon"] <= result[f"{b}_race"]["budget_epsilon"]
             and result[f"{b}_race"]["all_committed"] for b in ("postgresql", "sqlite"))
    return 0 if ok else 1


def _markdown(r: dict[str, Any], args: argparse.Namespace) -> str:
    rows = []
    for b, machines in (("postgresql", 2), ("sqlite", 1)):
        x, t = r[f"{b}_race"], r[f"{b}_throughput"]
        rows.append(f"| {b} | {machines} | {args.searches} | {x['charged']} | {x['refused_exit_2']} "
                    f"({x['refused_over_budget']} over budget, {x['refused_without_run_folder']} without a run folder) | "
                    f"{x['spent_epsilon']:.4f} ≤ {x['budget_epsilon']:.4f} | {x['all_committed']} | "
                    f"{t['reservations_per_s']} ({t['reservations']} by 8 processes) |")
    return "\n".join([
        "# Ledger contention: searches racing for a budget with room for exactly "
        f"{args.room} (issue 42)", "",
        f"`{r['command']}` on a {r['cpus']}-CPU machine (shared with other work: wall times are indicative). Each "
        "search is the CLI digits search (K = 0 by the test hook, so the race is the ledger's); PostgreSQL 15 on "
        "loopback, started by tests/pg.py; two machines = two HOMEs with a copy of the team key.", "",
        "| ledger | machines | searches | charged | refused (exit 2) | spent ε ≤ budget ε | all closed | "
        "reserve+commit per second under contention |",
        "|---|---|---|---|---|---|---|---|", *rows, "",
        f"Race wall time (8 Python processes loading torch and the data): PostgreSQL {r['postgresql_race']['wall_s']} s, "
        f"SQLite {r['sqlite_race']['wall_s']} s.", ""])


if __name__ == "__main__":
    sys.exit(main())
