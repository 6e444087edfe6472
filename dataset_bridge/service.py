"""The bridge process: mapped task successes -> asset events, and the held-back-event reconciler.

Runs beside the scheduler with the usual Airflow configuration (it talks to the metadata database, as the
scheduler does). Several may run at once: the ledger keeps every event single.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog
from sqlalchemy import text

from dataset_bridge import reconcile, retention, store, task_success
from dataset_bridge.retention import DEFAULT as DEFAULT_RETENTION
from dataset_bridge.retention import Retention
from dataset_bridge.task_success import TaskMapping

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class BridgeSettings:
    interval: float = 2.0
    reconcile_every: float = 10.0
    grace_seconds: float = 15.0
    lookback_seconds: float = 86400.0
    retention: Retention = DEFAULT_RETENTION
    prune_every: float = 600.0


# what the bridge process prunes (the relay prunes the outbox, the inbox its own table)
BRIDGE_LEDGERS = ["dataset_bridge.emitted", "dataset_bridge.reconciled", "smart_triggerer.asset_event_key"]


@dataclass
class Counters:
    emitted: int = 0
    requeued: int = 0


def _session() -> Any:
    from airflow.utils.session import create_session

    return create_session()


def prepare(mapping: TaskMapping | None) -> None:
    with _session() as session:
        task_success.ensure_schema(session)
    if mapping is not None:
        with _session() as session:
            task_success.register_horizons(session, mapping)


_warned_unresolved: set[str] = set()


def emit_pending(mapping: TaskMapping, keep: Retention = DEFAULT_RETENTION) -> int:
    """One pass over (successful try, asset) pairs not yet bridged; each pair in its own transaction."""
    with _session() as session:
        rows = task_success.pending(session, mapping, retention_seconds=keep.seconds)
        missing = set(task_success.unresolved(session, mapping))
    for ref in sorted(missing - _warned_unresolved):
        log.warning(
            "mapped asset not found (no DAG declares it yet); its events follow once one does", asset=ref
        )
    _warned_unresolved.intersection_update(missing)
    _warned_unresolved.update(missing)
    created = 0
    for row in rows:
        with _session() as session:
            created += task_success.emit_one(session, row)
    if created:
        log.info("asset events emitted for task successes", events=created, pairs=len(rows))
    return created


# where the reconciler's lookback window started last time (the next search starts there)
_window = {"from_id": 0}


def reconcile_once(settings: BridgeSettings) -> int:
    with _session() as session:
        start = reconcile.window_start(
            session, lookback_seconds=settings.lookback_seconds, from_id=_window["from_id"]
        )
        requeued = reconcile.requeue(
            session,
            grace_seconds=settings.grace_seconds,
            lookback_seconds=settings.lookback_seconds,
            from_id=start,
        )
    _window["from_id"] = start
    if requeued:
        log.info("held-back asset events queued again for their consumers", pairs=requeued)
    return requeued


def _step(what: str, action: Callable[[], int | None]) -> int | None:
    """One part of a pass; a failure is logged and that part tried again next pass, while the other parts
    go on (a reconciler that cannot read some event must not stop the pruning, nor the reverse)."""
    try:
        return action()
    except Exception:
        # the database may be restarting; the ledgers make the retry safe
        log.exception("bridge pass step failed; retrying next pass", step=what)
        return None


class _Pass:
    """What one bridge process does each interval, and when it last reconciled and pruned."""

    def __init__(self, mapping: TaskMapping | None, settings: BridgeSettings) -> None:
        self.mapping, self.settings = mapping, settings
        self.counters = Counters()
        self.last_reconcile = self.last_prune = float("-inf")

    def run(self) -> None:
        mapping, settings = self.mapping, self.settings
        if mapping is not None:
            emitted = _step("task successes", lambda: emit_pending(mapping, settings.retention))
            self.counters.emitted += emitted or 0
        if time.monotonic() - self.last_reconcile >= settings.reconcile_every:
            requeued = _step("reconciler", lambda: reconcile_once(settings))
            if requeued is not None:
                self.counters.requeued += requeued
                self.last_reconcile = time.monotonic()
        if time.monotonic() - self.last_prune >= settings.prune_every:
            self.last_prune = time.monotonic()
            _step("ledger pruning", lambda: _prune(settings))


def _prune(settings: BridgeSettings) -> None:
    retention.prune(_session, BRIDGE_LEDGERS, settings.retention)


def run(mapping: TaskMapping | None, settings: BridgeSettings, stop: threading.Event | None = None) -> int:
    stop = stop or threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    prepare(mapping)
    bridge = _Pass(mapping, settings)
    log.info("dataset bridge running", mapped_tasks=len(mapping.entries) if mapping else 0)
    while not stop.is_set():
        bridge.run()
        stop.wait(settings.interval)
    log.info("dataset bridge stopped", emitted=bridge.counters.emitted, requeued=bridge.counters.requeued)
    return 0


STATUS_SQL = {
    "emitted": "SELECT source, count(*) FROM dataset_bridge.emitted GROUP BY source ORDER BY source",
    "horizons": "SELECT dag_id || '.' || task_id, since FROM dataset_bridge.task_horizon ORDER BY 1",
    "reconciled": "SELECT outcome, count(*) FROM dataset_bridge.reconciled GROUP BY outcome ORDER BY outcome",
    "watcher_keys": "SELECT count(*) FROM smart_triggerer.asset_event_key",
}


def status(mapping: TaskMapping | None, settings: BridgeSettings) -> dict[str, Any]:
    """Emitted events by source, backlog of mapped successes, held-back events, re-queued pairs."""
    with _session() as session:
        exists = session.execute(text("SELECT to_regclass('dataset_bridge.emitted') IS NOT NULL")).scalar()
        if not exists:
            return {"initialized": False}
        store.migrate(session)  # tables made by an earlier version: the reconciler's reads need its function
        result: dict[str, Any] = {"initialized": True}
        result["emitted"] = {str(k): int(v) for k, v in session.execute(text(STATUS_SQL["emitted"])).all()}
        result["horizons"] = {str(k): v.isoformat() for k, v in session.execute(text(STATUS_SQL["horizons"]))}
        outcomes = {str(k): int(v) for k, v in session.execute(text(STATUS_SQL["reconciled"])).all()}
        result["requeued"] = outcomes.get(reconcile.REQUEUED, 0)
        result["reconciled"] = outcomes  # requeued / cleared / unconsumable, and why: recent_decisions
        result["recent_decisions"] = reconcile.recent(session)
        result["backlog"] = (
            len(
                task_success.pending(
                    session, mapping, limit=10000, retention_seconds=settings.retention.seconds
                )
            )
            if mapping
            else None
        )
        result["held_back"] = len(
            reconcile.held_back(
                session, grace_seconds=settings.grace_seconds, lookback_seconds=settings.lookback_seconds
            )
        )
        has_keys = session.execute(text("SELECT to_regclass('smart_triggerer.asset_event_key') IS NOT NULL"))
        result["watcher_events"] = (
            int(session.execute(text(STATUS_SQL["watcher_keys"])).scalar() or 0)
            if has_keys.scalar()
            else None
        )
    return result
