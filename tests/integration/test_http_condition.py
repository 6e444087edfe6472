"""HttpConditionTrigger / HttpConditionSensor against a real aiohttp server."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from airflow.sdk.exceptions import AirflowException, TaskDeferred

from deferrables import HttpConditionSensor
from tests.helpers.http_server import ControlledServer
from triggers import HttpConditionTrigger, http


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[ControlledServer]:
    with ControlledServer().running() as running:
        monkeypatch.setenv("AIRFLOW_CONN_JOBS", f"http://ops:s3cret@127.0.0.1:{running.port}")
        yield running


async def serve(path: str, handler: Any) -> tuple[web.AppRunner, int]:
    """An aiohttp server on a free port answering GET ``path``; the caller cleans the runner up."""
    app = web.Application()
    app.router.add_get(path, handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]


async def first_event(trigger: HttpConditionTrigger, timeout: float = 10) -> dict[str, Any]:
    return dict((await asyncio.wait_for(trigger.run().__anext__(), timeout)).payload)


async def test_waits_for_the_json_value_with_basic_auth(server: ControlledServer) -> None:
    trigger = HttpConditionTrigger(
        "jobs", "/api/job", json_path="job.state", expected_value="done", poll_interval=0.1
    )
    waiting = asyncio.create_task(first_event(trigger))
    await asyncio.sleep(0.4)
    assert not waiting.done() and server.requests >= 2
    server.state = {"job": {"state": "done"}}
    event = await waiting
    assert event["status"] == "success" and event["value"] == "done"
    assert server.auth_seen[-1] is not None and server.auth_seen[-1].startswith("Basic ")


async def test_server_errors_keep_waiting(server: ControlledServer) -> None:
    server.status = 503
    trigger = HttpConditionTrigger("jobs", "/api/job", poll_interval=0.1)
    waiting = asyncio.create_task(first_event(trigger))
    await asyncio.sleep(0.5)
    assert not waiting.done()
    server.status = 200
    assert (await waiting)["status"] == "success"


async def test_an_unexpected_4xx_fails_with_the_cause(server: ControlledServer) -> None:
    event = await first_event(HttpConditionTrigger("jobs", "/api/gone", poll_interval=0.1))
    assert event["status"] == "error" and "HTTP 404" in event["message"]
    assert "s3cret" not in event["message"]


@pytest.mark.parametrize(
    "connection",
    [
        '{"conn_type": "http", "host": "127.0.0.1", "port": 99999}',
        '{"conn_type": "http", "host": "http://[::1"}',
        '{"conn_type": "http", "host": "jobs api.example.com"}',
        '{"conn_type": "http", "host": "http://"}',
    ],
)
async def test_an_invalid_url_fails_with_the_cause(monkeypatch: pytest.MonkeyPatch, connection: str) -> None:
    """aiohttp builds a request lazily: the invalid URL is raised entering it, and must end the wait."""
    monkeypatch.setenv("AIRFLOW_CONN_BROKEN", connection)
    # at once (one poll interval would be 0.1 s): a host that can never resolve is not a DNS error to retry
    event = await first_event(HttpConditionTrigger("broken", "/x", poll_interval=0.1), timeout=5)
    assert event["status"] == "error" and "invalid URL" in event["message"], event


async def test_an_unreachable_host_backs_off_instead_of_failing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_DOWN", "http://127.0.0.1:9")  # discard port: connection refused
    with pytest.raises(TimeoutError):
        await first_event(HttpConditionTrigger("down", "/x", poll_interval=0.2), timeout=1.5)


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"method": "DELETE"}, "method"),
        ({"expected_statuses": [99]}, "expected_statuses"),
        ({"json_path": "a..b"}, "json_path"),
        ({"endpoint": 5}, "endpoint"),
    ],
)
def test_bad_arguments_fail_at_parse_time(kwargs: dict[str, Any], argument: str) -> None:
    with pytest.raises(ValueError, match=argument):
        HttpConditionSensor(**{"task_id": "wait", "endpoint": "/api/job", **kwargs})


def test_sensor_checks_in_the_worker_then_defers(server: ControlledServer) -> None:
    sensor = HttpConditionSensor(
        task_id="wait",
        http_conn_id="jobs",
        endpoint="/api/job",
        json_path="job.state",
        expected_value="done",
        poke_interval=30,
    )
    with pytest.raises(TaskDeferred) as deferred:
        sensor.execute({})
    assert deferred.value.trigger.serialize()[1]["verify_ssl"] is True
    server.state = {"job": {"state": "done"}}
    sensor.execute({})
    with pytest.raises(AirflowException, match="HTTP 404"):
        HttpConditionSensor(task_id="gone", http_conn_id="jobs", endpoint="/api/gone").execute({})


async def test_a_flood_of_requests_waits_for_a_connection_outside_aiohttp(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A takeover makes thousands of first polls at once. ``shared_request`` makes a request only once the
    session has a free connection: requests queued inside aiohttp's connector cost more CPU. Seen
    through aiohttp's own trace of each request's start, while a server holds every connection."""
    held, arrived = asyncio.Event(), 0

    async def hold(request: web.Request) -> web.Response:
        nonlocal arrived
        arrived += 1
        await held.wait()
        return web.json_response({"ready": True})

    runner, port = await serve("/poll", hold)
    started = 0

    async def on_start(*_: Any) -> None:
        nonlocal started
        started += 1

    trace = aiohttp.TraceConfig()
    trace.on_request_start.append(on_start)
    loop_key = id(asyncio.get_running_loop())
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=http.CONNECTIONS), trace_configs=[trace]
    )
    monkeypatch.setitem(http._sessions, loop_key, session)
    monkeypatch.setitem(http._slots, loop_key, asyncio.Semaphore(http.CONNECTIONS))

    async def poll() -> bool:
        async with http.shared_request("GET", f"http://127.0.0.1:{port}/poll") as response:
            return bool((await response.json())["ready"])

    try:
        polls = [asyncio.create_task(poll()) for _ in range(4 * http.CONNECTIONS)]
        async with asyncio.timeout(30):
            while arrived < http.CONNECTIONS:
                await asyncio.sleep(0.01)
        assert started == http.CONNECTIONS  # the other 150 wait for a connection without a request made
        held.set()
        assert all(await asyncio.gather(*polls))
        assert started == arrived == 4 * http.CONNECTIONS
    finally:
        held.set()
        await session.close()
        await runner.cleanup()


async def test_a_cookie_one_connection_earned_never_goes_with_another_connections_poll(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every HTTP trigger of the triggerer shares one session: a cookie the server set for one DAG's
    credentials must not be sent with another DAG's request to the same host (nor with the next poll)."""
    seen: list[tuple[str | None, str | None]] = []

    async def job(request: web.Request) -> web.Response:
        seen.append((request.headers.get("Authorization"), request.headers.get("Cookie")))
        response = web.json_response({"state": "running"})
        response.set_cookie("session", "granted-to-whoever-asked-first")
        return response

    runner, port = await serve("/api/job", job)
    # a host name: aiohttp's cookie jar keeps no cookie of an IP address
    monkeypatch.setenv("AIRFLOW_CONN_ALICE", f"http://alice:a-secret@localhost:{port}")
    monkeypatch.setenv("AIRFLOW_CONN_BOB", f"http://bob:b-secret@localhost:{port}")
    try:
        for conn_id in ("alice", "bob", "alice"):
            trigger = HttpConditionTrigger(
                conn_id, "/api/job", json_path="state", expected_value="done", poll_interval=0.05
            )
            with pytest.raises(TimeoutError):  # never done: one poll at least, then given up
                await first_event(trigger, timeout=0.3)
    finally:
        await runner.cleanup()
    assert {auth for auth, _ in seen} == {
        aiohttp.BasicAuth("alice", "a-secret").encode(),
        aiohttp.BasicAuth("bob", "b-secret").encode(),
    }
    assert len(seen) >= 3 and [cookie for _, cookie in seen] == [None] * len(seen)
