"""``python -m dptune.report runs/<name>``: a self-contained HTML report of one search — CURATOR ONLY.

It reads ``sealed/`` (every trial's config and score: private data), so the report is written into
``sealed/`` by default with mode 0600 and must not be shared. Plots (embedded PNG): score against each
searched hyperparameter, ε against the mean number of trials per stopping rule for this run's worst-case
trial, and the ledger's spend per dataset over time.

    python -m dptune.report runs/digits-1 [--ledger runs/ledger.sqlite] [--out FILE.html]
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import html
import json
import math
import sqlite3
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from dp_accounting import dp_event as de

from dptune import plots
from dptune.accounting import StoppingRule, epsilon, search_parts
from dptune.certificate import Certificate, CertificateError, load_certificate
from dptune.cli._common import run_cli
from dptune.config import ConfigError
from dptune.ledger import Ledger
from dptune.rundir import RunDir, write_private
from dptune.trials import read_trials

__all__ = ["main"]

WARNING = ("WARNING: dptune.report reads the SEALED (private) results of every trial. The HTML it writes is "
           "for the data curator only: do not share, publish or attach it. Share release/ instead.")

_TRIAL_COLUMNS = ("score", "val_accuracy_raw", "diverged", "crashed", "error", "steps", "sampling_rate",
                  "noise_multiplier", "seconds", "attempts")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dptune.report", description=__doc__.splitlines()[0],
                                epilog="CURATOR ONLY: the report holds private per-trial results.")
    p.add_argument("run", help="run directory written by python -m dptune.search, e.g. runs/digits-1")
    p.add_argument("--ledger", help="privacy ledger (default: the one recorded in sealed/state.json)")
    p.add_argument("--out", help="HTML file to write (default: <run>/sealed/report.html, mode 0600); outside "
                   "sealed/ only with --out-is-private, never inside release/")
    p.add_argument("--out-is-private", action="store_true",
                   help="CURATOR ONLY: I know the --out file holds every trial's private results and will keep it so")
    return p


@dataclass(frozen=True)
class RunData:
    """Everything the report shows, read and validated up front (so bad input fails before any work)."""

    run: RunDir
    state: dict[str, Any]
    trials: list[dict[str, Any]]
    certificate: Certificate
    release: dict[str, Any]
    ledger: Ledger


def _load(args: argparse.Namespace) -> RunData:
    run = RunDir(Path(args.run))
    if not run.root.is_dir():
        raise ConfigError("run", f"{args.run!r} is not a directory", "give runs/<name> of a search")
    if not run.sealed.is_dir():
        raise ConfigError("run", f"{args.run!r} has no sealed/ directory",
                          "give the run directory of a search on the curator's machine (sealed/ never leaves it)")
    if not run.trials_file.is_file():
        raise ConfigError("run", f"{run.trials_file} does not exist: the search has not finished",
                          "wait for it, or finish it with python -m dptune.search --resume --name <name>")
    try:
        trials = [dataclasses.asdict(t) for t in read_trials(run.trials_file)]
    except (OSError, ValueError, TypeError) as e:  # pyarrow raises ArrowInvalid (a ValueError) on a corrupt file
        raise ConfigError("run", f"{run.trials_file} is not readable ({e})", "use the file the search wrote") from e
    try:
        cert = load_certificate(run.release / "certificate.json")
    except CertificateError as e:
        raise ConfigError("run", e.problem, e.fix) from e
    cfg_file = run.release / "best_config.yaml"
    release = yaml.safe_load(cfg_file.read_text()) if cfg_file.is_file() else {}
    state = run.read_state()

    ledger_path = args.ledger or state.get("ledger")
    if not ledger_path:
        raise ConfigError("--ledger", "not given, and sealed/state.json records no ledger",
                          "pass --ledger FILE (the --ledger the search used)")
    from dptune.ledger import ledger_location

    # Ledger() would create a missing file: a typo must be an error, not an empty report.
    if not ledger_location(ledger_path).is_postgres and not Path(ledger_path).is_file():
        raise ConfigError("--ledger", f"{str(ledger_path)!r} does not exist", "pass the --ledger the search used")
    try:
        ledger = Ledger(ledger_path, read_only=ledger_location(ledger_path).is_postgres)
        ledger.fingerprints()
    except sqlite3.DatabaseError as e:
        raise ConfigError("--ledger", f"{str(ledger_path)!r} is not a dptune ledger ({e})",
                          "pass the SQLite file the search used") from e
    return RunData(run, state, trials, cert, release or {}, ledger)


def _shared_folder(folder: Path) -> Path | None:
    """``folder`` or the first folder above it that is meant to be shared: named ``release``, or holding a
    dptune certificate (``certificate.json``, or any JSON file of the certificate format)."""
    for p in (folder, *folder.parents):
        if p.name == "release" or (p / "certificate.json").exists() or _holds_certificate(p):
            return p
    return None


def _holds_certificate(folder: Path) -> bool:
    try:
        candidates = [f for f in folder.glob("*.json") if f.is_file() and f.stat().st_size < 10_000_000]
    except OSError:
        return False
    for f in candidates:
        try:
            with f.open("rb") as fh:
                if b"dptune-certificate/" in fh.read(4096):
                    return True
        except OSError:
            continue
    return False


def _out_path(args: argparse.Namespace, run: RunDir) -> Path:
    """The report holds every trial and K: it stays in sealed/ unless the curator says, explicitly, that the
    other place is private too; never in release/ (what people share; 0600 does not survive a tar)."""
    out = Path(args.out) if args.out else run.sealed / "report.html"
    if out.is_dir():
        raise ConfigError("--out", f"{str(out)!r} is a directory", "give a file name, e.g. report.html")
    if not out.parent.is_dir():
        raise ConfigError("--out", f"directory {str(out.parent)!r} does not exist", "create it or choose another path")
    where = out.resolve()
    if where.is_relative_to(run.release.resolve()):
        raise ConfigError("--out", "is inside release/, which is meant to be shared",
                          "write the report into sealed/ (the default)")
    shared = _shared_folder(where.parent)
    if shared is not None:  # --out-is-private cannot make a folder that is meant to be shared private
        raise ConfigError("--out", f"is inside {shared}, which is meant to be shared (a folder named release, or one "
                          "holding a dptune certificate: another run's release or a final-training output)",
                          "write the report into sealed/ (the default), or into a folder only the curator reads")
    if not where.is_relative_to(run.sealed.resolve()) and not args.out_is_private:
        raise ConfigError("--out", f"{out} is outside the run's sealed/ directory",
                          "keep the default (sealed/report.html), or add --out-is-private if that place is "
                          "readable by the curator only")
    return out


# --- privacy data for the plots ----------------------------------------------------------------------


def search_trial_event(cert: Certificate) -> tuple[de.DpEvent, StoppingRule, float]:
    """The worst-case trial event, stopping rule and tune fraction of a search certificate (its 'search'
    event, subsampled or not: ``dptune.accounting.search_parts``)."""
    search = dict(cert.events).get("search")
    problem = "no event has the role 'search'"
    if search is not None:
        try:
            return search_parts(search)
        except ValueError as e:
            problem = str(e)
    raise ConfigError("run", f"its certificate has no dptune search event ({problem})",
                      "give a run written by python -m dptune.search")


def ledger_series(ledger: Ledger) -> tuple[dict[str, list[tuple[float, float]]], dict[str, float | None],
                                           list[dict[str, Any]]]:
    """Cumulative ε per dataset after each charge (composed at the budget's δ, the smallest valid bound; aborted charges
    excluded — as the ledger counts them), the budgets, and one table row per charge."""
    series: dict[str, list[tuple[float, float]]] = {}
    budgets: dict[str, float | None] = {}
    rows: list[dict[str, Any]] = []
    for fp in ledger.fingerprints():
        budget = ledger.budget(fp)
        delta = budget[1] if budget else 1e-5  # Ledger.spent's default when no budget is set
        label = ledger.label(fp)  # the public id and label: the key (a hash of the data) stays in the ledger
        budgets[label] = budget[0] if budget else None
        counted: list[de.DpEvent] = []
        points: list[tuple[float, float]] = []
        for c in ledger.charges(fp):
            if c.status != "aborted":
                counted.append(c.event)
            cum = epsilon(counted, delta)  # compose, never add ε
            points.append((c.created, cum))
            rows.append({"id": c.id, "dataset": label, "name": c.name, "status": c.status,
                         "epsilon alone": c.epsilon, "cumulative epsilon": cum, "delta": delta,
                         "created": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(c.created))})
        series[label] = points
    return series, budgets, rows


# --- HTML ---------------------------------------------------------------------------------------------


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return "−∞" if v == -math.inf else f"{v:.4g}"
    if v is None:
        return ""
    if isinstance(v, dict | list):
        return json.dumps(v)
    return str(v)


def _table(rows: list[dict[str, Any]], columns: list[str] | None = None) -> str:
    if not rows:
        return "<p><em>none</em></p>"
    cols = columns or list(rows[0])
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(r.get(c)))}</td>" for c in cols) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _kv(pairs: list[tuple[str, Any]]) -> str:
    body = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(_fmt(v))}</td></tr>" for k, v in pairs)
    return f"<table class='kv'><tbody>{body}</tbody></table>"


def _img(png: bytes, alt: str) -> str:
    return f"<img alt='{html.escape(alt)}' src='data:image/png;base64,{base64.b64encode(png).decode('ascii')}'>"


_CSS = """
body { font-family: sans-serif; margin: 2em; color: #222; max-width: 1200px; }
.warn { background: #fde2e1; border: 2px solid #c0392b; padding: .8em 1em; font-weight: bold; }
table { border-collapse: collapse; margin: .5em 0 1.5em; font-size: 13px; }
th, td { border: 1px solid #bbb; padding: 3px 8px; text-align: left; }
thead th { background: #eee; }
table.kv th { background: #f4f4f4; }
img { max-width: 100%; border: 1px solid #ddd; margin: .5em 0; }
"""


def render(data: RunData) -> str:
    """The report as one HTML document (plots embedded as base64 PNG, no external resources)."""
    cert = data.certificate
    trial_ev, rule, tune_fraction = search_trial_event(cert)
    params = sorted({k for t in data.trials for k in t["params"]})
    released = data.release.get("config", {})
    name = cert.details.get("run", data.run.root.name)
    series, budgets, charge_rows = ledger_series(data.ledger)
    this_ds = data.ledger.label(str(data.state.get("budget_fingerprint", "")))
    series = {(f"{k} (this run)" if k == this_ds else k): v for k, v in series.items()}
    budgets = {(f"{k} (this run)" if k == this_ds else k): v for k, v in budgets.items()}

    summary = _kv([
        ("run", name), ("status", data.state.get("status")), ("space", cert.details.get("space")),
        ("dataset id (public)", cert.dataset_id),
        ("ε (certificate)", cert.epsilon), ("δ", cert.delta), ("stopping rule", rule.label()),
        ("stopping (certificate)", cert.stopping), ("accounting", cert.details.get("accounting")),
        ("one worst-case trial ε", cert.details.get("trial_epsilon")),
        ("released score", data.release.get("score")), ("score kind", data.release.get("score_kind")),
        ("trials run (SEALED)", len(data.trials)),
    ])
    config_rows = [(f"{k}{' (searched)' if k in params else ''}", v) for k, v in released.items()]
    trial_rows = [{"index": t.get("index"), **{p: t["params"].get(p) for p in params},
                   **{c: t.get(c) for c in _TRIAL_COLUMNS}} for t in sorted(data.trials, key=lambda t: t["index"])]
    figs = [
        ("Score against each searched hyperparameter (all trials; crashed/diverged at the bottom)",
         plots.score_figure(data.trials, params)),
        ("ε against the mean number of trials, per stopping rule, for this run's worst-case trial",
         plots.stopping_rule_figure(trial_ev, cert.delta, mark=rule, tune_fraction=tune_fraction)),
        ("Ledger: cumulative ε per dataset after each charge (composed: the smallest valid bound)",
         plots.ledger_figure(series, budgets)),
    ]
    parts = [
        "<!DOCTYPE html>", "<html lang='en'><head><meta charset='utf-8'>",
        f"<title>dptune report: {html.escape(str(name))} (CURATOR ONLY)</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>dptune search report: {html.escape(str(name))}</h1>",
        "<p class='warn'>CURATOR ONLY. This report contains sealed, private per-trial results (every trial's "
        "configuration and score). Do not share, publish or attach it; share only the run's release/ directory."
        "</p>",
        f"<p>Generated {html.escape(time.strftime('%Y-%m-%d %H:%M:%S'))} from {html.escape(str(data.run.root))}.</p>",
        "<h2>Summary</h2>", summary,
    ]
    for i, (caption, png) in enumerate(figs):
        parts += [f"<h2>Figure {i + 1}</h2>", f"<figure>{_img(png, caption)}<figcaption>{html.escape(caption)}"
                  "</figcaption></figure>"]
    parts += ["<h2>Released configuration</h2>", _kv(config_rows), "<h2>Ledger charges</h2>", _table(charge_rows),
              "<h2>All trials (SEALED)</h2>", _table(trial_rows), "</body></html>"]
    return "\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    print(WARNING, file=sys.stderr)
    return run_cli(lambda: _main(args))


def _main(args: argparse.Namespace) -> int:
    data = _load(args)
    out = _out_path(args, data.run)
    write_private(out, render(data))
    print(f"wrote {out} (mode 0600, CURATOR ONLY: holds private per-trial results)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
