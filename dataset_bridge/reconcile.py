"""Every asset event the bridge emits is consumed: re-queue the ones Airflow held back.

apache/airflow#54659: when two events for one asset arrive a few milliseconds apart, the scheduler can
create a consumer run that consumes the first, then delete the queue row the second relied on; the second
waits, unconsumed, until some later event arrives. Airflow records which events each run consumed
(``dagrun_asset_event``), so the fix needs no new state: an event of ours (it carries an
``idempotency_key``) that is older than a grace period, was not consumed by a consumer DAG scheduled on
its asset, and has no queue row pending for that DAG gets its queue row back. The scheduler then creates a
run, which consumes it (a run consumes every event since the previous one). Each (event, DAG) is
re-queued at most once (``dataset_bridge.reconciled``), so a consumer that never runs cannot loop.

Chosen over partitioned assets because consumers keep plain ``schedule=[Asset(...)]`` and ``&``/``|``
conditions, and the fix vanishes by itself once Airflow stops holding events back.

Paused consumers (apache/airflow#49857): Airflow queues nothing for a paused DAG, so its events would be
dropped. We deliver them instead: events of ours emitted while a consumer was paused (within the lookback
window, and after the DAG first scheduled on the asset) are queued when it is unpaused, and its next run
consumes all of them at once. Pausing a consumer postpones, it does not discard; to discard, clear the
events in the UI before unpausing.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import text
from sqlalchemy.orm import Session

HELD_BACK = """
SELECT DISTINCT e.id AS event_id, e.asset_id, r.dag_id
FROM asset_event e
JOIN dag_schedule_asset_reference r ON r.asset_id = e.asset_id
JOIN dag d ON d.dag_id = r.dag_id
WHERE NOT d.is_paused AND NOT d.is_stale
  AND e.timestamp < now() - make_interval(secs => :grace)
  AND e.timestamp > now() - make_interval(secs => :lookback)
  AND e.timestamp > r.created_at
  AND (CAST(e.extra AS jsonb) ? 'idempotency_key'
       OR CAST(e.extra AS jsonb) -> 'payload' ? 'idempotency_key')
  AND NOT EXISTS (SELECT 1 FROM dagrun_asset_event c JOIN dag_run dr ON dr.id = c.dag_run_id
                  WHERE c.event_id = e.id AND dr.dag_id = r.dag_id)
  AND NOT EXISTS (SELECT 1 FROM asset_dag_run_queue q
                  WHERE q.asset_id = e.asset_id AND q.target_dag_id = r.dag_id)
  AND NOT EXISTS (SELECT 1 FROM dataset_bridge.reconciled x
                  WHERE x.asset_event_id = e.id AND x.dag_id = r.dag_id)
ORDER BY e.id
LIMIT 500
"""

REQUEUE = """
INSERT INTO asset_dag_run_queue (asset_id, target_dag_id, created_at)
VALUES (:asset_id, :dag_id, now())
ON CONFLICT DO NOTHING
"""


def held_back(session: Session, *, grace_seconds: float, lookback_seconds: float) -> list[Any]:
    return list(session.execute(text(HELD_BACK), {"grace": grace_seconds,
                                                  "lookback": lookback_seconds}).all())


def requeue(session: Session, *, grace_seconds: float = 15.0, lookback_seconds: float = 86400.0) -> int:
    """Queue consumer runs for held-back events of ours; returns how many (event, DAG) pairs."""
    rows = held_back(session, grace_seconds=grace_seconds, lookback_seconds=lookback_seconds)
    for row in rows:
        session.execute(text(REQUEUE), {"asset_id": row.asset_id, "dag_id": row.dag_id})
        session.execute(text("INSERT INTO dataset_bridge.reconciled (asset_event_id, dag_id) "
                             "VALUES (:e, :d) ON CONFLICT DO NOTHING"),
                        {"e": row.event_id, "d": row.dag_id})
    return len(rows)
