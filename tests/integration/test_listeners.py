"""LISTEN on a source (``triggers/pg.py``): one connection per source and event loop for all its channels,
channels unlistened and the connection closed once nobody listens, counted in the source's own
``pg_stat_activity``. The source is the ETL's database: a connection per channel exhausts its
``max_connections``."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack
from urllib.parse import urlsplit

import asyncpg
import pytest

from triggers import pg
from triggers.polling import Hint, listening

CHANNELS = 200


def target_of(dsn: str) -> pg.PgTarget:
    url = urlsplit(dsn)
    return pg.PgTarget(
        host=url.hostname or "127.0.0.1",
        port=url.port or 5432,
        user=url.username,
        password=url.password,
        database=url.path.lstrip("/"),
        ssl="disable",
    )


async def ours(dsn: str) -> int:
    """Our listening sessions on the source, as its DBA sees them."""
    conn = await asyncpg.connect(dsn)
    try:
        return int(
            await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 "
                "AND datname = current_database()",
                pg.LISTENER_NAME,
            )
        )
    finally:
        await conn.close()


async def eventually(probe: object, done: object, what: str, timeout: float = 20) -> object:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        value = await probe()  # type: ignore[operator]
        if done(value):  # type: ignore[operator]
            return value
        assert asyncio.get_running_loop().time() < deadline, f"gave up waiting for {what}: {value}"
        await asyncio.sleep(0.05)


async def notify(dsn: str, channel: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("SELECT pg_notify($1, 'x')", channel)
    finally:
        await conn.close()


async def test_two_hundred_channels_share_one_connection_closed_after_the_last_leaves(
    pg_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pg, "LISTEN_GRACE_SECONDS", 0.3)
    target = target_of(pg_db)
    channels = [f"loads_{i}" for i in range(CHANNELS)]
    async with AsyncExitStack() as first_half, AsyncExitStack() as second_half:
        hints: dict[str, Hint] = {}
        for index, channel in enumerate(channels):  # each as a wait subscribes and arms before its check
            stack = first_half if index < CHANNELS // 2 else second_half
            hints[channel] = await stack.enter_async_context(listening(target, channel))
            await hints[channel].arm()
        assert await ours(pg_db) == 1

        await notify(pg_db, "loads_7")
        await asyncio.wait_for(hints["loads_7"].event.wait(), 10)  # type: ignore[union-attr]
        assert [c for c, h in hints.items() if h.event is not None and h.event.is_set()] == ["loads_7"]

        await first_half.aclose()  # half the waits leave: their channels are unlistened after the grace
        source = pg.shared_listener(target, channels[-1]).source
        kept = set(channels[CHANNELS // 2 :])
        await eventually(
            lambda: asyncio.sleep(0, source.listening), lambda ls: ls == kept, "the left channels unlistened"
        )
        assert source.conn is not None
        listened = {r[0] for r in await source.conn.fetch("SELECT pg_listening_channels()")}
        assert listened == kept
        assert await ours(pg_db) == 1
    await eventually(lambda: ours(pg_db), lambda n: n == 0, "the listener closed once nobody listens")
    assert source not in pg._sources.values(), "a closed listener leaves the registry"


async def test_a_wait_that_comes_back_within_the_grace_finds_the_listener_open(
    pg_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pg, "LISTEN_GRACE_SECONDS", 60)
    target = target_of(pg_db)
    async with listening(target, "loads_a") as hint:
        await hint.arm()
    async with listening(target, "loads_a") as hint:  # a group restarting, a wait deferring again
        await hint.arm()
        await notify(pg_db, "loads_a")
        await asyncio.wait_for(hint.event.wait(), 10)  # type: ignore[union-attr]
    assert await ours(pg_db) == 1
    source = pg.shared_listener(target, "loads_a").source
    await source.tidy()  # the grace over: nobody listens
    assert await ours(pg_db) == 0
