"""The relay's edge cases against a real PostgreSQL outbox and a real HTTP inbox stand-in (aiohttp, same
protocol and signature check as the inbox): per-row attempts, 413 splitting, replies without results, and a
database that goes away and comes back while the relay runs."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from aiohttp import web
from sqlalchemy import text as sql_text

from dataset_bridge import outbox, signing, store
from dataset_bridge.relay import Relay, RelaySettings
from dataset_bridge.routes import Routes
from devkit.pgserver import free_port
from tests.helpers.airflow_orm import use_airflow_db

SECRET = "s3cret"
# what a buggy inbox answers: the dead letter keeps the error, never the secrets it may carry
BUG = (
    "the inbox failed on this batch: KeyError at bulk_events.py:88 "
    f"(db postgresql://airflow:hunter2@db/b, password=hunter2, key {SECRET})"
)


@dataclass
class Inbox:
    """What the stand-in inbox answers; every request it accepted, in order."""

    url: str = ""
    max_events: int = 1000
    fail_with: int | None = None
    reply: Callable[[list[dict[str, Any]]], Any] | None = None
    fails_on: int | None = None  # an event id the inbox answers 500 for, in any batch (a bug in B)
    received: list[int] = field(default_factory=list)
    requests: int = 0


@pytest.fixture
async def inbox() -> AsyncIterator[Inbox]:
    state = Inbox()

    async def handle(request: web.Request) -> web.Response:
        state.requests += 1
        body = await request.read()
        signing.verify({"deployment_a": SECRET}, {k.lower(): v for k, v in request.headers.items()}, body)
        events = json.loads(body)["events"]
        if state.fail_with is not None:
            return web.Response(status=state.fail_with, text="refused by the test")
        if len(events) > state.max_events:
            return web.Response(status=413, text="body too large")
        if state.fails_on in {e["id"] for e in events}:
            return web.json_response({"detail": BUG}, status=500)
        if state.reply is not None:
            return web.json_response(state.reply(events))
        state.received.extend(e["id"] for e in events)
        return web.json_response({"results": [{"id": e["id"], "status": "created"} for e in events]})

    app = web.Application()
    app.router.add_post("/inbox", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    state.url = f"http://127.0.0.1:{port}/inbox"
    try:
        yield state
    finally:
        await runner.cleanup()


def _routes(url: str, max_attempts: int = 10, max_server_errors: int = 10) -> Routes:
    return Routes.parse(
        {
            "source": "deployment_a",
            "targets": {
                "b": {
                    "url": url,
                    "secret_env": "BRIDGE_SECRET_RELAY_TEST",
                    "assets": ["x"],
                    "max_attempts": max_attempts,
                    "max_server_errors": max_server_errors,
                }
            },
        }
    )


async def _outbox(dsn: str) -> asyncpg.Pool:
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=4)
    async with pool.acquire() as conn:
        for _version, _name, sql in store.migrations():  # the bridge's schema, as a migration makes it
            await conn.execute(sql)
    return pool


async def _add(pool: asyncpg.Pool, event_ids: range, attempts: int = 0) -> None:
    await pool.executemany(
        "INSERT INTO dataset_bridge.outbox (target, asset_event_id, asset_uri, asset_name, event_timestamp, "
        "attempts) VALUES ('b', $1, 'x', 'x', $2, $3)",
        [(i, dt.datetime.now(dt.UTC), attempts) for i in event_ids],
    )


async def _rows(pool: asyncpg.Pool) -> dict[int, tuple[str, int, str | None]]:
    found = await pool.fetch("SELECT asset_event_id, status, attempts, last_error FROM dataset_bridge.outbox")
    return {r["asset_event_id"]: (r["status"], r["attempts"], r["last_error"]) for r in found}


async def _deliver(pool: asyncpg.Pool, routes: Routes, settings: RelaySettings | None = None) -> int:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        relay = Relay(pool, routes, settings or RelaySettings())
        return await relay.deliver_target(session, routes.targets[0])


@pytest.fixture(autouse=True)
def _secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BRIDGE_SECRET_RELAY_TEST", SECRET)


async def test_each_row_counts_its_own_attempts(pg_db: str, inbox: Inbox) -> None:
    pool = await _outbox(pg_db)
    try:
        await _add(pool, range(1, 2), attempts=4)  # the head was refused 4 times already
        await _add(pool, range(2, 3))  # joined the queue just now
        inbox.fail_with = 401  # a refusal (a rotated secret not yet rolled out, say)
        assert await _deliver(pool, _routes(inbox.url, max_attempts=5)) == 0
        rows = await _rows(pool)
        assert rows[1][:2] == ("dead", 5)
        assert rows[2][:2] == ("pending", 1)  # one failure of its own: it is retried, not dead-lettered
        assert "HTTP 401" in str(rows[2][2])
    finally:
        await pool.close()


@pytest.mark.parametrize("status", [502, 503, 504, 429, 408, None])
async def test_an_unreachable_or_failing_target_never_dead_letters(
    pg_db: str, inbox: Inbox, status: int | None
) -> None:
    pool = await _outbox(pg_db)
    try:
        await _add(pool, range(1, 2), attempts=9)  # one attempt left by max_attempts
        inbox.fail_with = status
        url = inbox.url if status is not None else f"http://127.0.0.1:{free_port()}/inbox"  # nothing listens
        assert await _deliver(pool, _routes(url, max_attempts=10)) == 0
        assert (await _rows(pool))[1][:2] == ("pending", 10)  # retried later, not dead-lettered
    finally:
        await pool.close()


async def test_a_batch_over_the_inbox_limit_is_split_and_delivered_in_order(pg_db: str, inbox: Inbox) -> None:
    pool = await _outbox(pg_db)
    try:
        await _add(pool, range(1, 11))
        inbox.max_events = 3
        assert await _deliver(pool, _routes(inbox.url)) == 10
        assert inbox.received == list(range(1, 11))
        assert {status for status, _, _ in (await _rows(pool)).values()} == {"delivered"}

        inbox.max_events = 0  # even a single event is too large: that one is dead-lettered at once
        await _add(pool, range(11, 12))
        assert await _deliver(pool, _routes(inbox.url)) == 0
        status, attempts, error = (await _rows(pool))[11]
        assert (status, attempts) == ("dead", 1)
        assert "HTTP 413" in str(error)
    finally:
        await pool.close()


@pytest.mark.parametrize(
    "reply",
    [
        pytest.param(lambda events: {"ok": True}, id="no-results"),
        pytest.param(
            lambda events: {"results": [{"id": events[0]["id"], "status": "created"}]}, id="partial"
        ),
    ],
)
async def test_a_success_reply_without_a_result_for_every_event_is_a_failure(
    pg_db: str, inbox: Inbox, reply: Callable[[list[dict[str, Any]]], Any]
) -> None:
    pool = await _outbox(pg_db)
    try:
        await _add(pool, range(1, 3))
        inbox.reply = reply  # a proxy's page or a wrong URL that answers 200
        assert await _deliver(pool, _routes(inbox.url)) == 0
        rows = await _rows(pool)
        assert [rows[i][:2] for i in (1, 2)] == [("pending", 1), ("pending", 1)]
        assert "result" in str(rows[1][2])
    finally:
        await pool.close()


async def _set_connections(admin: asyncpg.Connection, dbname: str, allowed: bool) -> None:
    await admin.execute(f'ALTER DATABASE "{dbname}" WITH ALLOW_CONNECTIONS {str(allowed).lower()}')
    if not allowed:
        await admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = $1 AND pid <> pg_backend_pid()",
            dbname,
        )


async def test_the_relay_rides_out_its_database_going_away(
    airflow_db: str, pg_server: str, inbox: Inbox, tmp_path: Path
) -> None:
    """Every connection of the relay (pool, LISTEN, the sweeper's SQLAlchemy session) is cut and new ones
    are refused for a few seconds, as in a PostgreSQL restart; the relay keeps running and delivers what
    was added meanwhile, woken again by NOTIFY."""
    use_airflow_db(airflow_db)
    dbname = airflow_db.rsplit("/", 1)[1].split("?", maxsplit=1)[0]
    pool = await _outbox(airflow_db)
    admin = await asyncpg.connect(pg_server)
    stop = asyncio.Event()
    settings = RelaySettings(poll_seconds=30, sweep_every=0.5, backoff_base=0.2)
    relay = asyncio.create_task(Relay(pool, _routes(inbox.url), settings).run(stop))
    try:
        await _add(pool, range(1, 3))
        await pool.execute("SELECT pg_notify($1, '')", outbox.CHANNEL)
        await _until(lambda: inbox.received == [1, 2])
        await _until_ok(lambda: _all_delivered(pool, 2))  # marked, so the cut below cannot resend them
        await _set_connections(admin, dbname, allowed=False)
        await asyncio.sleep(3)  # passes fail meanwhile: the relay must not die of it
        assert not relay.done(), relay
        await _set_connections(admin, dbname, allowed=True)
        await _until_ok(lambda: _add(pool, range(3, 5)))
        await pool.execute("SELECT pg_notify($1, '')", outbox.CHANNEL)
        await _until(lambda: inbox.received == [1, 2, 3, 4], timeout=20)
        await _until_ok(lambda: _all_delivered(pool, 4))
        assert not relay.done()
    finally:
        stop.set()
        await _set_connections(admin, dbname, allowed=True)
        await asyncio.wait_for(relay, 15)
        await admin.close()
        await pool.close()


async def _until(probe: Callable[[], bool], timeout: float = 10) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not probe():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def _all_delivered(pool: asyncpg.Pool, count: int) -> None:
    rows = await _rows(pool)
    if len(rows) != count or {status for status, _, _ in rows.values()} != {"delivered"}:
        raise OSError("not yet")


async def _until_ok(action: Callable[[], Any], timeout: float = 10) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            await action()
            return
        except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError):
            assert asyncio.get_running_loop().time() < deadline, "the database did not come back"
            await asyncio.sleep(0.2)


async def test_a_backlog_goes_in_full_batches_read_ahead_in_order(pg_db: str, inbox: Inbox) -> None:
    pool = await _outbox(pg_db)
    try:
        await _add(pool, range(1, 2501))
        assert await _deliver(pool, _routes(inbox.url), RelaySettings(batch=1000)) == 2500
        assert inbox.requests == 3  # 1000 + 1000 + 500
        assert inbox.received == list(range(1, 2501))
        assert {status for status, _, _ in (await _rows(pool)).values()} == {"delivered"}
    finally:
        await pool.close()


async def test_dead_letters_can_be_replayed_once_the_cause_is_fixed(pg_db: str, inbox: Inbox) -> None:
    from dataset_bridge.relay import replay_dead

    pool = await _outbox(pg_db)
    try:
        await _add(pool, range(1, 3))
        inbox.fail_with = 403  # e.g. the assets are not yet in B's allow-list
        assert await _deliver(pool, _routes(inbox.url, max_attempts=1)) == 0
        assert {row[0] for row in (await _rows(pool)).values()} == {"dead"}
        await _add(pool, range(3, 4))  # a later event, still pending
        inbox.fail_with = None  # fixed in B
        async with pool.acquire() as conn:
            # a pool's connection proxy: replay_dead is typed for a Connection (dataset_bridge/relay.py)
            assert await replay_dead(conn, ["b", "other"]) == {"b": 2}  # type: ignore[arg-type]
        assert {k: v[:2] for k, v in (await _rows(pool)).items()} == {
            1: ("pending", 0),
            2: ("pending", 0),
            3: ("pending", 0),
        }
        assert await _deliver(pool, _routes(inbox.url)) == 3
        assert inbox.received == [1, 2, 3]  # the replayed ones first: order kept
    finally:
        await pool.close()


async def test_a_late_failure_of_an_overlapping_relay_never_undoes_a_delivery(
    pg_db: str, inbox: Inbox
) -> None:
    from dataset_bridge.relay import MARK_DEAD, MARK_RETRY

    pool = await _outbox(pg_db)
    try:
        await _add(pool, range(1, 2))
        assert await _deliver(pool, _routes(inbox.url)) == 1
        ids = [r["id"] for r in await pool.fetch("SELECT id FROM dataset_bridge.outbox")]
        # a second relay that read the row before the first marked it now reports its own failure
        assert await pool.fetch(MARK_RETRY, ids, "HTTP 500", 1.0, 1, 1, 1) == []
        await pool.execute(MARK_DEAD, ids, "refused")
        assert (await _rows(pool))[1][:2] == ("delivered", 1)
    finally:
        await pool.close()


async def test_the_relay_keeps_sweeping_delivering_and_pruning_with_an_unreadable_event(
    airflow_db: str, inbox: Inbox
) -> None:
    """A watcher event whose extra jsonb cannot hold (a NUL character) among others: the sweep dead-letters
    it alone with the reason, the others are delivered, the prune still runs, and a replay leaves it dead
    (it cannot be sent)."""
    from airflow.assets.manager import AssetManager
    from airflow.models.asset import AssetActive, AssetModel
    from airflow.utils.session import create_session

    from dataset_bridge.relay import prepare, replay_dead

    use_airflow_db(airflow_db)
    routes = _routes(inbox.url)
    await asyncio.to_thread(prepare, routes)
    with create_session() as session:
        session.add_all([AssetModel(name="x", uri="x"), AssetActive(name="x", uri="x")])
    with create_session() as session:
        asset = session.query(AssetModel).filter_by(uri="x").one().to_serialized()
        events = [
            AssetManager.register_asset_change(asset=asset, extra=extra, session=session).id  # type: ignore[union-attr]
            for extra in ({"n": 1}, {"note": "a\x00b"}, {"n": 3})
        ]
        session.execute(
            sql_text(
                "INSERT INTO dataset_bridge.outbox (target, asset_event_id, asset_uri, asset_name, "
                "event_timestamp, status, delivered_at) "
                "VALUES ('b', -1, 'x', 'x', now(), 'delivered', now() - interval '40 days')"
            )
        )
    pool = await asyncpg.create_pool(airflow_db, min_size=1, max_size=4)
    stop = asyncio.Event()
    settings = RelaySettings(poll_seconds=0.2, sweep_every=0.2, prune_every=0.2, backoff_base=0.2)
    relay = asyncio.create_task(Relay(pool, routes, settings).run(stop))
    try:
        await _until(lambda: inbox.received == [events[0], events[2]], timeout=30)
        await _until_ok(lambda: _pruned(pool, -1), timeout=30)
        status, _, error = (await _rows(pool))[events[1]]
        assert status == "dead"
        assert "cannot store its extra as jsonb" in str(error) and "\\u0000" in str(error)
        async with pool.acquire() as conn:
            assert await replay_dead(conn, ["b"]) == {}  # type: ignore[arg-type]  # a connection proxy
        assert not relay.done()
    finally:
        stop.set()
        await asyncio.wait_for(relay, 15)
        await pool.close()


async def _pruned(pool: asyncpg.Pool, event_id: int) -> None:
    if await pool.fetchval("SELECT count(*) FROM dataset_bridge.outbox WHERE asset_event_id = $1", event_id):
        raise OSError("not yet")


async def test_a_server_error_on_one_event_dead_letters_it_alone_after_max_server_errors(
    pg_db: str, inbox: Inbox
) -> None:
    """B answers 500 for any batch holding event 3 (a bug in B, not an outage): the batch is split until
    event 3 is alone, the events before it are delivered, event 3 is dead-lettered after
    max_server_errors with the body's error (its secrets masked), and the events after it follow. Earlier
    outage failures (timeouts, 503) do not count toward that bound."""
    pool = await _outbox(pg_db)
    try:
        await _add(pool, range(1, 6), attempts=50)  # after a long outage of B
        inbox.fails_on = 3
        routes = _routes(inbox.url, max_server_errors=3)
        settings = RelaySettings(backoff_base=0.01, backoff_cap=0.02)
        deadline = asyncio.get_running_loop().time() + 20
        while (await _rows(pool))[5][0] != "delivered":
            assert asyncio.get_running_loop().time() < deadline, await _rows(pool)
            await _deliver(pool, routes, settings)
            await asyncio.sleep(0.01)  # the head backs off for up to 0.02 s between passes
        assert inbox.received == [1, 2, 4, 5]
        rows = await _rows(pool)
        status, attempts, error = rows[3]
        assert status == "dead" and attempts == 53
        assert "HTTP 500" in str(error) and "KeyError at bulk_events.py:88" in str(error)
        assert "hunter2" not in str(error) and SECRET not in str(error)
        counted = "SELECT server_errors FROM dataset_bridge.outbox WHERE asset_event_id = 3"
        assert await pool.fetchval(counted) == 3
    finally:
        await pool.close()


async def test_a_lower_outbox_id_committed_late_is_delivered_before_the_higher_ones(
    pg_db: str, inbox: Inbox
) -> None:
    """Two writers: the one holding the lower outbox id commits after the other. The relay delivers
    nothing past it while its transaction is open, then both in id order: a later event never
    overtakes an earlier one, and none is skipped."""
    pool = await _outbox(pg_db)
    late = await asyncpg.connect(pg_db)
    try:
        open_transaction = late.transaction()
        await open_transaction.start()
        await late.execute(
            "INSERT INTO dataset_bridge.outbox (target, asset_event_id, asset_uri, "
            "asset_name, event_timestamp) VALUES ('b', 1, 'x', 'x', now())"
        )
        await _add(pool, range(2, 4))  # committed, with higher ids
        assert await _deliver(pool, _routes(inbox.url)) == 0
        assert inbox.requests == 0
        await open_transaction.commit()
        assert await _deliver(pool, _routes(inbox.url)) == 3
        assert inbox.received == [1, 2, 3]
    finally:
        await late.close()
        await pool.close()


async def test_the_relay_tells_due_rows_by_the_database_clock(
    pg_db: str, inbox: Inbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The relay's host 5 minutes behind the database: a row the database made due now is sent now (and
    one backing off by the database's clock is not sent early by a host ahead of it)."""
    import time
    from types import SimpleNamespace

    from dataset_bridge import relay

    host = {"skew": -300.0}
    monkeypatch.setattr(
        relay, "time", SimpleNamespace(time=lambda: time.time() + host["skew"], monotonic=time.monotonic)
    )
    pool = await _outbox(pg_db)
    try:
        await _add(pool, range(1, 3))
        assert await _deliver(pool, _routes(inbox.url)) == 2
        await _add(pool, range(3, 4))
        await pool.execute(
            "UPDATE dataset_bridge.outbox SET next_attempt_at = now() + interval '1 minute' "
            "WHERE asset_event_id = 3"
        )
        host["skew"] = 300.0
        assert await _deliver(pool, _routes(inbox.url)) == 0
        assert inbox.received == [1, 2]
    finally:
        await pool.close()
