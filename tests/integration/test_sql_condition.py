"""SqlConditionTrigger / SqlConditionSensor against a real PostgreSQL."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest
from airflow.sdk.exceptions import AirflowException, TaskDeferred

from deferrables import SqlConditionSensor
from tests.helpers.tcp_proxy import Proxies
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
    trigger = SqlConditionTrigger(
        "warehouse", DONE, parameters=["x"], failure_sql=BROKEN, failure_parameters=["x"], poll_interval=0.2
    )
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


WRITING_CHECK = (
    "WITH x AS (INSERT INTO loads (name, done) VALUES ('forged', true) RETURNING done) "
    "SELECT bool_or(done) FROM x"
)


async def test_a_check_that_writes_fails_the_task_and_changes_nothing(warehouse: str) -> None:
    """Sensor checks run in READ ONLY transactions: a data-modifying CTE (on any connection, the metadata
    database included) fails with the cause instead of writing, in the trigger and in the worker."""
    event = await first_event(SqlConditionTrigger("warehouse", WRITING_CHECK, poll_interval=1))
    assert event["status"] == "error"
    assert "read-only" in event["message"]
    # a check may turn the session's default off; the next check's BEGIN READ ONLY still holds
    sneaky = "SELECT set_config('default_transaction_read_only', 'off', false) IS NOT NULL"
    turned_off = await first_event(SqlConditionTrigger("warehouse", sneaky, poll_interval=1))
    assert turned_off["status"] == "success"
    again = await first_event(SqlConditionTrigger("warehouse", WRITING_CHECK, poll_interval=1))
    assert again["status"] == "error"  # the session setting did not survive into the next check
    sensor = SqlConditionSensor(task_id="w", conn_id="warehouse", sql=WRITING_CHECK)
    assert (await sensor.check() or {}).get("status") == "error"
    conn = await asyncpg.connect(warehouse)
    try:
        assert await conn.fetchval("SELECT count(*) FROM loads") == 0
    finally:
        await conn.close()


@pytest.mark.parametrize("first", ["COMMIT", "ROLLBACK", "SET TRANSACTION READ WRITE"])
async def test_failure_sql_cannot_open_the_way_for_a_write(warehouse: str, first: str) -> None:
    """failure_sql runs first: it must not end the read-only transaction or turn it read-write."""
    trigger = SqlConditionTrigger("warehouse", WRITING_CHECK, failure_sql=first, poll_interval=1)
    event = await first_event(trigger)
    assert event["status"] == "error", event
    conn = await asyncpg.connect(warehouse)
    try:
        assert await conn.fetchval("SELECT count(*) FROM loads") == 0
    finally:
        await conn.close()


async def test_sessions_dying_as_postgresql_restarts_do_not_end_a_wait(
    warehouse: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restart's FATAL read between two statements leaves asyncpg's connection in a broken state
    (``InternalClientError``, not a PostgresError): met by the LISTEN of a wait's notify channel, it once
    ended the wait with "Trigger failure" (chaos seed 20261123). Every session dies right after start-up
    here until a few have; the wait keeps polling and ends on its condition."""
    url = urlsplit(warehouse)
    with Proxies((url.hostname or "127.0.0.1", url.port or 5432)).running() as proxies:
        proxy = proxies.get("warehouse")
        proxies.doom("warehouse", 4)
        proxied = url._replace(netloc=f"{url.username}@127.0.0.1:{proxy.port}")
        monkeypatch.setenv("AIRFLOW_CONN_WAREHOUSE_PROXIED", f"{urlunsplit(proxied)}?sslmode=disable")
        trigger = SqlConditionTrigger(
            "warehouse_proxied", DONE, parameters=["x"], poll_interval=0.2, notify_channel="loads_done"
        )
        waiting = asyncio.create_task(first_event(trigger, timeout=60))
        await wait_until(lambda: proxy.doomed_served >= 4 or waiting.done(), "four sessions to die")
        await execute(warehouse, "INSERT INTO loads (name, done) VALUES ('x', true)")
        assert (await waiting)["status"] == "success"


async def wait_until(ready: Callable[[], bool], what: str, timeout: float = 30) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not ready():
        assert asyncio.get_running_loop().time() < deadline, f"gave up waiting for {what}"
        await asyncio.sleep(0.02)


async def test_a_silent_source_holds_a_listener_only_for_its_timeout(
    warehouse: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every wait on a channel arms the shared listener before its check, under one lock: a source that
    accepts connections and then says nothing must give the hint up within LISTEN_TIMEOUT, not hold every
    wait on the channel until TCP gives up."""
    from triggers import pg

    monkeypatch.setattr(pg, "LISTEN_TIMEOUT", 0.5)
    url = urlsplit(warehouse)
    with Proxies((url.hostname or "127.0.0.1", url.port or 5432)).running() as proxies:
        proxy = proxies.get("silent")
        proxies.partition("silent")  # the kernel accepts; nothing reaches the server or comes back
        target = pg.PgTarget(
            host="127.0.0.1",
            port=proxy.port,
            user=url.username,
            password=None,
            database=url.path.lstrip("/"),
            ssl="disable",
        )
        listener = pg.ChannelListener(target, "loads_done")
        assert await asyncio.wait_for(listener.ensure(), 10) is False
        proxies.heal("silent")
        assert await asyncio.wait_for(listener.ensure(), 10) is True  # and listens once it answers
        assert listener.conn is not None
        await listener.conn.close()
