"""The release: its version is set in one place (pyproject.toml), the CHANGELOG's newest section is that
version, dated, and every version the docs show in a command or its output is that one."""

from __future__ import annotations

import datetime as dt
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
SHOWN = re.compile(r"airflow_smart_triggerer-(\d+\.\d+\.\d+)|smart-triggerer (\d+\.\d+\.\d+)")


def test_the_changelogs_newest_section_is_this_version_dated() -> None:
    newest = re.search(r"^## (\S+) \(([^)]*)\)", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert newest is not None, "CHANGELOG.md has no '## VERSION (DATE)' section"
    assert newest.group(1) == VERSION, (newest.group(1), VERSION)
    assert newest.group(2) == "unreleased" or dt.date.fromisoformat(newest.group(2)), newest.group(2)


def test_the_docs_show_this_version() -> None:
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for match in SHOWN.finditer(path.read_text()):
            shown = match.group(1) or match.group(2)
            assert shown == VERSION, (
                f"{path.relative_to(ROOT)} shows {match.group(0)}; the version is {VERSION}"
            )
