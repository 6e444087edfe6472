"""AssetEventSensor against a real (migrated) Airflow metadata database."""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import TYPE_CHECKING

import pytest
from airflow.sdk.exceptions import TaskDeferred

from deferrables import AssetEventSensor
from devkit.devstack import AirflowConfig
from devkit.pgserver import reader_dsn
from tests.helpers.airflow_orm import use_airflow_db
from triggers import SqlConditionTrigger

if TYPE_CHECKING:
    from airflow.triggers.base import TriggerEvent


def add_event(dsn: str, uri: str, at: dt.datetime) -> None:
    from airflow.models.asset import AssetEvent, AssetModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    use_airflow_db(dsn)
    with create_session() as session:
        asset = session.scalar(select(AssetModel).where(AssetModel.uri == uri))
        if asset is None:
            asset = AssetModel(name=uri, uri=uri)
            session.add(asset)
            session.flush()
        session.add(AssetEvent(asset_id=asset.id, timestamp=at))


def test_waits_for_an_event_newer_than_since(airflow_db: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_AIRFLOW_DB", reader_dsn(airflow_db))
    since = dt.datetime.now(dt.UTC)
    add_event(airflow_db, "warehouse://dds/h_user", since - dt.timedelta(hours=1))  # too old
    sensor = AssetEventSensor(
        task_id="wait", asset="warehouse://dds/h_user", since=since.isoformat(), poke_interval=0.2
    )
    with pytest.raises(TaskDeferred) as deferred:
        sensor.execute({})
    trigger = deferred.value.trigger
    assert isinstance(trigger, SqlConditionTrigger)
    assert trigger.serialize()[1]["parameters"] == ["warehouse://dds/h_user", since.isoformat()]

    async def wait_then_publish() -> dict[str, object]:
        # run() is typed as an AsyncIterator; its __anext__ is an async generator's, a coroutine
        waiting: asyncio.Task[TriggerEvent] = asyncio.create_task(trigger.run().__anext__())  # type: ignore[arg-type]
        await asyncio.sleep(0.6)
        assert not waiting.done()
        later = since + dt.timedelta(seconds=1)
        await asyncio.to_thread(add_event, airflow_db, "warehouse://dds/h_user", later)
        return dict((await asyncio.wait_for(waiting, 10)).payload)

    assert asyncio.run(wait_then_publish())["status"] == "success"
    sensor.execute({})  # the event is there now: finishes in the worker


def test_rejects_a_missing_asset_at_parse_time() -> None:
    with pytest.raises(ValueError, match="asset"):
        AssetEventSensor(task_id="wait", asset="")


def test_external_latest_run_is_read_from_the_metadata_db(
    airflow_config: AirflowConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    from airflow.sdk.exceptions import AirflowException

    from deferrables import ExternalDagSensor
    from deferrables.external_dag import latest_run_id
    from tests.helpers.seeding import seed_deferred

    monkeypatch.setenv("AIRFLOW_CONN_AIRFLOW_DB", reader_dsn(airflow_config.database_dsn))
    seeded = seed_deferred(
        airflow_config.database_dsn,
        airflow_config.dags_folder,
        count=1,
        classpath="x.Y",
        kwargs_for=lambda i: {},
    )
    assert asyncio.run(latest_run_id("airflow_db", seeded.dag_id)) == seeded.run_id
    assert asyncio.run(latest_run_id("airflow_db", "no_such_dag")) is None
    sensor = ExternalDagSensor(task_id="wait", external_dag_id="no_such_dag", latest_run=True)
    with pytest.raises(AirflowException, match="no run yet"):
        sensor.execute({})


async def test_a_metadata_connection_that_can_write_is_refused(
    airflow_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """airflow_db with the owner's credentials: the sensor fails with the reason, naming the
    read-only role of docs/guides/sensors.md; the reader role (its GRANTs) is accepted."""
    import asyncpg

    from deferrables.external_dag import latest_run_id
    from triggers.pg import SourceError, refuse_writable_role

    monkeypatch.setenv("AIRFLOW_CONN_AIRFLOW_DB", airflow_db)
    sensor = AssetEventSensor(
        task_id="wait", asset="warehouse://dds/h_user", since="2026-01-01T00:00:00+00:00"
    )
    refused = await sensor.check()
    assert refused is not None and refused["status"] == "error" and "read-only role" in refused["message"]
    # started in the triggerer (start_from_trigger): no worker step, the trigger refuses it itself
    sensor.render_template_fields({})
    event = await asyncio.wait_for(sensor.trigger().run().__anext__(), 30)
    assert event.payload["status"] == "error" and "read-only role" in event.payload["message"]
    with pytest.raises(SourceError, match="can write"):
        await latest_run_id("airflow_db", "any_dag")
    reader = await asyncpg.connect(reader_dsn(airflow_db))
    try:
        await refuse_writable_role(reader, "airflow_db")  # no error
        for table in ("asset", "asset_event", "dag_run"):
            await reader.fetchval(f"SELECT count(*) FROM {table}")
        for secret_table in ("connection", "variable"):  # what DAG code must never read through it
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await reader.fetchval(f"SELECT count(*) FROM {secret_table}")
    finally:
        await reader.close()
