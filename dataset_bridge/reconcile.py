"""Every asset event the bridge emits is consumed: re-queue the ones Airflow held back.

apache/airflow#54659: when two events for one asset arrive a few milliseconds apart, the scheduler can
create a consumer run that consumes the first, then delete the queue row the second relied on; the second
waits, unconsumed, until some later event arrives. Airflow records which events each run consumed
(``dagrun_asset_event``), so the fix needs no new state: an event of ours (it carries an
``idempotency_key``) that is older than a grace period, was not consumed by a consumer DAG scheduled on
its asset, and has no queue row pending for that DAG gets its queue row back. The scheduler then creates a
run, which consumes it (a run consumes every event since the previous one). Each (event, DAG) is
re-queued at most once (``dataset_bridge.reconciled``), so a consumer that never runs cannot loop.

What is re-queued, exactly: an event of ours, older than the grace period and inside the lookback window,
for each DAG that schedules on it (by asset, by name or URI reference, or through an alias the event
came by), when

- no asset-triggered run of that DAG has ``run_after`` at or after the event: a new run's window,
  (latest ``run_after``, now], then really contains it. An event at or before the latest run's
  ``run_after`` that no run consumed can never be consumed; it is reported as ``unconsumable``, not
  re-queued (that would only make an empty run);
- no queue row for that (asset, DAG) is pending;
- no operator cleared that DAG's (or that asset's) queued events after the event was emitted
  (``DELETE .../queuedEvents`` in the REST API or the UI, found in Airflow's audit log): reported as
  ``cleared``, never undone.

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

# (event, consumer DAG) pairs of our events inside the window; every way a DAG can schedule on an asset
CANDIDATES = """
WITH ours AS (
    SELECT e.id, e.asset_id, e.timestamp FROM asset_event e
    -- from the window's first event id on (a primary-key range: no scan of older events by timestamp)
    WHERE e.id >= :from_id
      AND e.timestamp < now() - make_interval(secs => :grace)
      AND e.timestamp > now() - make_interval(secs => :lookback)
      -- CASE keeps the cast away from an extra jsonb refuses (a NUL character, say): such an event is not
      -- read as ours, and the others still are
      AND CASE WHEN strpos(CAST(e.extra AS text), 'idempotency_key') = 0 THEN false
               WHEN dataset_bridge.jsonb_error(CAST(e.extra AS text)) IS NOT NULL THEN false
               ELSE CAST(e.extra AS jsonb) ? 'idempotency_key'
                    OR CAST(e.extra AS jsonb) -> 'payload' ? 'idempotency_key' END
), consumers AS (
    SELECT o.id AS event_id, r.dag_id, r.created_at AS since
    FROM ours o JOIN dag_schedule_asset_reference r ON r.asset_id = o.asset_id
    UNION ALL
    SELECT o.id, n.dag_id, n.created_at
    FROM ours o JOIN asset a ON a.id = o.asset_id JOIN dag_schedule_asset_name_reference n ON n.name = a.name
    UNION ALL
    SELECT o.id, u.dag_id, u.created_at
    FROM ours o JOIN asset a ON a.id = o.asset_id JOIN dag_schedule_asset_uri_reference u ON u.uri = a.uri
    UNION ALL
    SELECT o.id, ar.dag_id, ar.created_at
    FROM ours o JOIN asset_alias_asset_event x ON x.event_id = o.id
    JOIN dag_schedule_asset_alias_reference ar ON ar.alias_id = x.alias_id
)
SELECT o.id AS event_id, o.asset_id, o.timestamp, c.dag_id,
       (SELECT max(dr.run_after) FROM dag_run dr
        WHERE dr.dag_id = c.dag_id AND dr.run_type = 'asset_triggered') AS last_run_after,
       EXISTS (SELECT 1 FROM log l
               WHERE l.event IN ('delete_dag_asset_queued_events', 'delete_dag_asset_queued_event',
                                 'delete_asset_queued_events')
                 AND l.dttm >= o.timestamp
                 AND (l.dag_id = c.dag_id OR l.dag_id IS NULL)
                 AND (l.event = 'delete_dag_asset_queued_events'
                      -- only these API events' extra is JSON (and then not always one jsonb takes): CASE
                      -- keeps the cast away from the others
                      OR CASE WHEN l.event IN ('delete_dag_asset_queued_event', 'delete_asset_queued_events')
                                   AND dataset_bridge.jsonb_error(l.extra) IS NULL
                              THEN CAST(l.extra AS jsonb) ->> 'asset_id' END = CAST(o.asset_id AS text)))
       AS cleared
FROM ours o
JOIN (SELECT event_id, dag_id, min(since) AS since FROM consumers GROUP BY event_id, dag_id) c
  ON c.event_id = o.id
JOIN dag d ON d.dag_id = c.dag_id
WHERE NOT d.is_paused AND NOT d.is_stale
  AND o.timestamp > c.since
  AND NOT EXISTS (SELECT 1 FROM dagrun_asset_event ce JOIN dag_run dr ON dr.id = ce.dag_run_id
                  WHERE ce.event_id = o.id AND dr.dag_id = c.dag_id)
  AND NOT EXISTS (SELECT 1 FROM asset_dag_run_queue q
                  WHERE q.asset_id = o.asset_id AND q.target_dag_id = c.dag_id)
  AND NOT EXISTS (SELECT 1 FROM dataset_bridge.reconciled x
                  WHERE x.asset_event_id = o.id AND x.dag_id = c.dag_id)
ORDER BY o.id, c.dag_id
LIMIT 500
"""

# The first event id inside the lookback window, found from the previous one by the primary key: ids
# follow insertion, so the window's start only moves forward (an index range scan of the events that
# left the window since the last pass).
WINDOW_START = """
SELECT coalesce(
    (SELECT id FROM asset_event WHERE id >= :from_id AND timestamp > now() - make_interval(secs => :lookback)
     ORDER BY id LIMIT 1),
    (SELECT coalesce(max(id), 0) + 1 FROM asset_event))
"""

REQUEUE = """
INSERT INTO asset_dag_run_queue (asset_id, target_dag_id, created_at)
VALUES (:asset_id, :dag_id, now())
ON CONFLICT DO NOTHING
"""

RECORD = """
INSERT INTO dataset_bridge.reconciled (asset_event_id, dag_id, outcome, reason)
VALUES (:e, :d, :outcome, :reason) ON CONFLICT DO NOTHING
"""

REQUEUED = "requeued"
CLEARED = "cleared"
UNCONSUMABLE = "unconsumable"


def decide(row: Any) -> tuple[str, str]:
    """(outcome, why) for one held-back (event, DAG) pair."""
    if row.cleared:
        return CLEARED, "an operator cleared this DAG's queued events after the event: left cleared"
    if row.last_run_after is not None and row.timestamp <= row.last_run_after:
        latest = row.last_run_after.isoformat()
        return UNCONSUMABLE, (
            f"the DAG's latest asset-triggered run (run_after {latest}) is not before "
            "the event, so no new run would consume it"
        )
    return REQUEUED, "no run consumed it and none was queued (held back, apache/airflow#54659, or paused)"


def window_start(session: Session, *, lookback_seconds: float, from_id: int = 0) -> int:
    """The first event id inside the lookback window (``from_id``: a previous answer, to start from)."""
    found = session.execute(text(WINDOW_START), {"from_id": from_id, "lookback": lookback_seconds}).scalar()
    return int(found or 0)


def held_back(
    session: Session, *, grace_seconds: float, lookback_seconds: float, from_id: int = 0
) -> list[Any]:
    """Pairs still to decide: every candidate, with what ``decide`` needs."""
    start = window_start(session, lookback_seconds=lookback_seconds, from_id=from_id)
    return list(
        session.execute(
            text(CANDIDATES), {"grace": grace_seconds, "lookback": lookback_seconds, "from_id": start}
        ).all()
    )


def requeue(
    session: Session, *, grace_seconds: float = 15.0, lookback_seconds: float = 86400.0, from_id: int = 0
) -> int:
    """Queue consumer runs for held-back events of ours; returns how many (event, DAG) pairs were queued.
    Every pair looked at is recorded once with its outcome and why (``dataset-bridge status`` shows them).
    ``from_id``: an earlier ``window_start``, so that finding the window reads only what left it since."""
    queued = 0
    for row in held_back(
        session, grace_seconds=grace_seconds, lookback_seconds=lookback_seconds, from_id=from_id
    ):
        outcome, reason = decide(row)
        if outcome == REQUEUED:
            session.execute(text(REQUEUE), {"asset_id": row.asset_id, "dag_id": row.dag_id})
            queued += 1
        session.execute(
            text(RECORD), {"e": row.event_id, "d": row.dag_id, "outcome": outcome, "reason": reason}
        )
    return queued


RECENT = """
SELECT asset_event_id, dag_id, outcome, reason, queued_at FROM dataset_bridge.reconciled
ORDER BY queued_at DESC, asset_event_id DESC LIMIT :limit
"""


def recent(session: Session, limit: int = 20) -> list[dict[str, Any]]:
    """The latest reconciler decisions, newest first."""
    return [
        {
            "event_id": r.asset_event_id,
            "dag_id": r.dag_id,
            "outcome": r.outcome,
            "reason": r.reason,
            "at": r.queued_at.isoformat(),
        }
        for r in session.execute(text(RECENT), {"limit": limit})
    ]
