"""Every relative link in the README and the docs resolves: the file exists, and a link to a heading
(``file.md#heading``, ``#heading``) names a heading that file has (GitHub's anchors)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = sorted([ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md",
                    *(ROOT / "docs").rglob("*.md"), ROOT / "bench" / "RESULTS.md"])
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def prose(text: str) -> str:
    """The text without fenced code blocks and inline code, where brackets are not links."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(path: Path) -> set[str]:
    """GitHub's anchors for the headings of a markdown file (lowercase, punctuation dropped, spaces to
    hyphens; a repeated heading gets -1, -2...)."""
    found: set[str] = set()
    for line in prose(path.read_text()).splitlines():
        if not line.startswith("#"):
            continue
        title = line.lstrip("#").strip().lower()
        slug = re.sub(r"[^\w\- ]", "", title).replace(" ", "-")
        candidate, n = slug, 0
        while candidate in found:
            n += 1
            candidate = f"{slug}-{n}"
        found.add(candidate)
    return found


def links(path: Path) -> list[str]:
    return [m.group(1) for m in LINK.finditer(prose(path.read_text()))
            if not re.match(r"^[a-z][a-z0-9+.-]*:", m.group(1))]


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(document: Path) -> None:
    broken = []
    for target in links(document):
        file_part, _, anchor = target.partition("#")
        path = (document.parent / file_part).resolve() if file_part else document
        if not path.exists():
            broken.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{target}: {path.name} has no heading #{anchor}")
    assert not broken, f"{document.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_checker_sees_a_broken_link(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# A title\n\n[ok](#a-title) [gone](missing.md) `[code](not-a-link.md)`\n"
                    "```\n[fenced](also-not.md)\n```\n")
    assert links(page) == ["#a-title", "missing.md"]
    assert anchors(page) == {"a-title"}
