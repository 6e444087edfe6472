"""Creating the bridge's tables in Airflow's metadata database, safely when processes start at once."""

from __future__ import annotations

from typing import Any

from sqlalchemy import text

# One lock for every creator of the dataset_bridge schema (task-success bridge, outbox, inbox): concurrent
# CREATE SCHEMA/TABLE ... IF NOT EXISTS can still collide on the catalog, also across the three.
_LOCK_KEY = 7212400102


def apply(session: Any, ddl: str) -> None:
    """Run ``ddl`` (statements separated by ``;``) in the session's transaction, one creator at a time."""
    session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _LOCK_KEY})
    for statement in ddl.split(";"):
        if statement.strip():
            session.execute(text(statement))
