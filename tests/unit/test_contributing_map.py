"""CONTRIBUTING.md's "Where things are" table matches the tree: every folder and file it names exists,
and every top-level folder and every room of ``smart_triggerer/`` is in it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SECTION = re.compile(r"## Where things are\n(.*?)\n## ", re.S)


def mapped(contributing: str) -> tuple[set[str], set[str]]:
    """(the folders and files of the table's first column, the files its second column names)."""
    table = SECTION.search(contributing)
    assert table is not None, "CONTRIBUTING.md has no 'Where things are' section"
    firsts, named = set(), set()
    for row in table.group(1).splitlines():
        cells = row.split("|")
        if len(cells) < 4 or not cells[1].strip().startswith("`"):
            continue
        places = re.findall(r"`([^`]+)`", cells[1])
        firsts.update(places)
        folder = places[0] if places[0].endswith("/") else ""
        for name in re.findall(r"`([\w/]+\.py|\w+/)`", cells[2]):
            named.add(name if "/" in name.rstrip("/") else folder + name)
    return firsts, named


def tracked_folders() -> set[str]:
    """Top-level folders of the checkout as git sees them (no dot folders, nothing ignored) and the
    packages inside smart_triggerer/."""
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    top = {name.split("/")[0] + "/" for name in files if "/" in name and not name.startswith(".")}
    rooms = {
        "/".join(name.split("/")[:2]) + "/"
        for name in files
        if name.startswith("smart_triggerer/") and name.count("/") >= 2 and name.endswith("__init__.py")
    }
    return top | rooms


def test_every_place_the_map_names_exists() -> None:
    firsts, named = mapped((ROOT / "CONTRIBUTING.md").read_text())
    missing = sorted(place for place in firsts | named if not (ROOT / place).exists())
    assert missing == [], f"CONTRIBUTING.md names what the tree does not have: {missing}"


def test_every_folder_and_room_is_on_the_map() -> None:
    firsts, _ = mapped((ROOT / "CONTRIBUTING.md").read_text())
    covered = {place if place.endswith("/") else place.split("/")[0] + "/" for place in firsts}
    unmapped = sorted(tracked_folders() - covered)
    assert unmapped == [], f"not in CONTRIBUTING.md's 'Where things are': {unmapped}"


def test_the_check_sees_a_folder_the_map_lacks() -> None:
    text = "## Where things are\n\n| folder | what |\n|---|---|\n| `docs/` | `gone.py` |\n\n## Next\n"
    firsts, named = mapped(text)
    assert firsts == {"docs/"} and named == {"docs/gone.py"}
    assert "smart_triggerer/db/" in tracked_folders() - firsts
