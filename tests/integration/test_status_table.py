"""TableStatusTrigger's producer on a real PostgreSQL: NOTIFY wakes it, malformed rows are skipped, and the
durable watermark moves only past rows a watcher emitted and Airflow stored."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
from airflow.triggers.shared_stream import AdvanceItem, AdvanceOutcome

from dataset_bridge import TableStatusTrigger
from dataset_bridge.cli import _watermarks as _watermarks_shown
from dataset_bridge.status_table import StatusRowProducer, subscribers
from tests.integration.test_table_load import record, warehouse  # noqa: F401 (the fixture)

TABLE = "dds.h_user"


async def _watermark(dsn: str) -> int | None:
    conn = await asyncpg.connect(dsn)
    try:
        if not await conn.fetchval("SELECT to_regclass('dataset_bridge.status_watermark') IS NOT NULL"):
            return None
        value = await conn.fetchval(
            "SELECT last_id FROM dataset_bridge.status_watermark WHERE table_name = $1", TABLE
        )
        return int(value) if value is not None else None
    finally:
        await conn.close()


async def _until(probe: Any, timeout: float = 10) -> Any:
    deadline = asyncio.get_running_loop().time() + timeout
    while (value := await probe()) is None:
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)
    return value


def _stored(payload: tuple[str, int], acked: int = 1) -> AdvanceItem:
    return AdvanceItem(payload, AdvanceOutcome(acked=acked, failed=0))


async def _next(stream: AsyncIterator[Any], timeout: float) -> tuple[dict[str, Any], tuple[str, int]]:
    row, payload = await asyncio.wait_for(stream.__anext__(), timeout)
    return row, payload


async def test_notify_wakes_the_stream_and_the_watermark_follows_stored_events(warehouse: str) -> None:  # noqa: F811
    trigger = TableStatusTrigger("warehouse", TABLE, poll_interval=300, notify_channel="table_loads")
    await record(warehouse, TABLE, "SUCCESS")  # row 1: history from before the watcher, never an event
    producer = StatusRowProducer(trigger.serialize()[1])
    subscribers.add(producer.key, TABLE)
    stream = producer.open_stream()
    try:
        pending = asyncio.ensure_future(stream.__anext__())
        assert await _until(lambda: _watermark(warehouse)) == 1  # starts after the newest row
        conn = await asyncpg.connect(warehouse)
        await conn.execute(
            "INSERT INTO meta.detail_process_table_status (table_name, status) "
            "VALUES (NULL, 'SUCCESS'), ($1, 'WEIRD'), ($1, 'START')",
            TABLE,
        )  # rows 2-4
        await conn.close()
        await record(warehouse, TABLE, "SUCCESS", notify="table_loads")  # row 5; polling is every 300 s
        row, payload = await asyncio.wait_for(pending, 5)
        assert (row["id"], row["table_name"], payload) == (5, TABLE, (TABLE, 5))

        subscribers.mark_emitted(producer.key, TABLE, 5)
        await producer.advance([_stored(payload)])
        assert await _watermark(warehouse) == 5

        await record(warehouse, TABLE, "SUCCESS", notify="table_loads")  # row 6: never emitted
        await record(warehouse, TABLE, "SUCCESS", notify="table_loads")  # row 7: emitted
        (_, six), (_, seven) = await _next(stream, 5), await _next(stream, 5)
        subscribers.mark_emitted(producer.key, TABLE, 7)
        await producer.advance([_stored(six), _stored(seven)])
        assert await _watermark(warehouse) == 5  # stops before the row nobody emitted
        shown = await _watermarks_shown("warehouse")  # what `dataset-bridge status --watermarks` prints
        assert [(w["table_name"], w["last_id"]) for w in shown] == [(TABLE, 5)]

        # still watched: rows 6 and 7 are read again at once (no restart, no 300 s poll), and once they
        # are stored the watermark catches up
        (_, six), (_, seven) = await _next(stream, 5), await _next(stream, 5)
        assert (six, seven) == ((TABLE, 6), (TABLE, 7))
        subscribers.mark_emitted(producer.key, TABLE, 6)
        subscribers.mark_emitted(producer.key, TABLE, 7)
        await producer.advance([_stored(six), _stored(seven)])
        assert await _watermark(warehouse) == 7
    finally:
        await stream.aclose()  # type: ignore[attr-defined]  # typed as an AsyncIterator; an async generator
        subscribers.remove(producer.key, TABLE)

    # a restarted producer reads again from the watermark: nothing lost
    await record(warehouse, TABLE, "SUCCESS")  # row 8, while no producer ran
    again = StatusRowProducer(trigger.serialize()[1])
    subscribers.add(again.key, TABLE)
    stream = again.open_stream()
    try:
        assert (await _next(stream, 5))[1] == (TABLE, 8)
    finally:
        await stream.aclose()  # type: ignore[attr-defined]  # typed as an AsyncIterator; an async generator
        subscribers.remove(again.key, TABLE)


async def test_nothing_moves_past_a_row_not_stored_and_a_failed_watermark_write_is_survived(
    warehouse: str,  # noqa: F811
    monkeypatch: Any,
) -> None:
    trigger = TableStatusTrigger("warehouse", TABLE, poll_interval=300, start_from="earliest")
    for _ in range(3):
        await record(warehouse, TABLE, "SUCCESS")  # rows 1-3
    producer = StatusRowProducer(trigger.serialize()[1])
    subscribers.add(producer.key, TABLE)
    stream = producer.open_stream()
    try:
        one, two, three = [(await _next(stream, 5))[1] for _ in range(3)]
        for row_id in (1, 3):  # row 2's event was not stored (its ack timed out)
            subscribers.mark_emitted(producer.key, TABLE, row_id)
        await producer.advance([_stored(one)])
        await producer.advance([AdvanceItem(two, AdvanceOutcome(acked=0, failed=1))])
        await producer.advance([_stored(three)])  # a later batch of the lane: must not pass row 2
        assert await _watermark(warehouse) == 1
        assert [(await _next(stream, 5))[1] for _ in range(2)] == [two, three]  # read again

        async def unreachable(*_: Any) -> None:
            raise asyncpg.exceptions.ConnectionDoesNotExistError("connection was closed")

        assert producer.watermarks is not None
        monkeypatch.setattr(producer.watermarks, "advance", unreachable)
        subscribers.mark_emitted(producer.key, TABLE, 2)
        await producer.advance([_stored(two)])  # the metadata of the watched DB is away: no crash
        monkeypatch.undo()
        subscribers.mark_emitted(producer.key, TABLE, 3)
        await producer.advance([_stored(three)])
        assert await _watermark(warehouse) == 3
    finally:
        await stream.aclose()  # type: ignore[attr-defined]  # typed as an AsyncIterator; an async generator
        subscribers.remove(producer.key, TABLE)


async def test_outside_a_shared_stream_the_watermark_never_moves_without_a_stored_confirmation(
    warehouse: str,  # noqa: F811
) -> None:
    trigger = TableStatusTrigger("warehouse", TABLE, poll_interval=300, start_from="earliest")
    await record(warehouse, TABLE, "SUCCESS")  # row 1
    events = trigger.run()
    try:
        first = await asyncio.wait_for(events.__anext__(), 5)
        assert first.payload["row_id"] == 1
        waiting = asyncio.ensure_future(events.__anext__())  # the runner took it and asks for the next
        await asyncio.sleep(0.5)
        assert await _watermark(warehouse) == 0  # nothing says the event was stored
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
    finally:
        await events.aclose()  # type: ignore[attr-defined]  # typed as an AsyncIterator; an async generator


async def test_a_watcher_cancelled_before_the_runner_took_its_event_does_not_mark_the_row() -> None:
    """Chaos run finding: a handover cancelled a watcher while Airflow's runner was still logging its event
    (before binding it); the row was already marked emitted, so the watermark moved past a row whose
    asset event never existed. A row counts as emitted only once the runner took the event."""
    trigger = TableStatusTrigger("warehouse", TABLE)
    key = trigger.shared_stream_key()

    async def rows() -> AsyncIterator[dict[str, Any]]:
        for row_id in (41, 42):
            yield {"id": row_id, "table_name": TABLE, "status": "SUCCESS", "at": "2026-11-23T00:00:00"}

    events = trigger.filter_shared_stream(rows())
    first = await events.__anext__()
    assert first.payload["row_id"] == 41
    assert not subscribers.take_emitted(key, (TABLE, 41))  # handed out, not yet taken by the runner
    await events.__anext__()  # the runner took event 41 and asks for the next
    assert subscribers.take_emitted(key, (TABLE, 41))
    await events.aclose()  # type: ignore[attr-defined]  # cancelled while sitting on 42
    assert not subscribers.take_emitted(key, (TABLE, 42))


async def test_a_row_whose_second_emission_fails_is_read_again_and_no_stale_mark_vouches_for_it(
    warehouse: str,  # noqa: F811
) -> None:
    trigger = TableStatusTrigger("warehouse", TABLE, poll_interval=300, start_from="earliest")
    for _ in range(2):
        await record(warehouse, TABLE, "SUCCESS")  # rows 1-2
    producer = StatusRowProducer(trigger.serialize()[1])
    subscribers.add(producer.key, TABLE)
    stream = producer.open_stream()
    failed = AdvanceOutcome(acked=0, failed=1)
    try:
        one, two = [(await _next(stream, 5))[1] for _ in range(2)]
        subscribers.mark_emitted(producer.key, TABLE, 1)
        await producer.advance([_stored(one)])
        # row 2: emitted (marked) but its persist failed, twice in a row
        for _ in range(2):
            subscribers.mark_emitted(producer.key, TABLE, 2)
            await producer.advance([AdvanceItem(two, failed)])
            assert (await _next(stream, 5))[1] == two  # read again at once, each time
        assert await _watermark(warehouse) == 1
        # a watcher cancelled by a handover "acks" row 2 without emitting it: no mark left over from the
        # failed emissions may count as stored
        await producer.advance([_stored(two)])
        assert await _watermark(warehouse) == 1
        assert (await _next(stream, 5))[1] == two
        subscribers.mark_emitted(producer.key, TABLE, 2)
        await producer.advance([_stored(two)])  # stored at last
        assert await _watermark(warehouse) == 2
        assert not producer.blocked and not subscribers.emitted
    finally:
        await stream.aclose()  # type: ignore[attr-defined]  # typed as an AsyncIterator; an async generator
        subscribers.remove(producer.key, TABLE)
