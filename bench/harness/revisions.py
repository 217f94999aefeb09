"""Another git revision's dptune beside this checkout's, for benches that time both side by side in one run
(``bench/plan_time.py``, ``bench/search_walltime.py``), and the machine's load while they ran."""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["checkout", "dptune_imported", "load_average"]

ROOT = Path(__file__).resolve().parents[2]


@contextmanager
def checkout(rev: str | None) -> Iterator[Path | None]:
    """A detached ``git worktree`` of ``rev`` in a temporary folder, removed afterwards (None: no revision)."""
    if rev is None:
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="dptune-rev-") as tmp:
        path = Path(tmp) / "before"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(path), rev], cwd=ROOT, check=True)
        try:
            yield path
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=ROOT, check=False)


def dptune_imported(cwd: Path, env: dict[str, str]) -> Path:
    """The dptune package a ``python -m`` (or ``-c``) run in ``cwd`` with ``env`` imports. Such a run puts its working
    directory first on sys.path, before PYTHONPATH: another revision's dptune runs only from inside its tree."""
    import sys

    out = subprocess.run([sys.executable, "-c", "import dptune; print(dptune.__file__)"], capture_output=True,
                         text=True, env=env, cwd=cwd, check=True).stdout.strip()
    return Path(out).resolve().parent


def load_average() -> str:
    """The 1, 5 and 15 minute load averages: what else the machine ran beside a timing."""
    return " ".join(f"{v:.2f}" for v in os.getloadavg())
