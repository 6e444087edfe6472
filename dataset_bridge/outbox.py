"""Deployment A's outbox: asset events of routed assets, written in the transaction that creates them.

Enable with ``[core] asset_manager_class = dataset_bridge.asset_manager.OutboxAssetManager`` and
``[core] asset_manager_kwargs = {"routes": "/path/routes.yaml"}``. Airflow creates task-outlet and REST
API events through the configured asset manager, so the outbox row commits or rolls back with the event
(no event without its row, no row without its event), and a ``pg_notify`` wakes the relay on commit.

Airflow 3.3's ``Trigger.submit_event`` calls the base ``AssetManager`` directly, so asset-watcher events
(under the stock triggerer) bypass any custom manager. The relay's sweeper covers them: every few seconds
it adds outbox rows for events of routed assets that have none (``sweep``), from the moment a target was
first seen. Such rows may be ordered after events created later; nothing is lost.

A target is "first seen" by the earliest of: ``dataset-bridge init --routes`` (run it when you configure
routing), the asset manager's first event in any process (it creates the outbox schema too, so events
made before the relay's first start keep their rows), and the relay's start.
"""

from __future__ import annotations

import json
from functools import cache
from typing import Any

import structlog
from sqlalchemy import text
from sqlalchemy.orm import Session

from dataset_bridge import ddl
from dataset_bridge.routes import Routes

log = structlog.get_logger(__name__)

CHANNEL = "dataset_bridge_outbox"
SWEEP_OVERLAP_SECONDS = 300.0
SCHEMA_DDL = """
CREATE SCHEMA IF NOT EXISTS dataset_bridge;
CREATE TABLE IF NOT EXISTS dataset_bridge.outbox (
    id bigserial PRIMARY KEY,
    target text NOT NULL,
    asset_event_id integer NOT NULL,
    asset_uri text NOT NULL,
    asset_name text NOT NULL,
    extra jsonb NOT NULL DEFAULT '{}',
    event_timestamp timestamptz NOT NULL,
    status text NOT NULL DEFAULT 'pending',
    attempts integer NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    last_error text,
    created_at timestamptz NOT NULL DEFAULT now(),
    delivered_at timestamptz,
    UNIQUE (target, asset_event_id)
);
CREATE INDEX IF NOT EXISTS outbox_pending ON dataset_bridge.outbox (target, id) WHERE status = 'pending';
CREATE TABLE IF NOT EXISTS dataset_bridge.relay_target (
    target text PRIMARY KEY,
    since timestamptz NOT NULL DEFAULT now()
);
ALTER TABLE dataset_bridge.relay_target ADD COLUMN IF NOT EXISTS swept_until timestamptz;
CREATE INDEX IF NOT EXISTS outbox_delivered ON dataset_bridge.outbox (delivered_at) WHERE status = 'delivered'
"""

INSERT_ROW = """
INSERT INTO dataset_bridge.outbox (target, asset_event_id, asset_uri, asset_name, extra, event_timestamp)
VALUES (:target, :event_id, :uri, :name, CAST(:extra AS jsonb), :at)
ON CONFLICT DO NOTHING
"""

SWEEP = """
INSERT INTO dataset_bridge.outbox (target, asset_event_id, asset_uri, asset_name, extra, event_timestamp)
SELECT :target, e.id, a.uri, a.name, CAST(CAST(e.extra AS text) AS jsonb), e.timestamp
FROM asset_event e
JOIN asset a ON a.id = e.asset_id
JOIN dataset_bridge.relay_target t ON t.target = :target
WHERE (a.uri = ANY(:assets) OR a.name = ANY(:assets))
  AND e.timestamp >= t.since
  -- only what is new since the last sweep, with an overlap far longer than any event's transaction;
  -- delivered outbox rows are pruned only after days, so the overlap always finds its rows
  AND e.timestamp >= coalesce(t.swept_until - make_interval(secs => :overlap), t.since)
  AND e.timestamp < now() - make_interval(secs => :settle)
  AND NOT EXISTS (SELECT 1 FROM dataset_bridge.outbox o WHERE o.target = :target AND o.asset_event_id = e.id)
ORDER BY e.id
ON CONFLICT DO NOTHING
"""


def ensure_schema(session: Session) -> None:
    ddl.apply(session, SCHEMA_DDL)


@cache
def routes_from(path: str) -> Routes:
    return Routes.load(path)


REGISTER_TARGET = "INSERT INTO dataset_bridge.relay_target (target) VALUES (:t) ON CONFLICT DO NOTHING"

# (database URL, routes) whose targets this process saw committed: registering costs queries only until then
_registered: set[tuple[str, Routes]] = set()


def _outbox_exists(session: Session) -> bool:
    return bool(session.execute(text("SELECT to_regclass('dataset_bridge.outbox') IS NOT NULL")).scalar())


def register_targets(session: Session, routes: Routes) -> None:
    """Create the outbox schema if needed and record when each target was first seen, in the caller's
    transaction: the sweeper covers every event of a routed asset from that moment on."""
    if not _outbox_exists(session):
        ensure_schema(session)
    for target in routes.targets:
        session.execute(text(REGISTER_TARGET), {"t": target.name})


def _targets_registered(session: Session, routes: Routes) -> bool:
    if not _outbox_exists(session):
        return False
    names = [t.name for t in routes.targets]
    found = session.execute(text("SELECT count(*) FROM dataset_bridge.relay_target WHERE target = ANY(:n)"),
                            {"n": names}).scalar()
    return int(found or 0) == len(names)


def record(session: Session, routes: Routes, event: Any, uri: str, name: str) -> int:
    """Outbox rows for one new asset event (in the caller's transaction); how many targets want it."""
    seen = (session.connection().engine.url.render_as_string(hide_password=True), routes)
    if seen not in _registered:
        # the first events this process sees, routed or not: routing is configured from here on, whether
        # or not the relay ever ran (rolled back with the event, so done again with the next one)
        if _targets_registered(session, routes):
            _registered.add(seen)
        else:
            register_targets(session, routes)
    targets = routes.targets_for(uri, name)
    if not targets:
        return 0
    for target in targets:
        session.execute(text(INSERT_ROW), {
            "target": target.name, "event_id": event.id, "uri": uri, "name": name,
            "extra": json.dumps(event.extra or {}, default=str), "at": event.timestamp,
        })
    session.execute(text("SELECT pg_notify(:channel, '')"), {"channel": CHANNEL})
    return len(targets)


def sweep(session: Session, routes: Routes, settle_seconds: float = 5.0) -> int:
    """Outbox rows for events of routed assets created without one (asset watchers); returns how many."""
    added = 0
    for target in routes.targets:
        session.execute(text(REGISTER_TARGET), {"t": target.name})
        result = session.execute(text(SWEEP), {"target": target.name, "assets": list(target.assets),
                                               "settle": settle_seconds, "overlap": SWEEP_OVERLAP_SECONDS})
        added += int(getattr(result, "rowcount", 0) or 0)
        session.execute(text("UPDATE dataset_bridge.relay_target SET swept_until = now() - "
                             "make_interval(secs => :settle) WHERE target = :t"),
                        {"settle": settle_seconds, "t": target.name})
    return added
