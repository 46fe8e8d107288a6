"""Every relative link and #anchor in README.md and docs/*.md points at a file and a heading that exist.

Anchors are the ids GitHub gives headings (lower case, punctuation dropped, spaces to hyphens, ``-1``, ``-2`` for
repeats), so a renamed heading or a moved page fails here instead of leaving a dead link.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line outside fenced code blocks."""
    out, fenced = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((n, line))
    return out


def slug(heading: str) -> str:
    """GitHub's id for a heading's text: markup and punctuation dropped, lower case, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text stays, its target goes
    text = re.sub(r"<[^>]+>", "", text).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    ids = set()
    for _, line in prose_lines(page.read_text()):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        ids.add(base if n == 0 else f"{base}-{n}")
    ids.update(re.findall(r'<a (?:name|id)="([^"]+)"', page.read_text()))
    return ids


def links(page: Path) -> list[tuple[int, str]]:
    found = []
    for n, line in prose_lines(page.read_text()):
        for m in LINK.finditer(INLINE_CODE.sub("", line)):
            found.append((n, m.group(1)))
    return found


def test_the_anchor_of_a_heading_is_githubs():
    assert slug("Sizing a deployment — `launch bench`") == "sizing-a-deployment--launch-bench"
    assert slug("Keys, browsers and limits") == "keys-browsers-and-limits"
    assert slug("Render routes and `launch render`") == "render-routes-and-launch-render"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page: Path):
    broken = []
    for line, target in links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...: not ours to check
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / unquote(path)).resolve() if path else page
        if not dest.exists():
            broken.append(f"{page.name}:{line}: {target} (no such file)")
            continue
        if anchor and dest.suffix == ".md" and unquote(anchor) not in anchors(dest):
            broken.append(f"{page.name}:{line}: {target} (no heading with that anchor in {dest.name})")
    assert not broken, "\n".join(broken)
