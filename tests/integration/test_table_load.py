"""TableLoadTrigger and TableLoadSensor against a real PostgreSQL status table."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import asyncpg
import pytest
from airflow.sdk.exceptions import AirflowException, AirflowSkipException, TaskDeferred

from deferrables import TableLoadSensor
from triggers import TableLoadTrigger
from triggers.pg import POOL_MAX_SIZE

STATUS_DDL = """
CREATE SCHEMA meta;
CREATE TABLE meta.detail_process_table_status (
    id bigserial PRIMARY KEY, table_name text, status text, created_dttm timestamptz NOT NULL DEFAULT now()
);
"""


@pytest.fixture
def warehouse(pg_db: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A database with the seed's status table, reachable as Airflow connection ``warehouse``."""

    async def create() -> None:
        conn = await asyncpg.connect(pg_db)
        await conn.execute(STATUS_DDL)
        await conn.close()

    asyncio.run(create())
    monkeypatch.setenv("AIRFLOW_CONN_WAREHOUSE", pg_db)
    yield pg_db


async def record(dsn: str, table: str, status: str, notify: str | None = None) -> None:
    conn = await asyncpg.connect(dsn)
    await conn.execute(
        "INSERT INTO meta.detail_process_table_status (table_name, status) VALUES ($1, $2)", table, status
    )
    if notify:
        await conn.execute(f"NOTIFY {notify}")
    await conn.close()


async def first_event(trigger: TableLoadTrigger, timeout: float) -> dict[str, Any]:
    stream: AsyncIterator[Any] = trigger.run()
    event = await asyncio.wait_for(stream.__anext__(), timeout)
    return dict(event.payload)


async def test_fires_when_every_table_is_loaded(warehouse: str) -> None:
    await record(warehouse, "dds.h_user", "SUCCESS")
    await record(warehouse, "dds.s_user", "START")
    trigger = TableLoadTrigger("warehouse", ["dds.h_user", "dds.s_user"], poll_interval=0.2)
    waiting = asyncio.create_task(first_event(trigger, 10))
    await asyncio.sleep(0.6)
    assert not waiting.done()
    await record(warehouse, "dds.s_user", "SUCCESS")
    event = await waiting
    assert event["status"] == "success" and event["loaded"] == ["dds.h_user", "dds.s_user"]


async def test_a_failed_load_fires_failed(warehouse: str) -> None:
    await record(warehouse, "dds.h_user", "START")
    await record(warehouse, "dds.h_user", "FAILED")
    event = await first_event(TableLoadTrigger("warehouse", ["dds.h_user"], poll_interval=0.2), 10)
    assert event["status"] == "failed" and "FAILED for dds.h_user" in event["message"]


async def test_a_wrong_column_fails_with_the_cause(warehouse: str) -> None:
    trigger = TableLoadTrigger("warehouse", ["dds.h_user"], time_column="loaded_at", poll_interval=0.2)
    event = await first_event(trigger, 10)
    assert event["status"] == "error" and "loaded_at" in event["message"]


async def test_notify_wakes_a_slow_poller_at_once(warehouse: str) -> None:
    trigger = TableLoadTrigger("warehouse", ["dds.h_user"], poll_interval=300, notify_channel="loads")
    waiting = asyncio.create_task(first_event(trigger, 30))
    await asyncio.sleep(1.0)  # the first check found nothing; now it waits on LISTEN or 300 s
    started = time.monotonic()
    await record(warehouse, "dds.h_user", "SUCCESS", notify="loads")
    event = await waiting
    assert event["status"] == "success"
    assert time.monotonic() - started < 2.0


async def test_two_thousand_waiters_share_one_pool(warehouse: str) -> None:
    dbname = warehouse.rsplit("/", 1)[1]
    admin = await asyncpg.connect(warehouse)
    others = "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()"
    # the fixture's own connection may still be listed for a moment after it closed
    for _ in range(100):
        if await admin.fetchval(others, dbname) == 0:
            break
        await asyncio.sleep(0.05)
    triggers = [TableLoadTrigger("warehouse", [f"t{i}"], poll_interval=0.05) for i in range(2000)]
    tasks = [asyncio.create_task(first_event(t, 60)) for t in triggers]
    peak = 0
    for _ in range(30):
        await asyncio.sleep(0.1)
        count = await admin.fetchval(others, dbname)
        peak = max(peak, count)
    assert 1 <= peak <= POOL_MAX_SIZE
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await admin.close()


def test_sensor_finishes_in_the_worker_when_already_loaded(warehouse: str) -> None:
    asyncio.run(record(warehouse, "dds.h_user", "SUCCESS"))
    sensor = TableLoadSensor(task_id="wait", conn_id="warehouse", required_tables=["dds.h_user"])
    sensor.execute({})  # returns without deferring


def test_sensor_defers_with_its_trigger_when_not_loaded(warehouse: str) -> None:
    sensor = TableLoadSensor(
        task_id="wait",
        conn_id="warehouse",
        required_tables=["b", "a"],
        poke_interval=42,
        timeout=600,
        notify_channel="loads",
    )
    with pytest.raises(TaskDeferred) as deferred:
        sensor.execute({})
    classpath, kwargs = deferred.value.trigger.serialize()
    assert classpath == "triggers.table_load.TableLoadTrigger"
    assert kwargs["required_tables"] == ["a", "b"] and kwargs["poll_interval"] == 42
    assert deferred.value.timeout is not None and deferred.value.timeout.total_seconds() == 600


def test_sensor_failed_load_fails_or_skips(warehouse: str) -> None:
    asyncio.run(record(warehouse, "dds.h_user", "FAILED"))
    with pytest.raises(AirflowException, match=r"FAILED for dds\.h_user"):
        TableLoadSensor(task_id="a", conn_id="warehouse", required_tables=["dds.h_user"]).execute({})
    with pytest.raises(AirflowSkipException):
        TableLoadSensor(
            task_id="b", conn_id="warehouse", required_tables=["dds.h_user"], soft_fail=True
        ).execute({})


def test_non_deferrable_poke_runs_the_same_check(warehouse: str) -> None:
    sensor = TableLoadSensor(
        task_id="wait", conn_id="warehouse", required_tables=["dds.h_user"], deferrable=False
    )
    assert sensor.poke({}) is False
    asyncio.run(record(warehouse, "dds.h_user", "SUCCESS"))
    assert sensor.poke({}) is True
