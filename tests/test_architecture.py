"""The layer rules of ARCHITECTURE.md: imports point downwards only, Ray and Opacus stay in their homes,
no module imports a CLI, private modules stay inside their package. The rule engine is tested on
violating files, so a broken rule cannot pass silently."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "dptune"

# the commands (dptune/cli/) and the `python -m dptune.<command>` entry points that run them
CLIS = ("dptune.cli", "dptune.search", "dptune.train", "dptune.plan", "dptune.report")
_LIBS = ("torch", "torchvision", "ray", "opacus")
_RECORDS = ("dptune.ledger", "dptune.certificate", "dptune.trials", "dptune.release", "dptune.rundir")
_TRAINER = ("dptune.dpsgd", "dptune.models", "dptune.data")
_ABOVE_ACCOUNTING = (*_RECORDS, *_TRAINER, "dptune.tuning", "dptune.plots", *CLIS)

# module (path prefix, relative to dptune/) -> forbidden import prefixes
RULES: dict[str, tuple[str, ...]] = {
    "errors.py": ("dptune.", *_LIBS),
    "config/params.py": ("dptune.config", "dptune.accounting", *_RECORDS, *_TRAINER, *_LIBS),  # only errors
    "config/": ("dptune.accounting", *_RECORDS, *_TRAINER, "dptune.tuning", *_LIBS),  # searchers too: no Ray
    "accounting/": (*_ABOVE_ACCOUNTING, *_LIBS),
    "ledger/": (*_TRAINER, "dptune.tuning", "dptune.release", *_LIBS),
    "certificate.py": (*_TRAINER, "dptune.tuning", "dptune.release", "dptune.trials", *_LIBS),
    "trials.py": ("dptune.accounting", *_TRAINER, "dptune.tuning", *_LIBS),
    "rundir.py": ("dptune.accounting", *_TRAINER, "dptune.tuning", *_LIBS),
    "release.py": (*_TRAINER, "dptune.tuning", "dptune.ledger", *_LIBS),
    "dpsgd": ("ray", "dptune.accounting", *_RECORDS, "dptune.tuning"),
    "models/": ("ray", "opacus", "dptune.accounting", *_RECORDS, "dptune.dpsgd", "dptune.data", "dptune.tuning"),
    "data/": ("ray", "opacus", "dptune.accounting", *_RECORDS, "dptune.dpsgd", "dptune.models", "dptune.tuning"),
    "tuning/": (),
    "final.py": ("dptune.tuning", "ray"),  # final training: the trainer and the records, no Ray, no search
    "audit/": ("ray", "opacus", "dptune.tuning.runner", "dptune.tuning.raysession", "dptune.tuning.trainable",
               *CLIS),  # a developer tool over the trainer, the sealed draw and the accountant; no Ray
    "cli/plan.py": ("torch", "ray", "opacus"),
    "cli/report.py": ("torch", "ray", "opacus"),
    "plots.py": ("torch", "ray", "opacus", "dptune.ledger", "dptune.certificate", "dptune.api"),
}
ONLY = {"ray": ("tuning/",), "opacus": ("dpsgd",)}


def _imports(source: str) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)  # `from dptune import search`
    return names


def _module_name(rel: str) -> str:
    return "dptune." + rel.removesuffix(".py").replace("/", ".").removesuffix(".__init__")


def _matches(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix if prefix.endswith(".") else prefix + ".")


def violations(rel: str, source: str) -> list[str]:
    """Every rule that module ``rel`` (a path relative to dptune/) with ``source`` breaks."""
    imported = _imports(source)
    me = _module_name(rel)
    out = []
    command = any(_matches(me, cli) for cli in CLIS)  # a command (or its entry point) may import commands
    if not command and me not in ("dptune.__init__", "dptune.api") and any(_matches(i, "dptune.api") for i in imported):
        out.append(f"{rel} imports the API dptune.api (the library never imports the layer above it)")
    for prefix, forbidden in RULES.items():
        if _applies(rel, prefix) and not (prefix.endswith("/") and command):  # a package's CLI is a CLI
            out += [f"{rel} imports {i}" for i in sorted(imported) if any(_matches(i, f) for f in forbidden)
                    and not _matches(i, me)]
    for lib, allowed in ONLY.items():
        if any(_matches(i, lib) for i in imported) and not any(_applies(rel, a) for a in allowed):
            out.append(f"{rel} imports {lib}; only {allowed} may")
    for i in sorted(imported):
        if not command and any(_matches(i, cli) for cli in CLIS):
            out.append(f"{rel} imports the CLI {i}")
        if _private_elsewhere(i, me):
            out.append(f"{rel} imports {i}, private to another package")
    return out


def _applies(rel: str, prefix: str) -> bool:
    """``prefix`` names a module (``release.py``, ``dpsgd``) or a package (``accounting/``)."""
    stem = prefix.rstrip("/").removesuffix(".py")
    return rel.removesuffix(".py") == stem or rel.startswith(stem + "/")


def _private_elsewhere(name: str, importer: str) -> bool:
    """``dptune.a._b.c`` is private to package ``dptune.a``: only modules inside it may import it."""
    parts = name.split(".")
    if parts[0] != "dptune":
        return False
    for k, part in enumerate(parts[1:], start=1):
        if part.startswith("_") and not part.startswith("__"):
            owner = ".".join(parts[:k])
            return not (importer == owner or importer.startswith(owner + "."))
    return False


MODULES = sorted(p for p in PKG.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PKG)))
def test_layer_rules(path: Path) -> None:
    rel = str(path.relative_to(PKG))
    assert not violations(rel, path.read_text())


@pytest.mark.parametrize("rel, source, expected", [
    ("accounting/_x.py", "import torch\n", "imports torch"),
    ("accounting/_x.py", "from dptune.cli.report import main\n", "imports dptune.cli"),
    ("final.py", "from dptune.cli._common import run_cli\n", "the CLI dptune.cli"),
    ("tuning/driver.py", "from dptune.api import search\n", "the API dptune.api"),
    ("tuning/driver.py", "import dptune.search\n", "the CLI dptune.search"),
    ("accounting/_x.py", "from dptune import plots\n", "imports dptune.plots"),
    ("config/load.py", "from dptune.accounting import plan_search\n", "imports dptune.accounting"),
    ("config/searchers/_x.py", "def f():\n    from ray.tune.search.optuna import OptunaSearch\n", "imports ray"),
    ("config/params.py", "from dptune.config.schema import TrialConfig\n", "imports dptune.config.schema"),
    ("release.py", "from dptune.tuning import runner\n", "imports dptune.tuning"),
    ("trials.py", "import ray\n", "only"),
    ("models/_x.py", "import opacus\n", "imports opacus"),
    ("ledger/_store.py", "from dptune.cli.train import main\n", "the CLI dptune.cli"),
    ("release.py", "from dptune.accounting._subsample import transfer_config\n", "private to another package"),
    ("cli/train.py", "from dptune.tuning.driver import run_search\n", ""),  # a command may import the library
])
def test_rules_catch_a_violation(rel: str, source: str, expected: str) -> None:
    """The rule engine itself, on violating (and one allowed) sources: the layer test can fail."""
    found = violations(rel, source)
    if expected:
        assert any(expected in v for v in found), found
    else:
        assert not found, found


def library_mains(root: Path) -> list[str]:
    """``__main__`` modules of library packages under ``root`` (a dptune tree): ``python -m dptune.<pkg>`` would run
    a command from inside the library, an arrow up to ``cli/``. Commands run as ``dptune <command>``,
    ``python -m dptune.cli.<command>`` or a top-level entry point (``dptune/search.py``)."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("__main__.py") if p.relative_to(root).parts[0] != "cli")


def test_no_library_package_runs_as_a_command(tmp_path: Path) -> None:
    assert library_mains(PKG) == []
    (tmp_path / "ledger").mkdir()
    (tmp_path / "ledger" / "__main__.py").write_text("from dptune.cli.ledger import main\n")
    (tmp_path / "cli").mkdir()
    (tmp_path / "cli" / "__main__.py").write_text("")
    assert library_mains(tmp_path) == ["ledger/__main__.py"]  # the check can fail; cli/ may have one


def test_architecture_doc_names_every_top_level_module() -> None:
    doc = (PKG.parent / "ARCHITECTURE.md").read_text()
    for p in sorted(PKG.iterdir()):
        if p.name.startswith("__") or p.suffix not in (".py", ""):
            continue
        assert f"`{p.name.removesuffix('.py')}" in doc or f"`{p.name}" in doc, f"ARCHITECTURE.md lacks {p.name}"


def test_lazy_dp_accounting_is_transparent() -> None:
    """dptune skips dp_accounting's slow package __init__ at import, and dptune plan the API's and ledger's
    imports; the packages still work fully."""
    code = ("import sys, dptune.cli.plan; assert 'dp_accounting.pld' not in sys.modules, 'PLD imported eagerly'\n"
            "eager = [m for m in ('dptune.api', 'dptune.ledger', 'dptune.certificate', 'pyarrow') if m in sys.modules]\n"
            "assert not eager, eager\n"
            "import dptune, dptune.api, dptune.ledger\n"
            "assert dptune.plan is dptune.api.plan and dptune.Ledger is dptune.ledger.Ledger\n"
            "from dptune import *\n"
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


def test_accounting_import_graph_is_acyclic() -> None:
    graph = _graph()
    assert {"_events", "_rdp", "_amplify", "_rules", "_catalogue", "_planner"} <= set(graph)
    assert import_cycle(graph) is None, f"import cycle in dptune/accounting: {' -> '.join(import_cycle(graph) or [])}"
    lazy = sorted(f"{m} -> {d}" for m, deps in graph.items() for d, is_lazy in deps.items() if is_lazy)
    assert not lazy, f"function-level imports between accounting modules (a cycle dodged?): {lazy}"
    assert "_rdp" not in graph["_amplify"] and "_rdp" not in graph["_events"]  # the math needs no interpreter


def test_cycle_check_catches_a_cycle() -> None:
    assert import_cycle({"_a": {"_b": False}, "_b": {"_c": False}, "_c": {"_a": True}}) == ["_a", "_b", "_c", "_a"]
    assert import_cycle({"_a": {"_b": False}, "_b": {}}) is None


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


def test_functions_and_files_stay_small() -> None:
    """STYLE: split by responsibility long before a function passes ~60 lines or a file ~400."""
    too_long = []
    for path in MODULES:
        source = path.read_text()
        rel = str(path.relative_to(PKG))
        if len(source.splitlines()) > 400:
            too_long.append(f"{rel}: {len(source.splitlines())} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > 60:
                    too_long.append(f"{rel}:{node.lineno} {node.name}(): {length} lines")
    assert not too_long, too_long


# --- no import cycle anywhere in dptune, counting TYPE_CHECKING and function-level (lazy) imports ----------

_MODULES = {".".join(p.relative_to(PKG.parent).with_suffix("").parts).removesuffix(".__init__"): p for p in MODULES}


def _module_of(name: str) -> str | None:
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        if ".".join(parts[:k]) in _MODULES:
            return ".".join(parts[:k])
    return None


def _all_imports(source: str) -> set[str]:
    """Every dptune module ``source`` imports anywhere (module level, TYPE_CHECKING, inside functions);
    ``from pkg import sub`` is an arrow to the submodule ``pkg.sub``, not to the package's __init__."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = [f"{node.module}.{a.name}" for a in node.names]
            names = [s for s in subs if s in _MODULES]
            if len(names) < len(subs):
                names.append(node.module)
        out.update(m for n in names if n.startswith("dptune") and (m := _module_of(n)))
    return out


def import_cycle(graph: Mapping[str, Iterable[str]]) -> list[str] | None:
    """One cycle of ``graph`` (module -> modules it imports), or None."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                return path[path.index(d):] + [d]
            if d not in state and (found := visit(d)):
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_cycle_even_counting_type_checking_and_lazy_imports() -> None:
    graph = {m: _all_imports(p.read_text()) - {m} for m, p in _MODULES.items()}
    assert import_cycle(graph) is None, " -> ".join(import_cycle(graph) or [])
    # the detector itself: a TYPE_CHECKING-only arrow back closes a cycle
    assert import_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    src = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from dptune.config import SearchSpace\n"
    assert _all_imports(src) == {"dptune.config"}
