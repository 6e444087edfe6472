"""Coalesced checks (triggers/coalesce.py): TableLoadTrigger waits on one status table share one statement
per tick, counted by pg_stat_statements on a real source server of their own."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from airflow.sdk.exceptions import AirflowException, AirflowSkipException

from deferrables import TableLoadSensor
from devkit.pgserver import EmbeddedPostgres
from triggers import TableLoadTrigger
from triggers.coalesce import CHUNK_KEYS, KeyedBatch, batches, totals

pytestmark = pytest.mark.timeout(180)

STATUS_DDL = """
CREATE EXTENSION IF NOT EXISTS pg_stat_statements;
CREATE SCHEMA meta;
CREATE TABLE meta.detail_process_table_status (
    id bigserial PRIMARY KEY, table_name text, status text, created_dttm timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX ON meta.detail_process_table_status (table_name, created_dttm);
-- the same rows, ten seconds per statement (a one-time filter, slept even over no rows): a slow source
CREATE VIEW meta.slow_status AS
SELECT * FROM meta.detail_process_table_status WHERE (SELECT pg_sleep(10)) IS NOT NULL;
-- two seconds per statement: a tick long enough to send a NOTIFY during it
CREATE VIEW meta.busy_status AS
SELECT * FROM meta.detail_process_table_status WHERE (SELECT pg_sleep(2)) IS NOT NULL;
"""


@pytest.fixture(scope="module")
def source_server() -> Iterator[EmbeddedPostgres]:
    """A private server with pg_stat_statements loaded (the shared one may not preload it)."""
    root = Path(tempfile.mkdtemp(prefix="smart-triggerer-source-"))
    server = EmbeddedPostgres(root / "pgdata", settings={"shared_preload_libraries": "pg_stat_statements"})
    try:
        server.start()
        yield server
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def source(source_server: EmbeddedPostgres, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A fresh source database with the status table, as Airflow connection ``warehouse``."""
    name = f"source_{time.monotonic_ns()}"

    async def create() -> None:
        admin = await asyncpg.connect(source_server.dsn)
        await admin.execute(f'CREATE DATABASE "{name}"')
        await admin.close()
        conn = await asyncpg.connect(_dsn(source_server, name))
        await conn.execute(STATUS_DDL)
        await conn.close()

    asyncio.run(create())
    monkeypatch.setenv("AIRFLOW_CONN_WAREHOUSE", _dsn(source_server, name))
    monkeypatch.delenv("AIRFLOW__SMART_TRIGGERER__COALESCE_CHECKS", raising=False)
    yield _dsn(source_server, name)


def _dsn(server: EmbeddedPostgres, dbname: str) -> str:
    return server.dsn.rsplit("/", 1)[0] + f"/{dbname}"


async def record(dsn: str, rows: list[tuple[str, str]], notify: str | None = None) -> None:
    conn = await asyncpg.connect(dsn)
    if rows:
        await conn.executemany(
            "INSERT INTO meta.detail_process_table_status (table_name, status) VALUES ($1, $2)", rows
        )
    if notify:
        await conn.execute(f"NOTIFY {notify}")
    await conn.close()


async def status_statements(dsn: str, relation: str = "meta.detail_process_table_status") -> int:
    """Calls of the status query on this database, as pg_stat_statements counted them."""
    conn = await asyncpg.connect(dsn)
    calls = await conn.fetchval(
        "SELECT coalesce(sum(calls), 0) FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid "
        "WHERE d.datname = current_database() AND s.query LIKE '%DISTINCT ON%' AND s.query LIKE $1",
        f"%FROM {'.'.join(f'{chr(34)}{p}{chr(34)}' for p in relation.split('.'))} %",
    )
    await conn.close()
    return int(calls)


async def first_event(trigger: TableLoadTrigger) -> dict[str, Any]:
    stream: AsyncIterator[Any] = trigger.run()
    event = await stream.__anext__()
    return dict(event.payload)


async def until(probe: Any, what: str, timeout: float = 60.0) -> Any:
    """Poll ``probe`` (sync or async) until it returns something truthy."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        await asyncio.sleep(0.05)


def the_batch(members: int, status_table: str = "meta.detail_process_table_status") -> KeyedBatch | None:
    found = [b for b in batches().values() if b.name.startswith(status_table + " ")]
    return found[0] if found and len(found[0].members) >= members else None


async def ticks_after(batch: KeyedBatch, more: int) -> None:
    """Wait until the batch has run ``more`` ticks after now."""
    target = batch.stats.ticks + more
    await until(lambda: batch.stats.ticks >= target, f"{more} more ticks")


async def stop(tasks: list[asyncio.Task[Any]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_three_hundred_waits_share_one_statement_per_tick(source: str) -> None:
    triggers = [TableLoadTrigger("warehouse", [f"t{i}", "shared"], poll_interval=0.3) for i in range(300)]
    tasks = [asyncio.create_task(first_event(t)) for t in triggers]
    batch = await until(lambda: the_batch(300), "300 members in one batch")
    await ticks_after(batch, 5)
    await record(source, [("shared", "SUCCESS")] + [(f"t{i}", "SUCCESS") for i in range(150)])
    events = await asyncio.wait_for(asyncio.gather(*tasks[:150]), 30)
    assert all(e["status"] == "success" for e in events)
    await ticks_after(batch, 2)  # the rest judged rows that do not end their waits
    assert not any(task.done() for task in tasks[150:])
    await record(source, [(f"t{i}", "SUCCESS") for i in range(150, 300)])
    events = await asyncio.wait_for(asyncio.gather(*tasks[150:]), 30)
    assert all(e["status"] == "success" for e in events)
    calls = await status_statements(source)
    # every statement the batch made, and no other, reached the source: one per tick, never one per wait
    assert calls == batch.stats.answered == batch.stats.statements == batch.stats.ticks
    assert batch.stats.ticks >= 8 and calls < 300


async def test_each_wait_judges_its_own_since_failure_and_soft_fail_inside_one_batch(source: str) -> None:
    await record(source, [("x", "SUCCESS"), ("y", "FAILED"), ("z", "START")])
    conn = await asyncpg.connect(source)
    loaded_at = await conn.fetchval("SELECT max(created_dttm) FROM meta.detail_process_table_status")
    await conn.close()
    plain = asyncio.create_task(first_event(TableLoadTrigger("warehouse", ["x"], poll_interval=0.3)))
    newer = asyncio.create_task(
        first_event(TableLoadTrigger("warehouse", ["x"], poll_interval=0.3, since=loaded_at.isoformat()))
    )
    failed = asyncio.create_task(first_event(TableLoadTrigger("warehouse", ["y", "x"], poll_interval=0.3)))
    loading = asyncio.create_task(first_event(TableLoadTrigger("warehouse", ["z"], poll_interval=0.3)))
    assert (await asyncio.wait_for(plain, 30))["status"] == "success"
    event = await asyncio.wait_for(failed, 30)
    assert event["status"] == "failed" and "FAILED for y" in event["message"]
    # each task applies its own soft_fail to the event its wait got from the batch
    with pytest.raises(AirflowSkipException):
        TableLoadSensor(
            task_id="soft", conn_id="warehouse", required_tables=["x", "y"], soft_fail=True
        ).execute_complete({}, event)
    with pytest.raises(AirflowException, match="FAILED for y"):
        TableLoadSensor(task_id="hard", conn_id="warehouse", required_tables=["x", "y"]).execute_complete(
            {}, event
        )
    batch = await until(lambda: the_batch(2), "the batch of the two still waiting")
    await ticks_after(batch, 2)
    assert not newer.done() and not loading.done()  # x's load is not newer than since; z is mid-load
    await record(source, [("x", "SUCCESS"), ("z", "SUCCESS")])
    assert (await asyncio.wait_for(newer, 30))["status"] == "success"
    assert (await asyncio.wait_for(loading, 30))["status"] == "success"


async def test_a_key_the_source_refuses_fails_only_its_own_waits(source: str) -> None:
    good = [
        asyncio.create_task(first_event(TableLoadTrigger("warehouse", [f"ok{i}"], poll_interval=0.3)))
        for i in range(40)
    ]
    bad = asyncio.create_task(
        first_event(TableLoadTrigger("warehouse", ["ok3", "bad\x00name"], poll_interval=0.3))
    )
    event = await asyncio.wait_for(bad, 30)
    assert event["status"] == "error" and "CharacterNotInRepertoireError" in event["message"]
    batch = await until(lambda: the_batch(40), "the good waits still in their batch")
    assert batch.stats.splits > 0
    assert not any(task.done() for task in good)  # the same tick answered them: rows, not the error
    await record(source, [(f"ok{i}", "SUCCESS") for i in range(40)])
    events = await asyncio.wait_for(asyncio.gather(*good), 30)
    assert all(e["status"] == "success" for e in events)


async def test_a_wrong_column_fails_every_wait_without_splitting(source: str) -> None:
    sent, split = totals.statements, totals.splits
    tasks = [
        asyncio.create_task(
            first_event(TableLoadTrigger("warehouse", [f"t{i}"], time_column="loaded_at", poll_interval=0.3))
        )
        for i in range(50)
    ]
    events = await asyncio.wait_for(asyncio.gather(*tasks), 30)
    assert all(e["status"] == "error" and "loaded_at" in e["message"] for e in events)
    # no halving of the keys: the statement and one probe without keys in each tick that had members (a
    # join tick or two: fewer than the 2 x 50 statements halving would take)
    assert totals.splits == split and totals.statements - sent <= 2 * 5


async def test_a_notify_wakes_the_batch_at_once(source: str) -> None:
    tasks = [
        asyncio.create_task(
            first_event(TableLoadTrigger("warehouse", [f"t{i}"], poll_interval=300, notify_channel="loads"))
        )
        for i in range(20)
    ]
    batch = await until(lambda: the_batch(20), "20 members")
    await until(lambda: all(m.checked for m in batch.members), "the first check of every member")
    started = time.monotonic()
    await record(source, [(f"t{i}", "SUCCESS") for i in range(20)], notify="loads")
    events = await asyncio.wait_for(asyncio.gather(*tasks), 30)
    assert all(e["status"] == "success" for e in events)
    assert time.monotonic() - started < 10  # the next tick was 300 s away


async def test_a_notify_during_a_tick_runs_another_tick_at_once(source: str) -> None:
    """A load that commits while a tick's statement runs is not in that tick's answer: its NOTIFY must
    start the next tick at once, not after the interval (300 s)."""
    wait = TableLoadTrigger(
        "warehouse", ["late"], status_table="meta.busy_status", poll_interval=300, notify_channel="loads"
    )
    task = asyncio.create_task(first_event(wait))
    batch = await until(lambda: the_batch(1, "meta.busy_status"), "the batch")
    await until(lambda: batch.stats.answered >= 1, "its first answer")
    await record(source, [], notify="loads")  # a tick with nothing new ...
    await until(lambda: busy_statement_running(source), "the tick's statement to run")
    await record(source, [("late", "SUCCESS")], notify="loads")  # ... during which the load lands
    event = await asyncio.wait_for(task, 60)
    assert event["status"] == "success"


async def busy_statement_running(dsn: str) -> bool:
    """Is a status query on meta.busy_status executing on the source now (past its snapshot)?"""
    conn = await asyncpg.connect(dsn)
    running = await conn.fetchval(
        "SELECT count(*) FROM pg_stat_activity WHERE state = 'active' "
        "AND query LIKE '%busy_status%' AND pid <> pg_backend_pid()"
    )
    await conn.close()
    return bool(running)


async def test_a_batch_ticks_at_its_shortest_interval(source: str) -> None:
    slow = [
        asyncio.create_task(first_event(TableLoadTrigger("warehouse", [f"s{i}"], poll_interval=300)))
        for i in range(10)
    ]
    batch = await until(lambda: the_batch(10), "10 slow members")
    await until(lambda: all(m.checked for m in batch.members), "their first check")
    fast = asyncio.create_task(first_event(TableLoadTrigger("warehouse", ["f"], poll_interval=0.3)))
    await until(lambda: len(batch.members) == 11 and all(m.checked for m in batch.members), "the join")
    await record(source, [(f"s{i}", "SUCCESS") for i in range(10)])
    # the slow members' next own poll is 300 s away: the fast member's cadence answers them
    events = await asyncio.wait_for(asyncio.gather(*slow), 30)
    assert all(e["status"] == "success" for e in events)
    assert not fast.done()
    await stop([fast])


async def test_a_batch_over_the_chunk_size_is_split_into_statements(source: str) -> None:
    per_wait = 100
    waits = CHUNK_KEYS * 3 // 2 // per_wait  # 7,500 keys: two statements a tick
    tasks = [
        asyncio.create_task(
            first_event(
                TableLoadTrigger("warehouse", [f"w{w}_{k}" for k in range(per_wait)], poll_interval=0.5)
            )
        )
        for w in range(waits)
    ]
    batch = await until(lambda: the_batch(waits), f"{waits} members")
    await ticks_after(batch, 3)
    await record(source, [(f"w{w}_{k}", "SUCCESS") for w in range(waits) for k in range(per_wait)])
    events = await asyncio.wait_for(asyncio.gather(*tasks), 60)
    assert all(e["status"] == "success" for e in events)
    calls = await status_statements(source)
    assert calls == batch.stats.answered == batch.stats.statements
    # a full tick over 7,500 keys is two statements (join ticks over fewer keys may be one)
    assert batch.stats.ticks < calls <= 2 * batch.stats.ticks
    assert batch.stats.keys <= CHUNK_KEYS * calls


async def test_a_slow_source_does_not_delay_another_batch(source: str) -> None:
    slow_wait = TableLoadTrigger("warehouse", ["a"], status_table="meta.slow_status", poll_interval=0.3)
    slow = asyncio.create_task(first_event(slow_wait))
    slow_batch = await until(lambda: the_batch(1, "meta.slow_status"), "the slow batch")
    await until(lambda: slow_batch.stats.statements >= 1, "the slow batch's first statement")
    fast = asyncio.create_task(first_event(TableLoadTrigger("warehouse", ["b"], poll_interval=0.3)))
    await record(source, [("b", "SUCCESS")])
    started = time.monotonic()
    assert (await asyncio.wait_for(fast, 30))["status"] == "success"
    # the fast batch answered while the slow batch's first statement (10 s) was still running
    assert slow_batch.stats.answered == 0, time.monotonic() - started
    await stop([slow])


async def test_a_restarted_source_backs_the_batch_off_and_loses_no_wait(
    source: str, source_server: EmbeddedPostgres
) -> None:
    tasks = [
        asyncio.create_task(first_event(TableLoadTrigger("warehouse", [f"t{i}"], poll_interval=0.3)))
        for i in range(30)
    ]
    batch = await until(lambda: the_batch(30), "30 members")
    await ticks_after(batch, 2)
    failed = batch.stats.failed
    await asyncio.to_thread(source_server.restart, 2.0)
    await record(source, [(f"t{i}", "SUCCESS") for i in range(30)])
    events = await asyncio.wait_for(asyncio.gather(*tasks), 60)
    assert all(e["status"] == "success" for e in events)
    # the ticks of the 2 s down (one every 0.3 s) failed and backed the batch off; none ended a wait
    assert batch.stats.failed > failed


async def test_a_notify_whose_tick_fails_is_answered_when_the_source_is_back(
    source: str, source_server: EmbeddedPostgres
) -> None:
    """A NOTIFY asks for a full tick; when that tick finds the source away, the retry after the back-off
    must still be a full tick: the members' own next tick is 300 s away."""
    tasks = [
        asyncio.create_task(
            first_event(TableLoadTrigger("warehouse", [f"t{i}"], poll_interval=300, notify_channel="loads"))
        )
        for i in range(10)
    ]
    batch = await until(lambda: the_batch(10), "10 members")
    await until(lambda: all(m.checked for m in batch.members), "the first check of every member")
    await record(source, [(f"t{i}", "SUCCESS") for i in range(10)])  # no NOTIFY: nothing ticks
    failed = batch.stats.failed
    await asyncio.to_thread(source_server.stop)
    try:
        batch.notified()  # the load's NOTIFY, arrived just before the source went away
        await until(lambda: batch.stats.failed > failed, "the notified tick to fail")
    finally:
        await asyncio.to_thread(source_server.start)
    # well before the 300 s interval: the retry was the NOTIFY's full tick
    events = await asyncio.wait_for(asyncio.gather(*tasks), 60)
    assert all(e["status"] == "success" for e in events)


async def test_off_makes_one_statement_per_wait(source: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW__SMART_TRIGGERER__COALESCE_CHECKS", "False")
    tasks = [
        asyncio.create_task(first_event(TableLoadTrigger("warehouse", [f"t{i}"], poll_interval=60)))
        for i in range(30)
    ]
    await until(lambda: status_statements(source), "the first checks", timeout=30)
    await until(lambda: _at_least(status_statements(source), 30), "one statement per wait", timeout=30)
    assert not batches()
    await stop(tasks)


async def _at_least(calls: Any, count: int) -> bool:
    return int(await calls) >= count
