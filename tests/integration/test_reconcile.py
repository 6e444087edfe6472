"""The held-back-event reconciler against a real (migrated) Airflow metadata database."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from sqlalchemy import text

from dataset_bridge import reconcile, task_success
from tests.helpers.airflow_orm import use_airflow_db


def _seed(session: Any) -> dict[str, Any]:
    """Two consumers of one asset (one paused) and four events of various kinds, all a minute old."""
    from airflow.models.asset import AssetEvent, AssetModel, DagScheduleAssetReference
    from airflow.models.dag import DagModel
    from airflow.models.dagbundle import DagBundleModel

    session.add(DagBundleModel(name="dags-folder"))
    session.flush()
    asset = AssetModel(name="orders", uri="warehouse://dds/orders")
    session.add(asset)
    for dag_id, paused in (("active_consumer", False), ("paused_consumer", True)):
        session.add(DagModel(dag_id=dag_id, bundle_name="dags-folder", is_paused=paused, is_stale=False))
    session.flush()
    long_ago = dt.datetime.now(dt.UTC) - dt.timedelta(hours=1)
    for dag_id in ("active_consumer", "paused_consumer"):
        session.add(DagScheduleAssetReference(dag_id=dag_id, asset_id=asset.id, created_at=long_ago))
    minute_ago = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=1)
    events = {
        "ours_unconsumed": AssetEvent(
            asset_id=asset.id, extra={"idempotency_key": "a"}, timestamp=minute_ago
        ),
        "watcher_unconsumed": AssetEvent(
            asset_id=asset.id,
            timestamp=minute_ago,
            extra={"from_trigger": True, "payload": {"idempotency_key": "b"}},
        ),
        "foreign": AssetEvent(asset_id=asset.id, extra={}, timestamp=minute_ago),
        "too_young": AssetEvent(asset_id=asset.id, extra={"idempotency_key": "c"}),
    }
    session.add_all(events.values())
    session.flush()
    return {"asset_id": asset.id, "events": {name: e.id for name, e in events.items()}}


@pytest.fixture
def seeded(airflow_db: str) -> dict[str, Any]:
    """The bridge's schema and ``_seed``'s consumers and events in a fresh metadata database."""
    from airflow.utils.session import create_session

    use_airflow_db(airflow_db)
    with create_session() as session:
        task_success.ensure_schema(session)
    with create_session() as session:
        return _seed(session)


def test_requeues_only_unconsumed_events_of_ours_for_active_consumers(seeded: dict[str, Any]) -> None:
    from airflow.utils.session import create_session

    with create_session() as session:
        held = reconcile.held_back(session, grace_seconds=15, lookback_seconds=86400)
    events = seeded["events"]
    assert {(r.event_id, r.dag_id) for r in held} == {
        (events["ours_unconsumed"], "active_consumer"),
        (events["watcher_unconsumed"], "active_consumer"),
    }

    with create_session() as session:
        assert reconcile.requeue(session, grace_seconds=15) == 2
    with create_session() as session:
        queued = session.execute(text("SELECT asset_id, target_dag_id FROM asset_dag_run_queue")).all()
        assert queued == [(seeded["asset_id"], "active_consumer")]
        # once per (event, consumer): after the run took the queue row, the event is not queued again
        session.execute(text("DELETE FROM asset_dag_run_queue"))
    with create_session() as session:
        assert reconcile.requeue(session, grace_seconds=15) == 0


def test_events_emitted_while_a_consumer_was_paused_are_delivered_after_unpause(
    seeded: dict[str, Any],
) -> None:
    from airflow.utils.session import create_session

    with create_session() as session:
        assert reconcile.requeue(session, grace_seconds=15) == 2  # the active consumer's
        session.execute(text("UPDATE dag SET is_paused = false WHERE dag_id = 'paused_consumer'"))
    with create_session() as session:
        held = reconcile.held_back(session, grace_seconds=15, lookback_seconds=86400)
        assert {r.dag_id for r in held} == {"paused_consumer"}
        assert reconcile.requeue(session, grace_seconds=15) == 2
        queued = session.execute(text("SELECT target_dag_id FROM asset_dag_run_queue ORDER BY 1")).all()
    assert [q[0] for q in queued] == ["active_consumer", "paused_consumer"]
    assert seeded["events"]


def _requeued_for(seeded: dict[str, Any]) -> list[tuple[str, str, str]]:
    from airflow.utils.session import create_session

    with create_session() as session:
        reconcile.requeue(session, grace_seconds=15)
        rows = session.execute(
            text("SELECT asset_event_id, dag_id, outcome FROM dataset_bridge.reconciled ORDER BY 1, 2")
        ).all()
    names = {event_id: name for name, event_id in seeded["events"].items()}
    return [(names[e], d, o) for e, d, o in rows]


def test_an_event_no_new_run_would_consume_is_reported_not_requeued(seeded: dict[str, Any]) -> None:
    """The consumer's latest asset-triggered run has run_after after the events: a new run's window starts
    there, so re-queuing would only make a run that consumes nothing."""
    from airflow.models.dagrun import DagRun
    from airflow.utils.session import create_session
    from airflow.utils.state import DagRunState
    from airflow.utils.types import DagRunType

    with create_session() as session:
        session.add(
            DagRun(
                dag_id="active_consumer",
                run_id="asset_triggered__late",
                run_type=DagRunType.ASSET_TRIGGERED,
                run_after=dt.datetime.now(dt.UTC) - dt.timedelta(seconds=30),
                state=DagRunState.SUCCESS,
            )
        )
    assert _requeued_for(seeded) == [
        ("ours_unconsumed", "active_consumer", "unconsumable"),
        ("watcher_unconsumed", "active_consumer", "unconsumable"),
    ]
    with create_session() as session:
        assert session.execute(text("SELECT count(*) FROM asset_dag_run_queue")).scalar() == 0
        decisions = reconcile.recent(session)
    assert {d["outcome"] for d in decisions} == {"unconsumable"}
    assert "run_after" in decisions[0]["reason"]


def test_an_operators_clear_of_queued_events_is_honoured(seeded: dict[str, Any]) -> None:
    """What the REST API (and the UI through it) records when someone clears a DAG's queued events."""
    from airflow.models.log import Log
    from airflow.utils.session import create_session

    with create_session() as session:
        session.add(
            Log(
                event="delete_dag_asset_queued_events", dag_id="active_consumer", extra='{"method": "DELETE"}'
            )
        )
        session.add(Log(event="cli_task_run", extra="not json at all"))  # other audit rows: harmless
    assert _requeued_for(seeded) == [
        ("ours_unconsumed", "active_consumer", "cleared"),
        ("watcher_unconsumed", "active_consumer", "cleared"),
    ]


def test_consumers_by_name_reference_and_by_alias_are_covered(seeded: dict[str, Any]) -> None:
    from airflow.models.asset import (
        AssetAliasModel,
        DagScheduleAssetAliasReference,
        DagScheduleAssetNameReference,
    )
    from airflow.models.dag import DagModel
    from airflow.utils.session import create_session

    long_ago = dt.datetime.now(dt.UTC) - dt.timedelta(hours=1)
    events = seeded["events"]
    with create_session() as session:
        session.execute(text("DELETE FROM dag_schedule_asset_reference"))  # only the new consumers remain
        for dag_id in ("by_name", "by_alias"):
            session.add(DagModel(dag_id=dag_id, bundle_name="dags-folder", is_paused=False, is_stale=False))
        session.flush()
        session.add(DagScheduleAssetNameReference(name="orders", dag_id="by_name", created_at=long_ago))
        alias = AssetAliasModel(name="orders_alias")
        session.add(alias)
        session.flush()
        session.add(DagScheduleAssetAliasReference(alias_id=alias.id, dag_id="by_alias", created_at=long_ago))
        session.execute(
            text("INSERT INTO asset_alias_asset_event (alias_id, event_id) VALUES (:a, :e)"),
            {"a": alias.id, "e": events["ours_unconsumed"]},
        )
    assert _requeued_for(seeded) == [
        ("ours_unconsumed", "by_alias", "requeued"),
        ("ours_unconsumed", "by_name", "requeued"),
        ("watcher_unconsumed", "by_name", "requeued"),
    ]


def test_the_window_starts_at_its_first_event_id_and_only_moves_forward(seeded: dict[str, Any]) -> None:
    """The reconciler finds its lookback window by event id (the primary key), not by scanning timestamps."""
    from airflow.models.asset import AssetEvent
    from airflow.utils.session import create_session

    events = seeded["events"]
    first = min(events.values())
    with create_session() as session:
        old = [
            AssetEvent(
                asset_id=seeded["asset_id"],
                extra={"idempotency_key": f"old{i}"},
                timestamp=dt.datetime.now(dt.UTC) - dt.timedelta(days=3),
            )
            for i in range(3)
        ]
        session.add_all(old)
        session.flush()
        # events older than the window with ids before and after the window's first event
        session.execute(text("UPDATE asset_event SET id = id + 1000 WHERE id = :id"), {"id": old[2].id})
    with create_session() as session:
        assert reconcile.window_start(session, lookback_seconds=86400) == first
        assert reconcile.window_start(session, lookback_seconds=86400, from_id=first) == first
        # nothing younger than the lookback: the window starts after the newest event
        newest = session.execute(text("SELECT max(id) FROM asset_event")).scalar()
        assert newest is not None
        assert reconcile.window_start(session, lookback_seconds=0.001) == newest + 1
        held = reconcile.held_back(session, grace_seconds=15, lookback_seconds=86400, from_id=first)
    assert {r.event_id for r in held} == {events["ours_unconsumed"], events["watcher_unconsumed"]}


def _add_unreadable(seeded: dict[str, Any]) -> int:
    """An event of ours whose extra jsonb cannot hold (a NUL character), and an audit-log row with one."""
    import json

    from airflow.models.asset import AssetEvent
    from airflow.models.log import Log
    from airflow.utils.session import create_session

    with create_session() as session:
        event = AssetEvent(
            asset_id=seeded["asset_id"],
            extra={"idempotency_key": "nul", "note": "a\x00b"},
            timestamp=dt.datetime.now(dt.UTC) - dt.timedelta(minutes=1),
        )
        session.add(event)
        session.add(Log(event="delete_asset_queued_events", extra=json.dumps({"asset_id": 0, "q": "\x00"})))
        session.flush()
        return int(event.id)


def test_an_extra_jsonb_cannot_hold_does_not_stop_the_reconciler(seeded: dict[str, Any]) -> None:
    from airflow.utils.session import create_session

    unreadable = _add_unreadable(seeded)
    with create_session() as session:
        assert reconcile.requeue(session, grace_seconds=15) == 2  # the two readable events of ours
        decided = {
            r[0] for r in session.execute(text("SELECT asset_event_id FROM dataset_bridge.reconciled"))
        }
    assert decided == {seeded["events"]["ours_unconsumed"], seeded["events"]["watcher_unconsumed"]}
    assert unreadable not in decided


def test_the_bridge_process_keeps_reconciling_and_pruning_with_an_unreadable_event(
    seeded: dict[str, Any],
) -> None:
    """``dataset-bridge run``: one event whose extra jsonb cannot hold stops neither the reconciler nor the
    ledgers' pruning (each part of a pass fails or succeeds on its own)."""
    import signal
    import threading

    from airflow.utils.session import create_session

    from dataset_bridge import service
    from dataset_bridge.retention import Retention
    from tests.helpers.waiting import wait_for

    _add_unreadable(seeded)
    with create_session() as session:
        session.execute(
            text(
                "INSERT INTO dataset_bridge.emitted (asset_id, idempotency_key, source, "
                "created_at) VALUES (1, 'old', 'task_success', now() - interval '40 days')"
            )
        )

    def progress() -> tuple[int, int]:
        with create_session() as session:
            queued = session.execute(text("SELECT count(*) FROM asset_dag_run_queue")).scalar()
            old = session.execute(text("SELECT count(*) FROM dataset_bridge.emitted")).scalar()
        return int(queued or 0), int(old or 0)

    stop = threading.Event()
    seen: list[tuple[int, int]] = []

    def watch() -> None:
        try:
            seen.append(
                wait_for(
                    progress,
                    lambda p: p == (1, 0),
                    timeout=30,
                    what="a queued consumer run and the old ledger row pruned",
                )
            )
        finally:
            stop.set()

    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        settings = service.BridgeSettings(
            interval=0.1, reconcile_every=0.1, prune_every=0.1, retention=Retention(days=30)
        )
        assert service.run(None, settings, stop) == 0
    finally:
        stop.set()
        watcher.join()
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    assert seen == [(1, 0)]
