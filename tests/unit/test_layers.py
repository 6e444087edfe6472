"""The dependency rules of docs/design.md, read from the imports of every module (those inside
functions too): a change that breaks one fails the build. Between the top-level folders here; inside
``smart_triggerer/`` by import-linter (pyproject.toml, ``lint-imports`` in the fast lane), and here the
rules it cannot state, on modules inside Airflow."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OURS = {
    "triggers",
    "deferrables",
    "smart_triggerer",
    "dataset_bridge",
    "devkit",
    "example_dags",
    "bench",
    "tests",
}

# what each room may import of ours (itself always); one file more where the rule names it
ALLOWED: dict[str, set[str]] = {
    "triggers": set(),
    "deferrables": {"triggers"},
    "dataset_bridge": {"triggers", "smart_triggerer"},
    "smart_triggerer": {"triggers"},
    "devkit": set(),
    "example_dags": {"deferrables", "dataset_bridge"},
    # bench/ drives the service like the tests, with the tests' seeding and database helpers
    "bench": {"triggers", "smart_triggerer", "dataset_bridge", "devkit", "tests"},
}
EXCEPTIONS = {
    ("smart_triggerer/web/page.py", "dataset_bridge"),  # the page reads the bridge through its store
}

# modules of Airflow and of the database drivers a part of the service never imports (import-linter
# names an outside package only whole): the runner opens no database session (Airflow's ADR-0005 for
# its own triggerer); pure modules use neither SQLAlchemy nor Airflow's ORM
SESSION = ("airflow.utils.session", "airflow.settings", "sqlalchemy", "asyncpg", "psycopg2")
FORBIDDEN_OUTSIDE: dict[str, tuple[str, ...]] = {
    "smart_triggerer/runner": SESSION,
    "smart_triggerer/placement": (*SESSION, "airflow.models"),
    "smart_triggerer/config.py": (*SESSION, "airflow.models"),
    "smart_triggerer/errors.py": (*SESSION, "airflow.models"),
    "smart_triggerer/waker.py": (*SESSION, "airflow.models"),
}


def imported_modules(path: Path) -> set[str]:
    """Every module this module imports, anywhere in it (``from a import b`` counts ``a`` and ``a.b``)."""
    modules: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.add(node.module)
            modules.update(f"{node.module}.{alias.name}" for alias in node.names)
    return modules


def imported_rooms(path: Path) -> set[str]:
    """Our top-level packages this module imports, anywhere in it."""
    return {name.split(".")[0] for name in imported_modules(path)} & OURS


def forbidden_outside_imports(root: Path) -> list[str]:
    found = []
    for where, forbidden in FORBIDDEN_OUTSIDE.items():
        paths = [root / where] if where.endswith(".py") else sorted((root / where).rglob("*.py"))
        for path in paths:
            for module in sorted(imported_modules(path)):
                if any(module == f or module.startswith(f + ".") for f in forbidden):
                    found.append(f"{path.relative_to(root).as_posix()} imports {module}")
    return found


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


def test_no_part_of_the_service_imports_what_its_room_forbids() -> None:
    assert forbidden_outside_imports(ROOT) == []


def test_the_outside_checker_sees_a_session_in_the_runner_and_the_orm_in_pure_code(tmp_path: Path) -> None:
    (tmp_path / "smart_triggerer" / "runner").mkdir(parents=True)
    (tmp_path / "smart_triggerer" / "placement").mkdir()
    for name in ("config.py", "errors.py", "waker.py"):
        (tmp_path / "smart_triggerer" / name).write_text("import json\n")
    (tmp_path / "smart_triggerer" / "runner" / "bad.py").write_text(
        "def later():\n    from airflow.utils.session import create_session\n"
    )
    (tmp_path / "smart_triggerer" / "placement" / "bad.py").write_text(
        "from airflow.models import TaskInstance\n"
    )
    assert forbidden_outside_imports(tmp_path) == [
        "smart_triggerer/runner/bad.py imports airflow.utils.session",
        "smart_triggerer/runner/bad.py imports airflow.utils.session.create_session",
        "smart_triggerer/placement/bad.py imports airflow.models",
        "smart_triggerer/placement/bad.py imports airflow.models.TaskInstance",
    ]


def test_the_checker_sees_a_broken_rule_also_inside_a_function(tmp_path: Path) -> None:
    (tmp_path / "triggers").mkdir()
    (tmp_path / "triggers" / "bad.py").write_text(
        "from triggers.pg import target_for\n\ndef later():\n    from smart_triggerer.db.store import Store\n"
    )
    (tmp_path / "deferrables").mkdir()
    (tmp_path / "deferrables" / "bad.py").write_text("import dataset_bridge.cli\n")
    assert broken_rules(tmp_path) == [
        "deferrables/bad.py imports dataset_bridge",
        "triggers/bad.py imports smart_triggerer",
    ]


@pytest.mark.parametrize("room", sorted(ALLOWED))
def test_every_room_exists(room: str) -> None:
    assert any((ROOT / room).rglob("*.py")), f"{room}/ has no modules: the rule checks nothing"
