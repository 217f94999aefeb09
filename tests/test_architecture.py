"""Layer rules of DESIGN.md: imports point downwards only."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "dptune"

# module (path prefix, relative to dptune/) -> forbidden import prefixes
RULES: dict[str, tuple[str, ...]] = {
    "config.py": ("torch", "ray", "opacus", "dptune.accounting", "dptune.ledger", "dptune.certificate",
                  "dptune.dpsgd", "dptune.models", "dptune.data", "dptune.search", "dptune.train"),
    "accounting/": ("torch", "ray", "opacus", "torchvision", "dptune.ledger", "dptune.certificate", "dptune.dpsgd",
                    "dptune.models", "dptune.data", "dptune.search", "dptune._search", "dptune.train", "dptune.plan",
                    "dptune.report", "dptune._plots", "dptune._cli"),
    "ledger.py": ("torch", "ray", "opacus", "dptune.dpsgd", "dptune.models", "dptune.data", "dptune.search",
                  "dptune.train"),
    "certificate.py": ("torch", "ray", "opacus", "dptune.dpsgd", "dptune.models", "dptune.data", "dptune.search",
                       "dptune.train", "dptune.ledger"),
    "dpsgd.py": ("ray", "dptune.accounting", "dptune.ledger", "dptune.certificate", "dptune.search",
                 "dptune.train"),
    "models/": ("ray", "opacus", "dptune.accounting", "dptune.ledger", "dptune.certificate", "dptune.search",
                "dptune.dpsgd", "dptune.data", "dptune.train"),
    "data/": ("ray", "opacus", "dptune.accounting", "dptune.ledger", "dptune.certificate", "dptune.search",
              "dptune.dpsgd", "dptune.models", "dptune.train"),
    "plan.py": ("torch", "ray", "opacus"),
    "report.py": ("torch", "ray", "opacus"),
    "_plots.py": ("torch", "ray", "opacus", "dptune.ledger", "dptune.certificate"),
}
ONLY = {"ray": ("_search/", "search.py"), "opacus": ("dpsgd.py",)}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


MODULES = sorted(p for p in PKG.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PKG)))
def test_layer_rules(path: Path) -> None:
    rel = str(path.relative_to(PKG))
    imported = _imports(path)
    for prefix, forbidden in RULES.items():
        if rel == prefix or rel.startswith(prefix):
            bad = sorted(i for i in imported if any(i == f or i.startswith(f + ".") for f in forbidden))
            assert not bad, f"{rel} imports {bad} across the layer rules of DESIGN.md"
    for lib, allowed in ONLY.items():
        if any(i == lib or i.startswith(lib + ".") for i in imported):
            assert any(rel == a or rel.startswith(a) for a in allowed), f"{rel} imports {lib}; only {allowed} may"


def test_rule_catches_a_violation(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\nfrom ray import tune\n")
    assert {"torch", "ray"} <= _imports(bad)


def test_lazy_dp_accounting_is_transparent() -> None:
    """dptune skips dp_accounting's slow package __init__ at import; the package still works fully."""
    import subprocess
    import sys

    code = ("import sys, dptune.plan; assert 'dp_accounting.pld' not in sys.modules, 'PLD imported eagerly'\n"
            "import dp_accounting\nfrom dp_accounting import dp_event\n"
            "assert dp_accounting.GaussianDpEvent is dp_event.GaussianDpEvent\n"
            "assert dp_accounting.pld.PLDAccountant is not None\nprint('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


# --- inside dptune/accounting: a layered package, no cycles, no registry written from outside ---------

ACCOUNTING = PKG / "accounting"


def _accounting_deps(path: Path) -> dict[str, bool]:
    """The accounting modules ``path`` imports -> whether the import sits inside a function (lazy)."""
    deps: dict[str, bool] = {}
    tree = ast.parse(path.read_text())
    lazy = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
            for n in ast.walk(f)}
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module == "dptune.accounting":
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dptune.accounting."):
            names = [(node.module or "").split(".")[2]]
        elif isinstance(node, ast.Import):
            names = [a.name.split(".")[2] for a in node.names if a.name.startswith("dptune.accounting.")]
        for name in names:
            if (ACCOUNTING / f"{name}.py").exists():
                deps[name] = deps.get(name, False) or id(node) in lazy
    return deps


def _graph() -> dict[str, dict[str, bool]]:
    # the package __init__ re-exports every module; the modules must form a DAG among themselves
    return {p.stem: _accounting_deps(p) for p in sorted(ACCOUNTING.glob("_*.py")) if p.name != "__init__.py"}


def _cycle(graph: dict[str, dict[str, bool]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for d in graph.get(m, {}):
            if state.get(d) == 1:
                return path[path.index(d):] + [d]
            if d not in state and (found := visit(d)):
                return found
        path.pop()
        state[m] = 2
        return None

    for m in graph:
        if m not in state and (found := visit(m)):
            return found
    return None


def test_accounting_import_graph_is_acyclic() -> None:
    graph = _graph()
    assert {"_events", "_rdp", "_amplify", "_rules", "_catalogue", "_planner"} <= set(graph)
    assert _cycle(graph) is None, f"import cycle in dptune/accounting: {' -> '.join(_cycle(graph) or [])}"
    lazy = sorted(f"{m} -> {d}" for m, deps in graph.items() for d, is_lazy in deps.items() if is_lazy)
    assert not lazy, f"function-level imports between accounting modules (a cycle dodged?): {lazy}"
    assert "_rdp" not in graph["_amplify"] and "_rdp" not in graph["_events"]  # the math needs no interpreter


def test_cycle_check_catches_a_cycle() -> None:
    assert _cycle({"_a": {"_b": False}, "_b": {"_c": False}, "_c": {"_a": True}}) == ["_a", "_b", "_c", "_a"]
    assert _cycle({"_a": {"_b": False}, "_b": {}}) is None


def _writes_to_other_modules(path: Path) -> list[str]:
    """Assignments like ``module.REGISTRY[key] = ...`` / ``module.REGISTRY.update(...)`` on a dptune module."""
    tree = ast.parse(path.read_text())
    modules = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
               if a.name.startswith("dptune")}
    modules |= {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                and (n.module or "").startswith("dptune") for a in n.names}  # `from dptune.pkg import _module`
    bad = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AugAssign | ast.AnnAssign) else []
        for t in targets:
            if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Attribute) and isinstance(
                    t.value.value, ast.Name) and t.value.value.id in modules:
                bad.append(f"{path.name}:{node.lineno}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in (
                "update", "setdefault", "__setitem__") and isinstance(node.func.value, ast.Attribute) and isinstance(
                node.func.value.value, ast.Name) and node.func.value.value.id in modules:
            bad.append(f"{path.name}:{node.lineno}")
    return bad


def test_no_module_writes_a_registry_of_another() -> None:
    from types import MappingProxyType

    from dptune.accounting import STOPPING_RULES, _events

    bad = [w for p in MODULES for w in _writes_to_other_modules(p)]
    assert not bad, f"a module writes another module's registry: {bad}"
    # the two registries are read-only mappings, defined once
    assert isinstance(STOPPING_RULES, MappingProxyType) and isinstance(_events._ALLOWED, MappingProxyType)
    hits = [p for p in MODULES if "_ALLOWED[" in p.read_text() or "_CLASSES[" in p.read_text()]
    assert all(p.name == "_events.py" for p in hits), hits


def test_registry_write_check_catches_one(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("from dptune.accounting import _events\n_events._ALLOWED['X'] = object\n")
    assert _writes_to_other_modules(bad) == ["bad.py:2"]
