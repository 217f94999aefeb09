"""The commands in one place: the ``dptune`` console script, ``python -m dptune.cli.<command>`` and
``python -m dptune.<command>`` (search, plan, train, report) run the same code
(``dptune.cli``), and ``dptune.search``/``plan``/``train`` stay plain API functions (no module trick)."""

from __future__ import annotations

import inspect
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import dptune
from dptune.cli import COMMANDS, main

ROOT = Path(__file__).resolve().parent.parent
SPACE = str(ROOT / "search_spaces" / "digits.yaml")


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_the_console_script_and_python_m_print_the_same_plan() -> None:
    script = shutil.which("dptune", path=str(Path(sys.executable).parent))
    assert script is not None, "the dptune console script is not installed (pip install -e .)"
    via_script = _run(script, "plan", "--space", SPACE)
    via_module = _run(sys.executable, "-m", "dptune.plan", "--space", SPACE)
    assert via_script.returncode == via_module.returncode == 0, via_script.stderr + via_module.stderr
    assert via_script.stdout == via_module.stdout and "whole search" in via_script.stdout


def test_api_functions_are_plain_functions_and_entry_points_are_not_importable() -> None:
    for name in ("search", "plan", "train"):
        assert inspect.isfunction(getattr(dptune, name)), name
    r = _run(sys.executable, "-c", "import dptune.search")
    assert r.returncode != 0 and "import dptune.cli.search" in r.stderr
    r = _run(sys.executable, "-c", "import dptune, dptune.cli.search; print(type(dptune.search).__name__)")
    assert r.stdout.strip() == "function", r.stderr


def test_unknown_and_missing_commands_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert main(["serch"]) == 2
    err = capsys.readouterr().err
    assert "'serch' is not a dptune command" in err and ", ".join(COMMANDS) in err
    assert main(["--help"]) == 0 and "dptune <command>" in capsys.readouterr().out
    assert main(["plan", "--space", SPACE, "--target-epsilon", "-1"]) == 2  # the command's own exit 2


def _closed_pipe_run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``args`` with stdout a pipe whose reader is already gone (``… | true``, ``… | head`` after its lines)."""
    import os

    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run(list(args), stdout=write, stderr=subprocess.PIPE, text=True, timeout=300, cwd=ROOT,
                              env=env)
    finally:
        os.close(write)


def test_a_pipe_closed_early_ends_the_output_not_the_command(tmp_path: Path) -> None:
    """Issue 40, item 9: ``dptune ledger show … | true``, ``show --json`` and ``dptune plan … | true`` ended in a
    BrokenPipeError traceback and exit 1. The reader leaving ends the output only: no traceback, the command's
    own status, and a command that has more to do (a search) still does it."""
    from dptune.ledger import Ledger

    ledger = tmp_path / "l.sqlite"
    led = Ledger(ledger)
    led.set_budget("fp", 4.0, 1e-5, label="digits")
    for args in (["-m", "dptune.cli.ledger", "show", "--ledger", str(ledger)],
                 ["-m", "dptune.cli.ledger", "show", "--json", "--ledger", str(ledger)],
                 ["-m", "dptune.plan", "--space", SPACE]):
        r = _closed_pipe_run(sys.executable, *args)
        assert r.returncode == 0 and "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr, (args, r.stderr)
    # the command goes on after the reader left: it prints 1 MB (far past a pipe's buffer), then writes a file
    marker = tmp_path / "after"
    code = ("import sys; from dptune.cli._common import run_cli\n"
            "def body():\n    for i in range(20000):\n        print('x' * 50)\n"
            f"    open({str(marker)!r}, 'w').write('done')\n    return 0\n"
            "sys.exit(run_cli(body))")
    r = _closed_pipe_run(sys.executable, "-c", code)
    assert r.returncode == 0 and r.stderr == "" and marker.read_text() == "done"
