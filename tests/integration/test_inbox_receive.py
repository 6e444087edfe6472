"""The inbox's batched creation against a real (migrated) Airflow metadata database: the same events,
queue rows and links as one ``register_asset_change`` per event, in batch order, once per source id."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from sqlalchemy import text

from dataset_bridge.inbox import InboxBatch, receive
from tests.helpers.airflow_orm import use_airflow_db

URI = "warehouse://dds/h_user"


@pytest.fixture
def metadata(airflow_db: str) -> str:
    """One asset with three consumers: by asset (active), by name (active) and by asset (paused)."""
    from airflow.models.asset import AssetActive, AssetModel, DagScheduleAssetNameReference
    from airflow.models.asset import DagScheduleAssetReference as ByAsset
    from airflow.models.dag import DagModel
    from airflow.models.dagbundle import DagBundleModel
    from airflow.utils.session import create_session

    use_airflow_db(airflow_db)
    with create_session() as session:
        session.add(DagBundleModel(name="dags-folder"))
        session.flush()
        asset = AssetModel(name="h_user", uri=URI)
        session.add_all([asset, AssetActive(name="h_user", uri=URI)])
        for dag_id, paused in (("by_asset", False), ("by_name", False), ("paused", True)):
            session.add(DagModel(dag_id=dag_id, bundle_name="dags-folder", is_paused=paused, is_stale=False))
        session.flush()
        session.add_all(
            [
                ByAsset(dag_id="by_asset", asset_id=asset.id),
                ByAsset(dag_id="paused", asset_id=asset.id),
                DagScheduleAssetNameReference(name="h_user", dag_id="by_name"),
            ]
        )
    return airflow_db


def _batch(*ids: int, uri: str = URI) -> InboxBatch:
    return InboxBatch.model_validate(
        {
            "source": "deployment_a",
            "events": [
                {
                    "id": i,
                    "uri": uri,
                    "name": "h_user",
                    "extra": {"n": i},
                    "timestamp": dt.datetime.now(dt.UTC),
                }
                for i in ids
            ],
        }
    )


def _all(query: str) -> list[Any]:
    from airflow.utils.session import create_session

    with create_session() as session:
        return [tuple(r) for r in session.execute(text(query)).all()]


def test_a_batch_creates_each_new_event_once_in_order_and_queues_its_consumers(metadata: str) -> None:
    results = receive(_batch(3, 1, 2, 1))  # id 1 twice in one batch
    assert [(r["id"], r["status"]) for r in results] == [
        (3, "created"),
        (1, "created"),
        (2, "created"),
        (1, "duplicate"),
    ]
    events = _all(
        "SELECT id, CAST(extra AS jsonb) ->> 'source_event_id', source_dag_id, timestamp "
        "FROM asset_event ORDER BY id"
    )
    assert [e[1] for e in events] == ["3", "1", "2"]  # batch order
    assert all(e[2] is None and e[3] is not None for e in events)
    assert _all("SELECT target_dag_id FROM asset_dag_run_queue ORDER BY 1") == [("by_asset",), ("by_name",)]
    links = _all("SELECT source_event_id, asset_event_id FROM dataset_bridge.inbox ORDER BY asset_event_id")
    assert links == [(3, events[0][0]), (1, events[1][0]), (2, events[2][0])]

    again = receive(_batch(2, 4))  # a redelivery with one new event
    assert [(r["id"], r["status"]) for r in again] == [(2, "duplicate"), (4, "created")]
    assert len(_all("SELECT id FROM asset_event")) == 4


def test_unknown_assets_are_reported_and_the_rest_created(metadata: str) -> None:
    results = receive(
        InboxBatch.model_validate(
            {
                "source": "deployment_a",
                "events": [
                    {
                        "id": 1,
                        "uri": "warehouse://nowhere",
                        "name": "nowhere",
                        "timestamp": dt.datetime.now(dt.UTC),
                    },
                    {"id": 2, "uri": URI, "name": "h_user", "timestamp": dt.datetime.now(dt.UTC)},
                ],
            }
        )
    )
    assert [r["status"] for r in results] == ["unknown_asset", "created"]
    assert _all("SELECT source_event_id FROM dataset_bridge.inbox") == [(2,)]  # an unknown one is not claimed


def test_an_event_the_source_may_not_use_is_refused_alone(metadata: str) -> None:
    from airflow.models.asset import AssetActive, AssetModel
    from airflow.utils.session import create_session

    with create_session() as session:
        session.add_all(
            [
                AssetModel(name="payroll", uri="warehouse://dds/payroll"),
                AssetActive(name="payroll", uri="warehouse://dds/payroll"),
            ]
        )
    batch = InboxBatch.model_validate(
        {
            "source": "deployment_a",
            "events": [
                {"id": 1, "uri": URI, "name": "h_user", "timestamp": dt.datetime.now(dt.UTC)},
                {
                    "id": 2,
                    "uri": "warehouse://dds/payroll",
                    "name": "payroll",
                    "timestamp": dt.datetime.now(dt.UTC),
                },
                {"id": 3, "uri": URI, "name": "h_user", "timestamp": dt.datetime.now(dt.UTC)},
            ],
        }
    )
    results = receive(batch, frozenset({f"uri:{URI}"}))
    assert [r["status"] for r in results] == ["created", "forbidden", "created"]
    assert "may not create events for 'warehouse://dds/payroll'" in results[1]["error"]
    assert _all("SELECT source_event_id FROM dataset_bridge.inbox ORDER BY 1") == [(1,), (3,)]
    # allowed later: the same event id is then created (a forbidden one was never claimed)
    assert [r["status"] for r in receive(batch, frozenset({"*"}))] == ["duplicate", "created", "duplicate"]
