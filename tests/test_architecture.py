"""The layer rules of ARCHITECTURE.md: imports point downwards only, Ray and Opacus stay in their homes,
no module imports a CLI, private modules stay inside their package. The rule engine is tested on
violating files, so a broken rule cannot pass silently."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "dptune"

CLIS = ("dptune.search", "dptune.train", "dptune.plan", "dptune.report", "dptune.ledger.__main__")
_LIBS = ("torch", "torchvision", "ray", "opacus")
_RECORDS = ("dptune.ledger", "dptune.certificate", "dptune.trials", "dptune.release", "dptune.rundir")
_TRAINER = ("dptune.dpsgd", "dptune.models", "dptune.data")
_ABOVE_ACCOUNTING = (*_RECORDS, *_TRAINER, "dptune._search", "dptune._plots", *CLIS)

# module (path prefix, relative to dptune/) -> forbidden import prefixes
RULES: dict[str, tuple[str, ...]] = {
    "errors.py": ("dptune.", *_LIBS),
    "_params.py": ("dptune.config", "dptune.accounting", *_RECORDS, *_TRAINER, *_LIBS),
    "config.py": ("dptune.accounting", *_RECORDS, *_TRAINER, "dptune._search", *_LIBS),
    "accounting/": (*_ABOVE_ACCOUNTING, *_LIBS),
    "ledger/": (*_TRAINER, "dptune._search", "dptune.release", *_LIBS),
    "certificate.py": (*_TRAINER, "dptune._search", "dptune.release", "dptune.trials", *_LIBS),
    "trials.py": ("dptune.accounting", *_TRAINER, "dptune._search", *_LIBS),
    "rundir.py": ("dptune.accounting", *_TRAINER, "dptune._search", *_LIBS),
    "release.py": (*_TRAINER, "dptune._search", "dptune.ledger", *_LIBS),
    "dpsgd": ("ray", "dptune.accounting", *_RECORDS, "dptune._search"),
    "models/": ("ray", "opacus", "dptune.accounting", *_RECORDS, "dptune.dpsgd", "dptune.data", "dptune._search"),
    "data/": ("ray", "opacus", "dptune.accounting", *_RECORDS, "dptune.dpsgd", "dptune.models", "dptune._search"),
    "_search/": (),
    "plan.py": ("torch", "ray", "opacus"),
    "report.py": ("torch", "ray", "opacus"),
    "_plots.py": ("torch", "ray", "opacus", "dptune.ledger", "dptune.certificate"),
}
ONLY = {"ray": ("_search/",), "opacus": ("dpsgd",)}


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
    for prefix, forbidden in RULES.items():
        if _applies(rel, prefix):
            out += [f"{rel} imports {i}" for i in sorted(imported) if any(_matches(i, f) for f in forbidden)
                    and not _matches(i, me)]
    for lib, allowed in ONLY.items():
        if any(_matches(i, lib) for i in imported) and not any(_applies(rel, a) for a in allowed):
            out.append(f"{rel} imports {lib}; only {allowed} may")
    for i in sorted(imported):
        if any(_matches(i, cli) for cli in CLIS) and not _matches(i, me):
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
    ("accounting/_x.py", "from dptune.report import main\n", "imports dptune.report"),
    ("accounting/_x.py", "from dptune import _plots\n", "imports dptune._plots"),
    ("config.py", "from dptune.accounting import plan_search\n", "imports dptune.accounting"),
    ("release.py", "from dptune._search import runner\n", "imports dptune._search"),
    ("trials.py", "import ray\n", "only"),
    ("models/_x.py", "import opacus\n", "imports opacus"),
    ("ledger/_store.py", "from dptune.train import main\n", "the CLI dptune.train"),
    ("release.py", "from dptune.accounting._subsample import transfer_config\n", "private to another package"),
    ("train.py", "from dptune._search.driver import run_search\n", ""),  # dptune._search is dptune's own
])
def test_rules_catch_a_violation(rel: str, source: str, expected: str) -> None:
    """The rule engine itself, on violating (and one allowed) sources: the layer test can fail."""
    found = violations(rel, source)
    if expected:
        assert any(expected in v for v in found), found
    else:
        assert not found, found


def test_architecture_doc_names_every_top_level_module() -> None:
    doc = (PKG.parent / "ARCHITECTURE.md").read_text()
    for p in sorted(PKG.iterdir()):
        if p.name.startswith("__") or p.suffix not in (".py", ""):
            continue
        assert f"`{p.name.removesuffix('.py')}" in doc or f"`{p.name}" in doc, f"ARCHITECTURE.md lacks {p.name}"


def test_lazy_dp_accounting_is_transparent() -> None:
    """dptune skips dp_accounting's slow package __init__ at import; the package still works fully."""
    code = ("import sys, dptune.plan; assert 'dp_accounting.pld' not in sys.modules, 'PLD imported eagerly'\n"
            "import dp_accounting\nfrom dp_accounting import dp_event\n"
            "assert dp_accounting.GaussianDpEvent is dp_event.GaussianDpEvent\n"
            "assert dp_accounting.pld.PLDAccountant is not None\nprint('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
