"""The test commands leave no test out: ``make test`` (pyproject's addopts), ``make test-slow`` and ``make test-fast``
(Makefile) select tests by marker expressions, and ``.ci/run`` runs the first two. Every combination of the
registered markers (pyproject) is evaluated with pytest's own expression parser: each one without ``gpu`` must be
run by CI exactly once, and whatever ``make test-fast`` runs must be in ``make test``."""

from __future__ import annotations

import itertools
import re
import shlex
import tomllib
from pathlib import Path

import pytest
from _pytest.mark import MarkMatcher
from _pytest.mark.expression import Expression

ROOT = Path(__file__).resolve().parent.parent


def _pytest_config() -> dict[str, object]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]


def _markers() -> list[str]:
    return [m.split(":", 1)[0].strip() for m in _pytest_config()["markers"]]  # type: ignore[union-attr]


def _mark_expression(args: list[str]) -> str | None:
    """The last ``-m EXPR`` of a pytest command line (pytest keeps the last)."""
    found = None
    for flag, value in itertools.pairwise(args):
        if flag == "-m":
            found = value
    return found


def _recipe_expression(target: str) -> str:
    """The marker expression that ``make <target>`` runs: its recipe's ``-m``, else pyproject's addopts' one."""
    text = (ROOT / "Makefile").read_text()
    m = re.search(rf"^{re.escape(target)}:.*\n((?:\t.*\n)+)", text, re.MULTILINE)
    assert m, f"no recipe for make {target}"
    pytest_lines = [line for line in m.group(1).splitlines() if "-m pytest" in line]
    assert len(pytest_lines) == 1, f"make {target} should run pytest once: {m.group(1)!r}"
    args = shlex.split(pytest_lines[0].strip())
    expr = _mark_expression(args[args.index("pytest") + 1:])  # pytest's own arguments, not python's -m pytest
    if expr is None:
        expr = _mark_expression(shlex.split(str(_pytest_config()["addopts"])))
    assert expr, f"make {target} selects no marker expression"
    return expr


def _selects(expr: str, marks: tuple[str, ...]) -> bool:
    return Expression.compile(expr).evaluate(MarkMatcher.from_markers([getattr(pytest.mark, m).mark for m in marks]))


def _combinations() -> list[tuple[str, ...]]:
    names = _markers()
    return [c for r in range(len(names) + 1) for c in itertools.combinations(names, r)]


def test_ci_runs_every_test_but_the_gpu_ones_exactly_once() -> None:
    default, slow = _recipe_expression("test"), _recipe_expression("test-slow")
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert "make test" in ci and "make test-slow" in ci, "CI must run both commands"
    for marks in _combinations():
        runs = [name for name, expr in (("make test", default), ("make test-slow", slow)) if _selects(expr, marks)]
        if "gpu" in marks:
            assert runs == [], f"a test marked {marks} needs a GPU, which CI lacks: {runs} would fail it"
        else:
            assert len(runs) == 1, f"a test marked {marks or '(nothing)'} runs in {runs or 'neither command'}"


def test_test_fast_is_part_of_the_default_suite_and_has_no_ray_or_training() -> None:
    fast, default = _recipe_expression("test-fast"), _recipe_expression("test")
    for marks in _combinations():
        if _selects(fast, marks):
            assert _selects(default, marks), f"make test-fast runs a test marked {marks} that make test does not"
            assert not {"ray", "train", "slow", "integration", "gpu", "db"} & set(marks), marks


def test_the_check_sees_a_command_that_drops_a_marker() -> None:
    """The two checks above can fail: an expression that forgets integration leaves those tests in no command."""
    assert not _selects("slow and not gpu", ("integration",))
    assert not _selects("not slow and not integration and not gpu", ("integration",))
    assert _selects("(slow or integration) and not gpu", ("integration", "ray"))


def test_the_main_job_search_stays_in_the_default_suite() -> None:
    """README's test command covers the main job: the digits search end to end (real Ray and Opacus) is in it."""
    from tests import test_search

    fn = test_search.test_tiny_search_end_to_end
    marks = tuple(m.name for m in [*getattr(fn, "pytestmark", []), *_module_marks(test_search)])
    assert _selects(_recipe_expression("test"), marks), marks
    assert test_search.SPACE == "search_spaces/digits.yaml"


def _module_marks(module: object) -> list[pytest.MarkDecorator]:
    marks = getattr(module, "pytestmark", [])
    return list(marks) if isinstance(marks, list) else [marks]
