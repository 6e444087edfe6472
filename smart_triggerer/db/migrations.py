"""One way to change a schema: versioned files ``sql/NNNN_name.sql`` applied in order, once each, and
recorded in the schema's own ``migration`` table; named queries in ``sql/queries.sql``. The triggerer's
schema (``smart_triggerer``) and the dataset bridge's (``dataset_bridge``) both change this way.

A migration runs as one batch of statements in the caller's transaction, after the caller took the
schema's advisory lock: instances and bridge processes that start at once apply each file once. A
deployment made before a schema had versions upgrades in place: its first file creates what is missing
(``IF NOT EXISTS``) and changes nothing that is there.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from importlib import resources
from typing import Any

from sqlalchemy import text

MIGRATION_FILE = re.compile(r"^(\d{4})_(\w+)\.sql$")

# (version, name, sql)
Migration = tuple[int, str, str]


def shipped(package: str) -> tuple[Migration, ...]:
    """The migrations in ``package``'s ``sql/`` folder, in order."""
    found = []
    for entry in resources.files(package).joinpath("sql").iterdir():
        match = MIGRATION_FILE.match(entry.name)
        if match:
            found.append((int(match.group(1)), match.group(2), entry.read_text()))
    return tuple(sorted(found))


def named_queries(package: str) -> dict[str, str]:
    """``package``'s ``sql/queries.sql``: each query follows a ``-- name: NAME`` line; its comment lines
    and the final ``;`` are left out."""
    source = resources.files(package).joinpath("sql/queries.sql").read_text()
    found: dict[str, str] = {}
    for block in re.split(r"^-- name: ", source, flags=re.MULTILINE)[1:]:
        name, _, body = block.partition("\n")
        lines = [line for line in body.splitlines() if not line.startswith("--")]
        found[name.strip()] = "\n".join(lines).strip().rstrip(";")
    return found


def apply(session: Any, schema: str, migrations: Iterable[Migration]) -> list[Migration]:
    """Create ``schema`` and its ``migration`` table when missing, then apply the migrations not yet
    recorded there, in order; the caller holds the schema's lock and owns the transaction. ``schema`` is
    one of ours, never a user's input."""
    session.execute(text(f"CREATE SCHEMA IF NOT EXISTS {schema}"))
    session.execute(
        text(
            f"CREATE TABLE IF NOT EXISTS {schema}.migration (version integer PRIMARY KEY, "
            "name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())"
        )
    )
    applied = set(session.execute(text(f"SELECT version FROM {schema}.migration")).scalars())
    done = []
    for version, name, sql in migrations:
        if version in applied:
            continue
        session.connection().exec_driver_sql(sql)
        session.execute(
            text(f"INSERT INTO {schema}.migration (version, name) VALUES (:version, :name)"),
            {"version": version, "name": name},
        )
        done.append((version, name, sql))
    return done
