"""MkDocs hooks (``hooks:`` in mkdocs.yml; no plugin, nothing fetched).

The pages link to repository files outside ``docs/`` as ``../path`` (so the links work when browsing the
repository too): each such file is added to the site under ``repo/path`` and the links are rewritten to it,
so MkDocs' strict link and anchor checks cover them. A stale generated key reference (docs/spaces.md) fails
the build.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
_OUTSIDE = re.compile(r"\]\(\.\./([^)#\s]+)")


_RELATIVE = re.compile(r"\]\((?![a-z]+:|#|/)([^)#\s]+)")


def _outside_targets() -> set[str]:
    """The repository files (outside docs/) that the top-level pages link to, and the Markdown files those link to
    in turn (relative links, e.g. a results page's companions), so a linked page's own links resolve."""
    found = set()
    for page in DOCS.glob("*.md"):
        for target in _OUTSIDE.findall(page.read_text()):
            if (ROOT / target).is_file():
                found.add(target)
    todo = [t for t in found if t.endswith(".md")]
    while todo:
        page = ROOT / todo.pop()
        for link in _RELATIVE.findall(page.read_text()):
            target = (page.parent / link).resolve()
            if target.is_file() and target.is_relative_to(ROOT) and not target.is_relative_to(DOCS):
                rel = target.relative_to(ROOT).as_posix()
                if rel not in found:
                    found.add(rel)
                    if rel.endswith(".md"):
                        todo.append(rel)
    return found


def on_pre_build(config: Any) -> None:
    sys.path.insert(0, str(DOCS))
    try:
        import gen_spaces
    finally:
        sys.path.remove(str(DOCS))
    if gen_spaces.stale():
        raise PluginError("docs/spaces.md is stale: run python docs/gen_spaces.py")


def on_files(files: Files, config: Any) -> Files:
    for target in sorted(_outside_targets() | {"ARCHITECTURE.md"}):  # ARCHITECTURE.md is in the nav
        files.append(File.generated(config, f"repo/{target}", abs_src_path=str(ROOT / target)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    if page.file.src_uri.startswith("repo/"):
        return markdown
    targets = _outside_targets()
    return _OUTSIDE.sub(lambda m: f"](repo/{m.group(1)}" if m.group(1) in targets else m.group(0), markdown)
