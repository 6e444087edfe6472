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
        "ours_unconsumed": AssetEvent(asset_id=asset.id, extra={"idempotency_key": "a"},
                                      timestamp=minute_ago),
        "watcher_unconsumed": AssetEvent(asset_id=asset.id, timestamp=minute_ago,
                                         extra={"from_trigger": True, "payload": {"idempotency_key": "b"}}),
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
        (events["ours_unconsumed"], "active_consumer"), (events["watcher_unconsumed"], "active_consumer")}

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
        seeded: dict[str, Any]) -> None:
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
