"""Pruning the bridge's ledgers, in small batches, so they stop growing with every event.

Every ledger is kept only as long as it can still prevent a duplicate:

- ``dataset_bridge.emitted`` (task successes): a try is only looked at while it ended within the
  retention period (``task_success.PENDING_SUCCESSES``), and its ledger row is never older than the try,
  so rows older than the retention can go.
- ``dataset_bridge.reconciled``: the reconciler only looks at events within its lookback window.
- ``dataset_bridge.inbox`` (B): a relay redelivers a batch within minutes (its retries end in the dead
  letter after ``max_attempts``), never after the retention.
- ``smart_triggerer.asset_event_key`` (watcher events): a status row is redelivered only while it is
  after its table's watermark, which follows within seconds of the event being stored.
- ``dataset_bridge.outbox`` (A): delivered rows; dead-lettered rows stay for the operator.

Each batch is one short transaction (``DELETE ... WHERE ctid IN (SELECT ... LIMIT n)``), so pruning a
large backlog never holds locks for long, and a pass stops after ``max_batches``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import structlog
from sqlalchemy import text

log = structlog.get_logger(__name__)

DEFAULT_RETENTION_DAYS = 30.0
BATCH = 1000

# table -> (age column, extra condition); only tables that exist are pruned
LEDGERS = {
    "dataset_bridge.emitted": ("created_at", "TRUE"),
    "dataset_bridge.reconciled": ("queued_at", "TRUE"),
    "dataset_bridge.inbox": ("received_at", "TRUE"),
    "smart_triggerer.asset_event_key": ("created_at", "TRUE"),
    "dataset_bridge.outbox": ("delivered_at", "status = 'delivered'"),
}


@dataclass(frozen=True)
class Retention:
    """How long ledgers are kept and how pruning is paced."""

    days: float = DEFAULT_RETENTION_DAYS
    batch: int = BATCH
    max_batches: int = 100

    @property
    def seconds(self) -> float:
        return self.days * 86400.0


def prune_sql(table: str) -> str:
    column, condition = LEDGERS[table]
    return (
        f"DELETE FROM {table} WHERE ctid IN (SELECT ctid FROM {table} "
        f"WHERE {condition} AND {column} < now() - make_interval(secs => :secs) LIMIT :batch)"
    )


def prune(session_factory: Any, tables: list[str], retention: Retention) -> dict[str, int]:
    """Rows deleted per table; each batch in its own transaction from ``session_factory()``."""
    deleted: dict[str, int] = {}
    for table in tables:
        with session_factory() as session:
            if not session.execute(text("SELECT to_regclass(:t) IS NOT NULL"), {"t": table}).scalar():
                continue
        total = 0
        for _ in range(retention.max_batches):
            with session_factory() as session:
                result = session.execute(
                    text(prune_sql(table)), {"secs": retention.seconds, "batch": retention.batch}
                )
                count = int(getattr(result, "rowcount", 0) or 0)
            total += count
            if count < retention.batch:
                break
        if total:
            log.info("pruned", table=table, rows=total, retention_days=retention.days)
        deleted[table] = total
    return deleted


DEFAULT = Retention()
