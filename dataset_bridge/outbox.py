"""Deployment A's outbox: asset events of routed assets, written in the transaction that creates them.

Enable with ``[core] asset_manager_class = dataset_bridge.asset_manager.OutboxAssetManager`` and
``[core] asset_manager_kwargs = {"routes": "/path/routes.yaml"}``. Airflow creates task-outlet and REST
API events through the configured asset manager, so the outbox row commits or rolls back with the event
(no event without its row, no row without its event), and a ``pg_notify`` wakes the relay on commit.

Airflow 3.3's ``Trigger.submit_event`` calls the base ``AssetManager`` directly, so asset-watcher events
(under the stock triggerer) bypass any custom manager. The relay's sweeper covers them: every few seconds
it adds outbox rows for events of routed assets that have none (``sweep``), from the moment a target was
first seen. Such rows may be ordered after events created later; nothing is lost. The sweeper reads
``asset_event`` by id from a per-target cursor that only passes ids no open transaction can still commit
(``horizon.py``): an event committed late is never skipped, and no clock is read (Airflow stamps an event
with its host's clock, which may be minutes off the database's).

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

from dataset_bridge import store
from dataset_bridge.horizon import Horizon
from dataset_bridge.routes import Routes

log = structlog.get_logger(__name__)

CHANNEL = "dataset_bridge_outbox"

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
WHERE (a.uri = ANY(:assets) OR a.name = ANY(:assets))
  AND e.id > :after  -- the target's cursor: a primary-key range, only what may be new
  AND NOT EXISTS (SELECT 1 FROM dataset_bridge.outbox o WHERE o.target = :target AND o.asset_event_id = e.id)
ORDER BY e.id
ON CONFLICT DO NOTHING
"""

# A target registered by an earlier version has no cursor yet: its first sweep starts an hour before its
# last one (by the events' timestamps, this once), or where it was first seen if it was never swept.
START_CURSOR = """
UPDATE dataset_bridge.relay_target t SET swept_id = coalesce(
    (SELECT min(e.id) - 1 FROM asset_event e JOIN asset a ON a.id = e.asset_id
     WHERE (a.uri = ANY(:assets) OR a.name = ANY(:assets))
       AND e.timestamp >= coalesce(t.swept_until - interval '1 hour', t.since)),
    dataset_bridge.asset_events_before())
WHERE t.target = :target AND t.swept_id IS NULL
"""
CURSOR = "SELECT swept_id FROM dataset_bridge.relay_target WHERE target = :target"
ADVANCE = """
UPDATE dataset_bridge.relay_target SET swept_id = greatest(swept_id, :final) WHERE target = :target
"""


def ensure_schema(session: Session) -> None:
    store.migrate(session)


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
    found = session.execute(
        text("SELECT count(*) FROM dataset_bridge.relay_target WHERE target = ANY(:n)"), {"n": names}
    ).scalar()
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
        log.warning(
            "asset event left to the relay's sweep, which dead-letters it: its extra cannot be "
            "stored as jsonb",
            event_id=event.id,
            asset=name,
            cause=refusal,
        )
        return 0
    for target in targets:
        session.execute(
            text(INSERT_ROW),
            {
                "target": target.name,
                "event_id": event.id,
                "uri": uri,
                "name": name,
                "extra": extra,
                "at": event.timestamp,
            },
        )
    session.execute(text("SELECT pg_notify(:channel, '')"), {"channel": CHANNEL})
    return len(targets)


# per database (URL): what the sweeps of this process have seen of asset_event's open writers
_horizons: dict[str, Horizon] = {}


def sweep(session: Session, routes: Routes) -> int:
    """Outbox rows for events of routed assets created without one (asset watchers); returns how many.

    Each target's cursor moves only over asset_event ids that are final (no open transaction can still
    commit one of them), as this process's looks at the table's writers prove; what is above it is read
    again at the next sweep."""
    database = session.connection().engine.url.render_as_string(hide_password=True)
    # looked at before the events are read: what the look proves final, the read below sees
    final = _horizons.setdefault(database, Horizon()).look_sync(session, "asset_event")
    added = 0
    for target in routes.targets:
        params = {"target": target.name, "assets": list(target.assets)}
        session.execute(text(REGISTER_TARGET), {"t": target.name})
        session.execute(text(START_CURSOR), params)
        after = int(session.execute(text(CURSOR), params).scalar() or 0)
        result = session.execute(text(SWEEP), {**params, "after": after})
        added += int(getattr(result, "rowcount", 0) or 0)
        session.execute(text(ADVANCE), {"target": target.name, "final": final})
    return added
