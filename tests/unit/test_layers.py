"""The dependency rules of docs/design.md, read from the imports of every module (those inside
functions too): a change that breaks one fails the build."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OURS = {"triggers", "deferrables", "triggerer", "dataset_bridge", "commandline", "devkit", "example_dags",
        "bench", "tests"}

# what each room may import of ours (itself always); one file more where the rule names it
ALLOWED: dict[str, set[str]] = {
    "triggers": set(),
    "commandline": set(),
    "deferrables": {"triggers"},
    "dataset_bridge": {"triggers", "commandline"},
    "triggerer": {"triggers", "commandline"},
    "devkit": set(),
    "example_dags": {"deferrables", "dataset_bridge"},
    # bench/ drives the service like the tests, with the tests' seeding and database helpers
    "bench": {"triggers", "triggerer", "dataset_bridge", "devkit", "tests"},
}
EXCEPTIONS = {
    ("triggerer/cli.py", "devkit"),  # the CLI's `demo` command runs the demo
}


def imported_rooms(path: Path) -> set[str]:
    """Our top-level packages this module imports, anywhere in it."""
    rooms = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        rooms.update(name.split(".")[0] for name in names if name.split(".")[0] in OURS)
    return rooms


def broken_rules(root: Path) -> list[str]:
    broken = []
    for room, allowed in ALLOWED.items():
        for path in sorted((root / room).rglob("*.py")):
            relative = path.relative_to(root).as_posix()
            for other in sorted(imported_rooms(path) - allowed - {room}):
                if (relative, other) not in EXCEPTIONS:
                    broken.append(f"{relative} imports {other}")
    return sorted(broken)


def test_every_room_imports_only_what_the_design_allows() -> None:
    assert broken_rules(ROOT) == []


def test_the_checker_sees_a_broken_rule_also_inside_a_function(tmp_path: Path) -> None:
    (tmp_path / "triggers").mkdir()
    (tmp_path / "triggers" / "bad.py").write_text(
        "from triggers.pg import target_for\n\ndef later():\n    from triggerer.store import Store\n")
    (tmp_path / "deferrables").mkdir()
    (tmp_path / "deferrables" / "bad.py").write_text("import dataset_bridge.cli\n")
    assert broken_rules(tmp_path) == ["deferrables/bad.py imports dataset_bridge",
                                      "triggers/bad.py imports triggerer"]


@pytest.mark.parametrize("room", sorted(ALLOWED))
def test_every_room_exists(room: str) -> None:
    assert any((ROOT / room).rglob("*.py")), f"{room}/ has no modules: the rule checks nothing"
