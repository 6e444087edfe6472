"""Every relative link in the README and the docs resolves: the file exists, and a link to a heading
(``file.md#heading``, ``#heading``) names a heading that file has (GitHub's anchors)."""

from __future__ import annotations

import re
import subprocess
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = sorted(
    [
        ROOT / "README.md",
        ROOT / "CONTRIBUTING.md",
        ROOT / "CHANGELOG.md",
        ROOT / "example_dags" / "README.md",
        *(ROOT / "docs").rglob("*.md"),
        ROOT / "bench" / "RESULTS.md",
    ]
)
# [text](target) and [text](target "title"), and ![image](target)
LINK = re.compile(r"!?\[[^\]]*\]\(<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\)")
REFERENCE = re.compile(r"^\s*\[[^\]]+\]:\s*(\S+)", re.M)


@cache
def tracked() -> frozenset[Path]:
    """The repository's files (a link to an untracked one works here and breaks in a fresh clone)."""
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    return frozenset(ROOT / line for line in listed.stdout.splitlines())


def prose(text: str) -> str:
    """The text without fenced code blocks and inline code, where brackets are not links."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(path: Path) -> set[str]:
    """GitHub's anchors for the headings of a markdown file (lowercase, punctuation dropped, spaces to
    hyphens; a repeated heading gets -1, -2...)."""
    found: set[str] = set()
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    for line in text.splitlines():
        if not line.startswith("#"):
            continue
        title = line.lstrip("#").strip().lower().replace("`", "")  # code keeps its text in the anchor
        slug = re.sub(r"[^\w\- ]", "", title).replace(" ", "-")
        candidate, n = slug, 0
        while candidate in found:
            n += 1
            candidate = f"{slug}-{n}"
        found.add(candidate)
    return found


def links(path: Path) -> list[str]:
    text = prose(path.read_text())
    found = [m.group(1) for m in LINK.finditer(text)] + REFERENCE.findall(text)
    return [target for target in found if not re.match(r"^[a-z][a-z0-9+.-]*:", target)]


def broken_links(document: Path, root: Path, files: frozenset[Path]) -> list[str]:
    """The links of ``document`` that lead nowhere in the repository at ``root`` (whose files are
    ``files``): out of it, to a file it does not track, to a heading the file lacks."""
    broken = []
    for target in links(document):
        file_part, _, anchor = target.partition("#")
        path = (document.parent / file_part).resolve() if file_part else document
        if not path.is_relative_to(root):
            broken.append(f"{target}: outside the repository (a user's clone has only the repository)")
        elif not (path in files or any(f.is_relative_to(path) for f in files)):  # a file, or a folder
            broken.append(f"{target}: no such file in the repository")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{target}: {path.name} has no heading #{anchor}")
    return broken


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(document: Path) -> None:
    broken = broken_links(document, ROOT, tracked())
    assert not broken, f"{document.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_checker_sees_a_broken_link(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# A title\n\n## `[smart_triggerer]` settings\n\n[ok](#a-title) [gone](missing.md) "
        '[titled](gone.md "a title") `[code](not-a-link.md)`\n'
        "```\n[fenced](also-not.md)\n```\n[ref]: elsewhere.md\n"
    )
    assert links(page) == ["#a-title", "missing.md", "gone.md", "elsewhere.md"]
    assert anchors(page) == {"a-title", "smart_triggerer-settings"}


def test_a_link_out_of_the_repository_or_to_an_untracked_file_is_broken(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    (root / "docs").mkdir(parents=True)
    page, kept, untracked = root / "docs" / "page.md", root / "docs" / "kept.md", root / "docs" / "local.md"
    (tmp_path / "outside.md").write_text("# Outside\n")
    kept.write_text("# Kept\n")
    untracked.write_text("# Local\n")
    page.write_text("[out](../../outside.md) [kept](kept.md#kept) [local](local.md) [folder](.)\n")
    assert broken_links(page.resolve(), root.resolve(), frozenset({page.resolve(), kept.resolve()})) == [
        "../../outside.md: outside the repository (a user's clone has only the repository)",
        "local.md: no such file in the repository",
    ]


def test_no_document_refers_to_a_folder_beside_the_repository() -> None:
    """The docs stand alone: nothing points into folders a user's clone does not have."""
    for document in DOCUMENTS:
        assert "../shared" not in document.read_text(), document
