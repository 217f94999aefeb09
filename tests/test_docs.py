"""The README is a front door and the docs cannot rot: every relative link in README.md and docs/*.md reaches a
file (and a heading, for an anchor), the generated key reference matches the code, and the MkDocs site builds
strictly (a broken link or anchor there is an error too)."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """The text without fenced blocks and code spans (whose brackets are not links)."""
    return _CODE.sub("", _FENCE.sub("", text))


def github_slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it (lower case, punctuation dropped, each space a hyphen)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    for line in _FENCE.sub("", page.read_text()).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            slug = github_slug(m.group(1))
            n, unique = 0, slug
            while unique in found:
                n += 1
                unique = f"{slug}-{n}"
            found.add(unique)
    return found


def relative_links(page: Path) -> list[str]:
    return [t for t in _LINK.findall(_prose(page.read_text())) if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]


def test_github_slugs() -> None:
    assert github_slug("The main job, end to end") == "the-main-job-end-to-end"
    assert github_slug("Does private tuning pay on MNIST?") == "does-private-tuning-pay-on-mnist"
    assert github_slug("`space:` and `default:`") == "space-and-default"


def test_readme_is_a_front_door() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 160, f"README.md has {len(lines)} lines; move detail into docs/"
    head = "\n".join(lines[:40])
    assert "make search" in head and "make test" in head
    targets = relative_links(ROOT / "README.md")
    assert "ARCHITECTURE.md" in targets and any(t.startswith("docs/") for t in targets)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    links = relative_links(page)
    broken = []
    for target in links:
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with that anchor in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_space_key_reference_is_generated_from_the_code() -> None:
    spec = importlib.util.spec_from_file_location("gen_spaces", ROOT / "docs" / "gen_spaces.py")
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert not gen.stale(), "docs/spaces.md is stale: run python docs/gen_spaces.py"
    from dptune.config import DatasetSpec, PrivacySpec, TrialConfig

    page = (ROOT / "docs" / "spaces.md").read_text()
    from dptune.config import stopping

    for name in stopping.choices():  # every rule and each of its settings (PrivacySpec.stopping_settings)
        assert f"| `{name}` | " + ", ".join(f"`{s}`" for s in stopping.rule_info(name).settings[:1]) in page, name
    for cls in (TrialConfig, DatasetSpec, PrivacySpec):  # every field has a row (seed and score_noise: refused)
        for name in set(cls.__dataclass_fields__) - {"stopping_settings"}:
            assert f"| `{name}` |" in page or f"- `{name}`:" in page, f"{cls.__name__}.{name} is not in docs/spaces.md"


def make_docs(root: Path, site: Path) -> subprocess.CompletedProcess[str]:
    """`make docs` in the checkout at root, as CI and a developer run it, with this interpreter's bin dir as the
    venv's (its install step skipped) and the site built into site."""
    stamp = root / ".venv" / ".dptune-installed"
    return subprocess.run(["make", "--no-print-directory", "-C", str(root), "-o", str(stamp), "docs",
                           f"STAMP={stamp}", f"BIN={Path(sys.executable).parent}", f"SITE={site}"],
                          capture_output=True, text=True, timeout=300)


_needs_mkdocs = pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None,
                                   reason="mkdocs is not installed (pip install -e '.[dev]')")


@_needs_mkdocs
def test_the_site_builds_strictly(tmp_path: Path) -> None:
    r = make_docs(ROOT, tmp_path / "site")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "WARNING" not in r.stdout + r.stderr, r.stdout + r.stderr
    assert (tmp_path / "site" / "spaces" / "index.html").is_file()
    assert (tmp_path / "site" / "repo" / "bench" / "results" / "audit" / "index.html").is_file()


@_needs_mkdocs
def test_the_docs_gate_fails_on_a_broken_link_at_any_depth(tmp_path: Path) -> None:
    """The gate tried broken: a copy of the checkout where docs/results.md links a results page that links
    another, which links a file that does not exist. `make docs` must fail naming it (a build with -q, or
    hooks that took in only the files docs/ links to directly, passed)."""
    copy = tmp_path / "repo"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(".git", ".venv", "runs", "site", "tests", "*cache*"))
    results = copy / "bench" / "results"
    (results / "_depth1.md").write_text("# One\n\n[two](_depth2.md)\n")
    (results / "_depth2.md").write_text("# Two\n\n[gone](_no_such_record.md)\n")
    with (copy / "docs" / "results.md").open("a") as f:
        f.write("\n[one](../bench/results/_depth1.md)\n")
    r = make_docs(copy, tmp_path / "site")
    assert r.returncode != 0, r.stdout + r.stderr
    assert "_no_such_record.md" in r.stdout + r.stderr
    (results / "_depth2.md").write_text("# Two\n")  # and the same copy, mended, builds
    r = make_docs(copy, tmp_path / "site")
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "site" / "repo" / "bench" / "results" / "_depth2" / "index.html").is_file()
