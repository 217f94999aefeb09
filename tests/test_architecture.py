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
                    "dptune.models", "dptune.data", "dptune.search", "dptune.train", "dptune.plan"),
    "ledger.py": ("torch", "ray", "opacus", "dptune.dpsgd", "dptune.models", "dptune.data", "dptune.search",
                  "dptune.train"),
    "certificate.py": ("torch", "ray", "opacus", "dptune.dpsgd", "dptune.models", "dptune.data", "dptune.search",
                       "dptune.train", "dptune.ledger"),
    "dpsgd/": ("ray", "dptune.accounting", "dptune.ledger", "dptune.certificate", "dptune.search",
               "dptune.train"),
    "models/": ("ray", "opacus", "dptune.accounting", "dptune.ledger", "dptune.certificate", "dptune.search",
                "dptune.dpsgd", "dptune.data", "dptune.train"),
    "data/": ("ray", "opacus", "dptune.accounting", "dptune.ledger", "dptune.certificate", "dptune.search",
              "dptune.dpsgd", "dptune.models", "dptune.train"),
    "plan.py": ("torch", "ray", "opacus"),
    "report.py": ("torch", "ray", "opacus"),
    "_plots.py": ("torch", "ray", "opacus", "dptune.ledger", "dptune.certificate"),
}
ONLY = {"ray": ("_search/", "search.py"), "opacus": ("dpsgd/",)}


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
