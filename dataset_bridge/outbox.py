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
CREATE INDEX IF NOT EXISTS outbox_delivered ON dataset_bridge.outbox (delivered_at)
    WHERE status = 'delivered';
-- NULL: the event's extra could not be copied (jsonb refuses it), so the row is dead and never sent
ALTER TABLE dataset_bridge.outbox ALTER COLUMN extra DROP NOT NULL;
-- server errors (a 5xx that is not an outage) of this row: the relay dead-letters it at max_server_errors
ALTER TABLE dataset_bridge.outbox ADD COLUMN IF NOT EXISTS server_errors integer NOT NULL DEFAULT 0;
""" + ddl.JSONB_ERROR

INSERT_ROW = """
INSERT INTO dataset_bridge.outbox (target, asset_event_id, asset_uri, asset_name, extra, event_timestamp)
VALUES (:target, :event_id, :uri, :name, CAST(:extra AS jsonb), :at)
ON CONFLICT DO NOTHING
"""

# An event whose extra jsonb refuses gets a dead row with the reason (and no extra): it is never sent, and
# the events after it are.
SWEEP = """
INSERT INTO dataset_bridge.outbox (target, asset_event_id, asset_uri, asset_name, extra, event_timestamp,
                                   status, last_error)
SELECT :target, e.id, a.uri, a.name,
       CASE WHEN j.error IS NULL THEN CAST(CAST(e.extra AS text) AS jsonb) END, e.timestamp,
       CASE WHEN j.error IS NULL THEN 'pending' ELSE 'dead' END,
       'not relayed: PostgreSQL cannot store its extra as jsonb (' || j.error || ')'
FROM asset_event e
JOIN asset a ON a.id = e.asset_id
CROSS JOIN LATERAL (SELECT dataset_bridge.jsonb_error(CAST(e.extra AS text)) AS error OFFSET 0) j
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


def jsonb_refusal(value: Any) -> str | None:
    """Why jsonb would refuse this JSON value, or None: a string (or key) holding a NUL character or an
    unpaired surrogate, which Python and Airflow's json column take. Walked without recursion: however
    deep the value, it never fails the producer's transaction."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            if "\x00" in item:
                return "a string holds \\u0000 (NUL)"
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:
                    return "a string holds an unpaired UTF-16 surrogate"
    return None


def record(session: Session, routes: Routes, event: Any, uri: str, name: str) -> int:
    """Outbox rows for one new asset event (in the caller's transaction); how many targets want it.

    An extra jsonb would refuse gets no row here (the insert would fail the producer's transaction): the
    relay's sweep finds the event without one and dead-letters it with PostgreSQL's reason."""
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
    extra = json.dumps(event.extra or {}, default=str)
    refusal = jsonb_refusal(json.loads(extra))
    if refusal is not None:
        log.warning("asset event left to the relay's sweep, which dead-letters it: its extra cannot be "
                    "stored as jsonb", event_id=event.id, asset=name, cause=refusal)
        return 0
    for target in targets:
        session.execute(text(INSERT_ROW), {
            "target": target.name, "event_id": event.id, "uri": uri, "name": name, "extra": extra,
            "at": event.timestamp,
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
