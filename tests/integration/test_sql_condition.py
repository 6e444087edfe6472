"""SqlConditionTrigger / SqlConditionSensor against a real PostgreSQL."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import asyncpg
import pytest
from airflow.sdk.exceptions import AirflowException, TaskDeferred

from deferrables import SqlConditionSensor
from triggers import SqlConditionTrigger


@pytest.fixture
def warehouse(pg_db: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    async def create() -> None:
        conn = await asyncpg.connect(pg_db)
        await conn.execute("CREATE TABLE loads (name text, done boolean, broken boolean DEFAULT false)")
        await conn.close()

    asyncio.run(create())
    monkeypatch.setenv("AIRFLOW_CONN_WAREHOUSE", pg_db)
    yield pg_db


async def execute(dsn: str, sql: str, *args: Any) -> None:
    conn = await asyncpg.connect(dsn)
    await conn.execute(sql, *args)
    await conn.close()


async def first_event(trigger: SqlConditionTrigger, timeout: float = 10) -> dict[str, Any]:
    return dict((await asyncio.wait_for(trigger.run().__anext__(), timeout)).payload)


DONE = "SELECT bool_or(done) FROM loads WHERE name = $1"
BROKEN = "SELECT bool_or(broken) FROM loads WHERE name = $1"
NAME = "o'brien; DROP TABLE loads; --"


async def test_condition_with_bound_values_fires(warehouse: str) -> None:
    trigger = SqlConditionTrigger("warehouse", DONE, parameters=[NAME], poll_interval=0.2)
    waiting = asyncio.create_task(first_event(trigger))
    await asyncio.sleep(0.5)
    assert not waiting.done()
    await execute(warehouse, "INSERT INTO loads (name, done) VALUES ($1, true)", NAME)
    assert (await waiting)["status"] == "success"


async def test_failure_sql_ends_the_wait_as_failed(warehouse: str) -> None:
    await execute(warehouse, "INSERT INTO loads (name, done, broken) VALUES ('x', false, true)")
    trigger = SqlConditionTrigger("warehouse", DONE, parameters=["x"], failure_sql=BROKEN,
                                  failure_parameters=["x"], poll_interval=0.2)
    event = await first_event(trigger)
    assert event == {"status": "failed", "message": "the failure condition holds"}


async def test_bad_sql_fails_with_the_cause(warehouse: str) -> None:
    event = await first_event(SqlConditionTrigger("warehouse", "SELEC 1", poll_interval=0.2))
    assert event["status"] == "error" and "syntax error" in event["message"]


def test_sensor_checks_then_defers_and_bad_sql_fails_the_task(warehouse: str) -> None:
    sensor = SqlConditionSensor(task_id="wait", conn_id="warehouse", sql=DONE, parameters=["y"])
    with pytest.raises(TaskDeferred) as deferred:
        sensor.execute({})
    assert deferred.value.trigger.serialize()[1]["parameters"] == ["y"]
    asyncio.run(execute(warehouse, "INSERT INTO loads (name, done) VALUES ('y', true)"))
    sensor.execute({})  # holds now: finishes in the worker
    with pytest.raises(AirflowException, match="syntax error"):
        SqlConditionSensor(task_id="bad", conn_id="warehouse", sql="SELEC 1").execute({})
