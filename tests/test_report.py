"""The curator's HTML report: built from a real (tiny) search run, rendered, parsed, and screenshotted."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import io
import json
import math
import os
import shutil
import stat
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from PIL import Image

from dptune import plots
from dptune.accounting import epsilon, plan_search
from dptune.certificate import Certificate, load_certificate
from dptune.cli.report import ledger_series, main, search_trial_event
from dptune.config import load_space
from dptune.errors import ConfigError
from dptune.ledger import Ledger
from dptune.rundir import RunDir
from dptune.trials import read_trials, write_trials
from tests.conftest import free_port, run_cli

# one real smoke search (~40-80 s on 2 cores) feeds every test here: a whole command end to end (make test-slow; CI
# runs it); the default suite keeps its one end-to-end search in test_search
pytestmark = pytest.mark.integration

CHROMIUM = Path("/usr/bin/chromium")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _env(home: Path) -> dict[str, str]:
    # as conftest.isolated_env, for a module-scoped run: private HOME (Ray writes its auth token there)
    home.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_") and k != "DPTUNE_TEST_DRAW_SEED"}
    env.update(HOME=str(home), PYTHONUNBUFFERED="1", RAY_USAGE_STATS_ENABLED="0", OMP_NUM_THREADS="1")
    return env


@pytest.fixture(scope="module")
def search_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, str]]:
    """(run dir, ledger, env) of one real smoke-test search on digits. Seed 0 draws K = 2: one round of
    two parallel trials on 2 CPUs (the search is most of this module's run time)."""
    base = tmp_path_factory.mktemp("report")
    env = _env(base / "home")
    ledger = base / "ledger.sqlite"
    r = run_cli(["-m", "dptune.search", "--space", "search_spaces/digits.yaml", "--name", "rep",
                 "--runs-dir", str(base / "runs"), "--ledger", str(ledger), "--budget-epsilon", "30",
                 "--num-cpus", "2", "--dashboard-port", str(free_port()), "--smoke-test", "--seed", "0"], env)
    assert r.returncode == 0, r.stdout + r.stderr
    return base / "runs" / "rep", ledger, env


@pytest.fixture(scope="module")
def report(search_run: tuple[Path, Path, dict[str, str]]) -> tuple[Path, str]:
    """The report at its default path, and the CLI's stderr. In-process: the CLI's import time is the
    suite's slowest part after the search itself (subprocess exit codes are covered by test_search)."""
    run, _, _ = search_run
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main([str(run)]) == 0, err.getvalue()  # ledger found via sealed/state.json
    return run / "sealed" / "report.html", err.getvalue()


class _Images(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.srcs: list[str] = []
        self.tags: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        if tag == "img":
            self.srcs.append(dict(attrs).get("src") or "")


def _check_png(data: bytes, min_side: int = 100) -> tuple[int, int]:
    assert data[:8] == PNG_SIGNATURE
    Image.open(io.BytesIO(data)).verify()
    size = Image.open(io.BytesIO(data)).size
    assert min(size) > min_side, size
    return size


@pytest.mark.ray
def test_report_is_private_valid_html_with_plots(search_run: tuple[Path, Path, dict[str, str]],
                                                 report: tuple[Path, str]) -> None:
    run, _, _ = search_run
    path, stderr = report
    assert stderr.startswith("WARNING") and "SEALED" in stderr and "do not share" in stderr
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    text = path.read_text()
    parser = _Images()
    parser.feed(text)
    parser.close()
    assert {"html", "head", "body", "table", "img"} <= set(parser.tags)
    pngs = [s for s in parser.srcs if s.startswith("data:image/png;base64,")]
    assert len(pngs) >= 3 and len(pngs) == len(parser.srcs)  # self-contained: no external images
    for src in pngs:
        _check_png(base64.b64decode(src.split(",", 1)[1], validate=True))
    # the curator's tables: released config, ε/δ/stopping rule, every trial
    cert = load_certificate(run / "release" / "certificate.json")
    assert f"{cert.epsilon:.4g}" in text and "poisson(mean=2)" in text and "CURATOR ONLY" in text
    trials = pq.read_table(run / "sealed" / "trials.parquet").to_pylist()
    assert len(trials) == json.loads((run / "sealed" / "draw.json").read_text())["k"] == 2
    for t in trials:
        assert f"{t['score']:.4g}" in text


@pytest.mark.ray
def test_stopping_rule_figure_and_known_answers(search_run: tuple[Path, Path, dict[str, str]],
                                                tmp_path: Path) -> None:
    run, _, _ = search_run
    cert = load_certificate(run / "release" / "certificate.json")
    trial, rule, tune_fraction = search_trial_event(cert)
    assert tune_fraction == 1.0
    assert rule.label() == "poisson(mean=2)"
    png = plots.stopping_rule_figure(trial, cert.delta, (1, 2, 3, 10), tmp_path / "rules.png", mark=rule)
    assert (tmp_path / "rules.png").read_bytes() == png
    _check_png(png)
    table = plots.stopping_rule_table(trial, cert.delta, (1, 2, 3, 10))
    # oracles: the certificate's own ε (Poisson, mean 2), and one composed trial is the trial itself
    assert dict(table["Poisson"])[2.0] == pytest.approx(cert.epsilon, rel=1e-9)
    composed = dict(table["composition (K fixed, every trial charged)"])
    assert composed[1.0] == pytest.approx(epsilon([trial], cert.delta), rel=1e-9)
    assert composed[10.0] > dict(table["Poisson"])[10.0]  # random stopping beats composing 10 trials here
    with pytest.raises(ValueError):
        plots.stopping_rule_figure(trial, cert.delta, (0.5, 2))


@pytest.mark.ray
def test_ledger_series_composes_like_the_ledger(search_run: tuple[Path, Path, dict[str, str]]) -> None:
    _, ledger_path, _ = search_run
    ledger = Ledger(ledger_path)
    series, budgets, rows = ledger_series(ledger)
    [fp] = ledger.fingerprints()
    assert series[ledger.label(fp)][-1][1] == pytest.approx(ledger.spent(fp), rel=1e-9)
    assert budgets[ledger.label(fp)] == 30.0 and [r["status"] for r in rows] == ["committed"]
    _check_png(plots.ledger_figure(series, budgets))


@pytest.mark.ray
def test_failed_trials_and_explicit_paths(search_run: tuple[Path, Path, dict[str, str]], tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    run, ledger, _ = search_run
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    rows = read_trials(RunDir(copy).trials_file)
    rows.append(dataclasses.replace(rows[0], index=len(rows), score=-math.inf, crashed=True,
                                    error="RuntimeError: boom"))
    write_trials(RunDir(copy).trials_file, rows)
    out = tmp_path / "r.html"
    # outside sealed/ only when the curator says that place is private (issue item 20)
    assert main([str(copy), "--ledger", str(ledger), "--out", str(out)]) == 2
    assert main([str(copy), "--ledger", str(ledger), "--out", str(out), "--out-is-private"]) == 0
    text = out.read_text()
    assert "−∞" in text and "RuntimeError: boom" in text
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    assert capsys.readouterr().err.startswith("WARNING")
    # a crashed trial sits below the real scores, in its own marker
    png = plots.score_figure([dataclasses.asdict(r) for r in rows], ["batch_size", "learning_rate"])
    _check_png(png)
    _check_png(plots.score_figure([], []))


@pytest.mark.ray
def test_bad_inputs_exit_2(search_run: tuple[Path, Path, dict[str, str]], tmp_path: Path,
                           capsys: pytest.CaptureFixture[str]) -> None:
    run, ledger, _ = search_run
    no_sealed = tmp_path / "no_sealed"
    shutil.copytree(run / "release", no_sealed / "release")
    no_state = tmp_path / "no_state"
    shutil.copytree(run, no_state)
    (no_state / "sealed" / "state.json").unlink()
    not_sqlite = tmp_path / "bad.sqlite"
    not_sqlite.write_text("not a database " * 100)
    cases = [
        ([str(tmp_path / "missing")], "run"),
        ([str(no_sealed)], "run"),
        ([str(run), "--ledger", str(tmp_path / "nope.sqlite")], "--ledger"),
        ([str(run), "--ledger", str(not_sqlite)], "--ledger"),
        ([str(no_state)], "--ledger"),
        ([str(run), "--out", str(tmp_path / "no" / "dir" / "r.html")], "--out"),
        ([str(run), "--out", str(tmp_path)], "--out"),
    ]
    for args, field in cases:
        assert main(args) == 2, args
        err = capsys.readouterr().err
        assert f"error: {field}:" in err, (args, err)
    assert not (tmp_path / "nope.sqlite").exists()  # a typo must not create an empty ledger


@pytest.mark.ray
def test_chromium_renders_the_report(report: tuple[Path, str], tmp_path: Path) -> None:
    if not CHROMIUM.exists():
        pytest.skip("/usr/bin/chromium is absent (CI installs it with .ci/install-chromium)")
    path, _ = report
    shot = tmp_path / "shot.png"
    r = subprocess.run([str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                        "--no-first-run", "--disable-background-networking", "--disable-component-update",
                        "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}",
                        "--window-size=1200,1600", path.resolve().as_uri()],
                       capture_output=True, text=True, timeout=90, env={**os.environ, "HOME": str(tmp_path)})
    assert shot.is_file() and shot.stat().st_size > 0, r.stdout + r.stderr
    img = Image.open(shot).convert("RGB")
    assert img.size == (1200, 1600)
    colours = img.getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 50  # text, tables and plots, not a blank page
    assert any(lo != hi for lo, hi in img.getextrema())


def test_cli_module_bad_run_exits_2(tmp_path: Path) -> None:
    r = run_cli(["-m", "dptune.report", str(tmp_path / "missing")], _env(tmp_path / "home"), timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.startswith("WARNING") and "error: run:" in r.stderr


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_search_trial_event_reads_any_search_certificate(fraction: float) -> None:
    """Issue 11: with search.tune_fraction < 1 the certificate's search event is subsampled (a worst case of
    the amplified search and its score releases); the report still recovers trial, rule and fraction, and
    its stopping-rule table prices the run's own rule at the certificate's ε. No Ray."""
    space = dataclasses.replace(load_space("search_spaces/digits.yaml"), tune_fraction=fraction)
    plan = plan_search(space, 1257, compare=False)
    cert = Certificate.build("f" * 64, plan.delta, [("search", plan.search_event)], plan.stopping.describe())
    trial, rule, tune_fraction = search_trial_event(cert)
    assert (trial, rule, tune_fraction) == (plan.trial_event, plan.stopping, fraction)
    table = plots.stopping_rule_table(trial, cert.delta, (1, rule.mean), tune_fraction=tune_fraction)
    assert dict(table[rule.family()])[rule.mean] == pytest.approx(cert.epsilon, rel=1e-9)


def test_out_is_private_never_writes_into_a_release_or_a_certified_folder(tmp_path: Path) -> None:
    """Issue 22 item 7: --out-is-private cannot put the curator report (every trial, K) into another run's
    release/, a folder named release (or inside one), or a folder holding a dptune certificate (a
    final-training output); a folder only the curator reads is still accepted."""
    import argparse

    from dptune.cli.report import _out_path

    run = RunDir(tmp_path / "runs" / "mine")
    run.create()
    other = RunDir(tmp_path / "runs" / "other")
    other.create()
    final = tmp_path / "final"
    final.mkdir()
    (final / "certificate.json").write_text('{"format": "dptune-certificate/2"}')
    shipped = tmp_path / "to_share"
    shipped.mkdir()
    (shipped / "cert-copy.json").write_text('{"format": "dptune-certificate/2", "epsilon": 1}')
    (tmp_path / "release" / "deep").mkdir(parents=True)
    (tmp_path / "private").mkdir()

    def args(out: Path) -> argparse.Namespace:
        return argparse.Namespace(out=str(out), out_is_private=True)

    for out in (other.release / "r.html", tmp_path / "release" / "r.html", tmp_path / "release" / "deep" / "r.html",
                final / "r.html", shipped / "r.html"):
        with pytest.raises(ConfigError) as e:
            _out_path(args(out), run)
        assert e.value.field == "--out" and "meant to be shared" in str(e.value), out
    assert _out_path(args(tmp_path / "private" / "r.html"), run) == tmp_path / "private" / "r.html"
