"""What a search prints, and where the rest goes (issue 40, item 11): Ray's own lines to sealed/logs only, one clear
line per failure, the public names and reprs a notebook sees."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_lines_rays_core_worker_writes_to_fd_2_go_to_the_sealed_log(tmp_path: Path) -> None:
    """Item 11: a killed head raylet still put one raw Ray line on the terminal, ``:info_message: Attempting to
    recover N lost objects …``: Ray's C++ core worker logs ERROR lines to file descriptor 2 itself, past Python's
    logging and ``print_to_stdstream``. Inside ``sealed_ray_logs`` descriptor 2 is the sealed log; dptune's own
    Python-level stderr lines still reach the terminal, and descriptor 2 is the terminal again after."""
    sealed = tmp_path / "ray.log"
    code = f"""
import os, sys, threading
from pathlib import Path
from dptune.tuning.raylog import sealed_ray_logs
with sealed_ray_logs(Path({str(sealed)!r})):
    t = threading.Thread(target=lambda: os.write(2, b"[core_worker.cc:475] :info_message: Attempting to recover 7 "
                                                  b"lost objects by resubmitting their tasks\\n"))
    t.start(); t.join()
    print("dptune: where the charge stands", file=sys.stderr, flush=True)
os.write(2, b"after the search\\n")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert "Attempting to recover" not in r.stderr and "lost objects" not in r.stderr, r.stderr
    assert "dptune: where the charge stands" in r.stderr and "after the search" in r.stderr, r.stderr
    assert "Attempting to recover 7 lost objects" in sealed.read_text()
    assert sealed.stat().st_mode & 0o077 == 0


def test_a_trial_that_raises_is_not_reported_as_a_lost_worker() -> None:
    """Item 11: a model factory that raises on the workers was announced as "a worker was lost; the trial was
    retried as the same trial" before the right final error. The line now says what failed: a lost worker process
    or node (Ray's actor errors, crashed workers, dead nodes) or an error the trial raised (the factory, an import,
    memory), each in fixed words; the error itself stays in sealed/logs."""
    from ray import exceptions as rex

    from dptune.tuning.raylog import LOST_WORKER, TRIAL_FAILED, TRIAL_RAISED, recovery_line

    raised = rex.RayTaskError("ImplicitFunc.train", "Traceback …", RuntimeError("the model factory cannot run here"))
    assert recovery_line(raised) == TRIAL_RAISED
    assert recovery_line(rex.RayActorError(actor_init_failed=True)) == TRIAL_RAISED  # the actor's creation raised
    for lost in (rex.ActorDiedError(), rex.RayActorError(), rex.WorkerCrashedError(), rex.NodeDiedError("gone"),
                 rex.RayTaskError("ImplicitFunc.train", "…", rex.ActorDiedError())):
        assert recovery_line(lost) == LOST_WORKER, lost
    assert recovery_line(None) == TRIAL_FAILED  # nothing Tune recorded could be read: neither claim
    assert "raised" in TRIAL_RAISED and "worker was lost" not in TRIAL_RAISED and "sealed/logs" in TRIAL_RAISED
    assert "cannot run here" not in TRIAL_RAISED  # fixed words: the error's text is the curator's


def _python(code: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(tmp)})


def test_a_full_disk_under_the_sealed_log_prints_no_logging_traceback(tmp_path: Path) -> None:
    """Item 11: a full run folder printed a 77-line ``--- Logging error ---`` traceback (Ray's log records could not
    be written to sealed/logs/ray.log) before dptune's one error line. The sealed log is best-effort: a record it
    cannot write is dropped without a word. /dev/full is a real full disk: every write fails with ENOSPC."""
    r = _python("""
import logging
from pathlib import Path
from dptune.tuning.raylog import sealed_ray_logs
with sealed_ray_logs(Path('/dev/full')):
    for name in ('ray', 'ray.tune', 'ray.tune.execution.tune_controller'):
        logging.getLogger(name).error('Trial task failed for trial dptune_trial_00003')
print('ok')
""", tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
    assert "Logging error" not in r.stderr and "Traceback" not in r.stderr and "dptune_trial" not in r.stderr, r.stderr


def test_the_watcher_is_silent_when_the_search_ended_in_a_known_state_it_could_not_write(tmp_path: Path) -> None:
    """Item 11: on a full run folder the search said the right ``error: OSError …`` and the resume command, then the
    watcher (forked to speak when Ray's head raylet kills the driver) added a false "the search process ended
    without finishing (Ray's head raylet died …)": it read the state file the full disk had kept at "running". The
    driver now tells the watcher that it ended in a known state; a driver that just dies still gets the message."""
    code = """
import json, os, sys
from pathlib import Path
from dptune.rundir import RunDir
from dptune.tuning.failures import watch_for_sudden_death
run = RunDir(Path({run!r}))
run.create()
run.write_state(status="running", charge_id=1)
watcher = watch_for_sudden_death(run, Path({ledger!r}), 1.25, "python -m dptune.search --resume")
if {known}:
    watcher.ended()  # the failure was handled and said; the state file could not record it
os._exit(1)
"""
    for known in (True, False):  # the watcher holds the same stderr pipe: run() returns once it has exited
        run = tmp_path / f"run-{known}"
        r = _python(code.format(run=str(run), ledger=str(tmp_path / "ledger.sqlite"), known=known), tmp_path)
        if known:
            assert "ended without finishing" not in r.stderr and _status(run) == "running", r.stderr
        else:
            assert "ended without finishing" in r.stderr and "--resume" in r.stderr and _status(run) == "failed"


def _status(run: Path) -> str:
    import json

    return str(json.loads((run / "sealed" / "state.json").read_text()).get("status"))


def test_the_next_start_reaps_the_processes_a_killed_search_left(tmp_path: Path) -> None:
    """Item 11: ``ray::DashboardAgent`` and ``ray::RuntimeEnvAgent`` outlived a SIGKILLed driver (alive 28 s later).
    They rename themselves (``ray::…``: no path on their command line) but keep their logs open below the killed
    search's private Ray folder. Removing that folder on the next start now ends every process of this user that
    holds a file or its working directory there; a live search's processes and others are left alone."""
    import os
    import signal
    import time

    from dptune.tuning.raysession import remove_stale_ray_dirs

    dead = subprocess.Popen(["true"])
    dead.wait()
    stale, live = tmp_path / "dptune-ray-stale", tmp_path / "dptune-ray-live"
    for folder, owner in ((stale, f"{dead.pid} 1"), (live, f"{os.getpid()} ")):
        (folder / "r" / "logs").mkdir(parents=True)
        (folder / "owner").write_text(owner)
    holder = ("import os, sys, time\n"
              "f = open(os.environ['AGENT_LOG'], 'a')\n"
              "sys.stdout.write('up\\n'); sys.stdout.flush()\n"
              "time.sleep(600)\n")
    procs = {}
    for name, folder in (("agent", stale), ("live", live), ("other", tmp_path)):
        log = folder / "r" / "logs" / "dashboard_agent.log" if folder != tmp_path else tmp_path / "other.log"
        procs[name] = subprocess.Popen([sys.executable, "-c", holder], env={"AGENT_LOG": str(log), "PATH": "/usr/bin"},
                                       stdout=subprocess.PIPE, text=True)
        assert procs[name].stdout is not None and procs[name].stdout.readline() == "up\n"
    try:
        assert str(stale) not in Path(f"/proc/{procs['agent'].pid}/cmdline").read_text()  # as ray::DashboardAgent
        removed = remove_stale_ray_dirs(str(tmp_path))
        assert removed == [stale] and not stale.exists() and live.exists()
        deadline = time.time() + 10
        while procs["agent"].poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert procs["agent"].poll() is not None  # reaped
        assert procs["live"].poll() is None and procs["other"].poll() is None  # left alone
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            p.wait()


def test_a_resumed_search_does_not_say_it_charged_before_any_trial(tmp_path: Path, monkeypatch: object) -> None:
    """Item 11: after ``--resume`` the header said "charged to the ledger before any trial" just below "(no new
    charge)": a resumed search charges nothing; it says that the charge made when the search began stands.
    K = 0 (no Ray): the first session stops after its reservation, the second resumes it to its release."""
    import pytest

    from dptune.config import load_space
    from dptune.ledger import Ledger
    from dptune.tuning import driver
    from dptune.tuning.runner import SearchInterrupted
    from tests.conftest import digits_seed_with_k

    mp = pytest.MonkeyPatch()
    mp.chdir(tmp_path)
    space = load_space(ROOT / "search_spaces" / "digits.yaml")
    req = driver.SearchRequest(space=space, run_dir=Path("runs") / "r", ledger=Path("ledger.sqlite"),
                               budget_epsilon=100, seed=digits_seed_with_k(0, 0))
    first: list[str] = []

    def interrupted(*args: object, **kwargs: object) -> object:
        raise SearchInterrupted([])

    try:
        with mp.context() as inner:
            inner.setattr(driver, "_run_trials", interrupted)
            with pytest.raises(driver.SearchStopped):
                driver.run_search(req, say=first.append)
        assert any("charged to the ledger before any trial" in line for line in first), first
        again: list[str] = []
        import dataclasses

        driver.run_search(dataclasses.replace(req, resume=True), say=again.append)
    finally:
        mp.undo()
    text = "\n".join(again)
    assert "(no new charge)" in text and "charged to the ledger before any trial" not in text, text
    charge = Ledger(tmp_path / "ledger.sqlite").charges()[0]
    assert charge.status == "committed" and f"epsilon = {charge.epsilon:.4f}" in text


def test_what_a_notebook_sees_the_public_names_a_short_repr_and_runnable_hints(
        tmp_path: Path, capsys: object) -> None:
    """Item 11: ``dptune.SearchStopped`` was not exported although the docs name it so; ``print(found)`` dumped
    ~2,300 characters of certificate internals; the ``set-budget`` refusal's hint used a bare ``python -m`` (every
    other printed command names the running interpreter, so it runs as printed from any shell)."""
    import re
    import shlex

    import pytest

    import dptune
    from dptune import accounting as A
    from dptune.api import SearchResult
    from dptune.certificate import Certificate
    from dptune.cli.ledger import main as ledger_main
    from dptune.ledger import Ledger
    from dptune.tuning.driver import SearchStopped

    assert dptune.SearchStopped is SearchStopped and "SearchStopped" in dptune.__all__

    trial = A.trial_event(noise_multiplier=2.0, sampling_rate=0.1, steps=20, score_noise=5.0)
    cert = Certificate.build("ds-1", 1e-5, [("search", A.stopping_rule("poisson", mean=2).search_event(trial))],
                             {"rule": "poisson", "mean": 2.0})
    found = SearchResult(tmp_path / "runs" / "r", tmp_path / "runs" / "r" / "release",
                         {"learning_rate": 0.31, "batch_size": 64}, 0.8125, cert)
    text = repr(found)
    assert len(text) < 400 and str(found) == text, text
    assert f"epsilon={cert.epsilon:.4g}" in text and "learning_rate" in text and "0.8125" in text, text
    assert "release" in text and "RepeatAndSelect" not in text and "binding" not in text, text

    capsys_ = capsys  # pytest's CaptureFixture
    ledger = tmp_path / "l.sqlite"
    Ledger(ledger).set_budget("fp", 4.0, 1e-5, label="digits")
    assert ledger_main(["set-budget", "--ledger", str(ledger), "--dataset-id", "nope", "--epsilon", "2",
                        "--delta", "1e-6"]) == 2
    err = capsys_.readouterr().err  # type: ignore[attr-defined]
    with pytest.raises(Exception) as e:
        Ledger(ledger).dataset_id("no such key")
    for said in (err, str(e.value)):
        commands = re.findall(r"([^\s`]+) -m dptune\.", said)
        assert commands and all(c == shlex.quote(sys.executable) for c in commands), said


def test_the_docs_say_what_the_dashboard_overview_shows_of_k() -> None:
    """Item 11: the dashboard's Overview shows token holders "2+ pending placement groups" beside one running
    trial — a lower bound on K at a glance. What a dashboard viewer sees (docs/operations.md) says so."""
    page = (ROOT / "docs" / "operations.md").read_text()
    section = page.split("**What a dashboard viewer sees.**", 1)[1].split("\n## ", 1)[0]
    assert "pending placement groups" in section and "lower bound on K" in section, section


def test_a_fresh_clone_sets_up_its_venv_in_one_line() -> None:
    """Item 11: a fresh clone's ``make search`` showed setuptools' editable-install warning box for ~2 minutes
    before dptune's first line. The install says what it sets up in one line; pip's and setuptools' output goes to a
    log, shown only when the install fails. (``make -n``: the recipe as make runs it, without installing.)"""
    import shutil

    import pytest

    if shutil.which("make") is None:
        pytest.skip("make is not installed here")
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}  # not a sub-make
    r = subprocess.run(["make", "--no-print-directory", "-n", "search", "VENV=/nonexistent/venv"],
                       capture_output=True, text=True, cwd=ROOT, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    recipe = r.stdout.replace("\\\n", " ").splitlines()  # a recipe line continued with a backslash, joined
    first = recipe[0]
    assert first.startswith("echo ") and "setting up /nonexistent/venv" in first, recipe
    installs = [line for line in recipe if "pip install" in line]
    assert installs and all("> /nonexistent/venv/install.log 2>&1" in line and "cat /nonexistent/venv/install.log" in line
                            for line in installs), installs
