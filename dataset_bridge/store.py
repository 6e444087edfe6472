"""The dataset bridge's state in Airflow's metadata database: its schema, changed only by the versioned
migrations in ``sql/`` (run by the triggerer's migration runner, ``smart_triggerer.db.migrations``), and
the reads others make of it (the triggerer's page). The watched databases' watermark table is the status
trigger's (``sql/status_watermark.sql``, created when missing): it lives in a database the bridge does not
own, so no migration runs there.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from sqlalchemy import text

from smart_triggerer.db import migrations as migration_files
from smart_triggerer.db.migrations import Migration

SCHEMA = "dataset_bridge"

# One lock for every process that migrates the schema (task-success bridge, relay, inbox): each file is
# applied once when they start at once.
LOCK_KEY = 7212400102


@cache
def migrations() -> tuple[Migration, ...]:
    return migration_files.shipped("dataset_bridge")


@cache
def queries() -> dict[str, str]:
    return migration_files.named_queries("dataset_bridge")


def migrate(session: Any) -> list[int]:
    """Apply the bridge's pending migrations in the session's transaction, one process at a time."""
    session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": LOCK_KEY})
    return [version for version, _name, _sql in migration_files.apply(session, SCHEMA, migrations())]


# the page's bridge panel: each part needs its table (the watermarks are in the metadata database only
# where a status trigger keeps them there); parts are constants, joined into one query
PANEL_PARTS = {
    "dataset_bridge.outbox": ("panel_targets", "panel_dead_letters"),
    "dataset_bridge.status_watermark": ("panel_watermarks",),
    "dataset_bridge.reconciled": ("panel_requeued",),
}


def panel(session: Any) -> dict[str, Any] | None:
    """The triggerer page's bridge panel in one query over the bridge's tables that exist (None: no
    bridge in this deployment)."""
    tables = {"tables": list(PANEL_PARTS)}
    present = session.execute(text(queries()["present_tables"]), tables).scalars().all()
    if not present:
        return None
    parts = ",".join(
        f"'{part.removeprefix('panel_')}', ({queries()[part]})"
        for table, names in PANEL_PARTS.items()
        if table in present
        for part in names
    )
    found = session.execute(text(f"SELECT json_build_object({parts})")).scalar()  # parts are constants
    return {"targets": [], "dead_letters": [], "watermarks": [], "requeued": None, **found}
