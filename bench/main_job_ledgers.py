"""The digits main job on both ledgers, side by side in one run (issue 42): the same certificate fields and total ε.

    python -m bench.main_job_ledgers

Runs `make search`'s command (search_spaces/digits.yaml, a fresh budget of ε 30) and the printed final training
twice — on a SQLite file and on a PostgreSQL team ledger (a throwaway server on loopback, started as
tests/pg.py starts it) — then prints the certificate fields that must agree and the fields that differ because
they bind the ledger (its charge ids, tokens, MAC).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SAME = ("epsilon", "delta", "bound", "accountant", "stopping", "events", "guarantee", "format")


def _run(args: list[str], env: dict[str, str]) -> str:
    r = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(args[:3])} failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return r.stdout


def _job(ledger: str, work: Path, env: dict[str, str]) -> dict[str, object]:
    runs = work / "runs"
    _run(["-m", "dptune.search", "--space", "search_spaces/digits.yaml", "--ledger", ledger, "--budget-epsilon", "30",
          "--runs-dir", str(runs), "--name", "main", "--num-cpus", "2"], env)
    release = runs / "main" / "release"
    _run(["-m", "dptune.train", "--release", str(release), "--out", str(runs / "main" / "final"),
          "--train-on-validation", "--ledger", ledger], env)
    search = json.loads((release / "certificate.json").read_text())
    final = json.loads((runs / "main" / "final" / "certificate.json").read_text())
    metrics = json.loads((runs / "main" / "final" / "metrics.json").read_text())
    return {"search": search, "final": final, "accuracy": metrics["test_accuracy"]}


def _short(value: object) -> str:
    return json.dumps(value)[:60]


def main() -> None:
    from tests.pg import pg_server

    with tempfile.TemporaryDirectory() as tmp, pg_server() as server:
        base = {**os.environ, "HOME": str(Path(tmp) / "home"), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        Path(base["HOME"]).mkdir()
        db = server.new_database("mainjob")
        url = server.url(db)
        _run(["-m", "dptune.cli.ledger", "setup-team", "--ledger", url], base)
        jobs = {"sqlite": _job(str(Path(tmp) / "ledger.sqlite"), Path(tmp) / "a", base),
                "postgresql": _job(url, Path(tmp) / "b", base)}
    print("| certificate | field | SQLite | PostgreSQL | equal |")
    print("|---|---|---|---|---|")
    for which in ("search", "final"):
        for key in SAME:
            a, b = (jobs[k][which].get(key) for k in ("sqlite", "postgresql"))  # type: ignore[attr-defined]
            print(f"| {which} | {key} | {_short(a)} | {_short(b)} | {a == b} |")
    print(f"\nfinal test accuracy (each its own 128-bit draw): SQLite {jobs['sqlite']['accuracy']:.4f}, "
          f"PostgreSQL {jobs['postgresql']['accuracy']:.4f}")


if __name__ == "__main__":
    main()
