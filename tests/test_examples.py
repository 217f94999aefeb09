"""The examples in examples/ run for real (``--smoke-test``: 1 epoch, a fixed NOT PRIVATE draw of one trial,
temp ledger and runs) and use the public API only."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, isolated_env_for

EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def private_imports(source: str) -> list[str]:
    """dptune module paths (or names imported from dptune) with a component starting with ``_``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            paths = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            paths = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        else:
            continue
        found += [p for p in paths if p.split(".")[0] == "dptune" and any(c.startswith("_") for c in p.split("."))]
    return found


def test_examples_import_only_the_public_api() -> None:
    assert {p.name for p in EXAMPLES} >= {"digits_plan_search_train.py", "own_model.py", "table.py"}
    for path in EXAMPLES:
        assert private_imports(path.read_text()) == [], path.name
    # the check itself catches each form
    assert private_imports("import dptune.dpsgd._guard") == ["dptune.dpsgd._guard"]
    assert private_imports("from dptune.models._external import factory_model") == [
        "dptune.models._external", "dptune.models._external.factory_model"]
    assert private_imports("from dptune import _schema, plan") == ["dptune._schema"]
    assert private_imports("import dptune, torch._C\nfrom dptune.ledger import Ledger") == []


def _value(pattern: str, text: str) -> str:
    m = re.search(pattern, text, re.MULTILINE)
    assert m, f"{pattern!r} not in the output:\n{text}"
    return m.group(1)


@pytest.mark.ray
@pytest.mark.integration  # make test-slow (CI runs it): each example's whole run, 30-50 s; tests/test_search.py keeps the main job
@pytest.mark.parametrize("name", ["digits_plan_search_train", "own_model", "table"])
def test_example_smoke_test(name: str, tmp_path: Path) -> None:
    env = isolated_env_for(tmp_path)  # a private HOME (Ray's auth token), no RAY_* or test hooks
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])  # this checkout
    env["TMPDIR"] = str(tmp_path)  # the example's temp ledger and runs, removed with tmp_path
    runs = sorted((ROOT / "runs").glob("*")) if (ROOT / "runs").exists() else []
    r = subprocess.run([sys.executable, f"examples/{name}.py", "--smoke-test"], capture_output=True, text=True,
                       env=env, cwd=ROOT, timeout=300)
    out = r.stdout
    assert r.returncode == 0, out + r.stderr
    plan = float(_value(r"^plan: the search costs epsilon ([0-9.]+)", out))
    charged = float(_value(r"charged to the ledger before any trial: epsilon = ([0-9.]+)", out))
    assert charged == pytest.approx(plan, abs=1e-3)  # the plan is what the search is charged
    assert _value(r"^released score: ([0-9.]+|None)", out) != "None"  # the fixed draw ran a trial
    accuracy = float(_value(r"^test accuracy: ([0-9.]+)", out))
    assert 0.5 < accuracy <= 1.0  # above chance (digits: 10 classes; the table's majority class is 63 %)
    total, target = (float(v) for v in re.findall(r"^total epsilon: ([0-9.]+) \(target ([0-9.]+)\)", out,
                                                   re.MULTILINE)[0])
    assert plan < total <= target
    model = Path(_value(r"model: (\S+)$", out))
    assert model.is_relative_to(tmp_path) and not model.exists()  # under the temp dir, removed at the end
    assert (sorted((ROOT / "runs").glob("*")) if (ROOT / "runs").exists() else []) == runs  # nothing in the repo
