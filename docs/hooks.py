"""MkDocs hooks (``hooks:`` in mkdocs.yml; no plugin, nothing fetched).

The pages link to repository files outside ``docs/`` as ``../path`` (so the links work when browsing the
repository too): each such file is added to the site under ``repo/path`` and the links are rewritten to it,
so MkDocs' strict link and anchor checks cover them. So is every repository file that such a file links to,
and so on (a results page linking its own records): the site holds the whole closure, so a broken link at any
depth fails the build. A stale generated key reference (docs/spaces.md) fails the build.
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
_RELATIVE = re.compile(r"\]\((?![a-z][a-z0-9+.-]*:)([^)#\s]+)")  # a link with no scheme (http:, mailto:)


def _outside_targets() -> set[str]:
    """The repository files (outside docs/) that the top-level pages link to, and every repository file
    (outside docs/) that one of those links to, transitively. A link to a missing file is left out (the
    linking page then fails MkDocs' strict check)."""
    found: set[str] = set()
    todo = [target for page in DOCS.glob("*.md") for target in _OUTSIDE.findall(page.read_text())]
    todo.append("ARCHITECTURE.md")  # in the nav
    while todo:
        target = todo.pop()
        path = (ROOT / target).resolve()
        if target in found or not path.is_file() or not path.is_relative_to(ROOT) or path.is_relative_to(DOCS):
            continue
        found.add(target)
        if path.suffix == ".md":
            for link in _RELATIVE.findall(path.read_text()):
                dest = (path.parent / link).resolve()
                if dest.is_relative_to(ROOT):
                    todo.append(dest.relative_to(ROOT).as_posix())
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
    for target in sorted(_outside_targets()):
        files.append(File.generated(config, f"repo/{target}", abs_src_path=str(ROOT / target)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    if page.file.src_uri.startswith("repo/"):
        return markdown
    targets = _outside_targets()
    return _OUTSIDE.sub(lambda m: f"](repo/{m.group(1)}" if m.group(1) in targets else m.group(0), markdown)
