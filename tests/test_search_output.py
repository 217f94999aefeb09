"""What a search prints, and where the rest goes (issue 40, item 11): Ray's own lines to sealed/logs only, one clear
line per failure, the public names and reprs a notebook sees."""

from __future__ import annotations

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
from dptune.tuning.runner import sealed_ray_logs
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

    from dptune.tuning.runner import LOST_WORKER, TRIAL_FAILED, TRIAL_RAISED, recovery_line

    raised = rex.RayTaskError("ImplicitFunc.train", "Traceback …", RuntimeError("the model factory cannot run here"))
    assert recovery_line(raised) == TRIAL_RAISED
    assert recovery_line(rex.RayActorError(actor_init_failed=True)) == TRIAL_RAISED  # the actor's creation raised
    for lost in (rex.ActorDiedError(), rex.RayActorError(), rex.WorkerCrashedError(), rex.NodeDiedError("gone"),
                 rex.RayTaskError("ImplicitFunc.train", "…", rex.ActorDiedError())):
        assert recovery_line(lost) == LOST_WORKER, lost
    assert recovery_line(None) == TRIAL_FAILED  # nothing Tune recorded could be read: neither claim
    assert "raised" in TRIAL_RAISED and "worker was lost" not in TRIAL_RAISED and "sealed/logs" in TRIAL_RAISED
    assert "cannot run here" not in TRIAL_RAISED  # fixed words: the error's text is the curator's
