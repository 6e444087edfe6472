"""The inbox's refusals over real sockets (the inbox app served by uvicorn, the real relay posting to it):
a sender's clock off is told from a bad signature and retried, never dead-lettered; a caller anyone can be
holds at most ``MAX_UNREAD_BODIES`` bodies at once, and a body trickled in too slowly frees its slot."""

from __future__ import annotations

import datetime as dt
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import asyncpg
import pytest
import uvicorn

from dataset_bridge import inbox, signing, store
from dataset_bridge.relay import Relay, RelaySettings
from dataset_bridge.routes import Routes
from devkit.pgserver import free_port
from tests.helpers.waiting import wait_for

SECRET = "s3cret-s3cret-s3cret"


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """The inbox app on a free port of 127.0.0.1, configured for source ``deployment_a``."""
    settings = ({"deployment_a": SECRET}, {"deployment_a": frozenset("*")})
    monkeypatch.setattr(inbox, "_settings", lambda: settings)
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(inbox.app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, bool, 30, "the inbox to listen")
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(30)


def _raw_request(port: int, headers: dict[str, str], length: int, body: bytes = b"") -> socket.socket:
    """A POST whose headers are sent and whose body is not (or only ``body`` of it)."""
    conn = socket.create_connection(("127.0.0.1", port), timeout=30)
    lines = [
        "POST /inbox HTTP/1.1",
        "Host: 127.0.0.1",
        "Content-Type: application/json",
        f"Content-Length: {length}",
        *(f"{k}: {v}" for k, v in headers.items()),
    ]
    conn.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
    return conn


def _status_of(conn: socket.socket) -> tuple[int, bytes]:
    answer = b""
    while b"\r\n\r\n" not in answer:
        chunk = conn.recv(65536)
        if not chunk:
            break
        answer += chunk
    return int(answer.split(b" ", 2)[1]), answer


def _current_headers() -> dict[str, str]:
    """Headers any caller can write: a source name, the current time, a signature that is not one."""
    return {
        signing.SOURCE_HEADER: "deployment_a",
        signing.TIMESTAMP_HEADER: str(int(time.time())),
        signing.SIGNATURE_HEADER: "sha256=" + "0" * 64,
    }


def test_a_caller_anyone_can_be_holds_a_bounded_number_of_bodies(served: int) -> None:
    held = [_raw_request(served, _current_headers(), inbox.MAX_BODY) for _ in range(inbox.MAX_UNREAD_BODIES)]
    try:
        wait_for(
            lambda: inbox.BodySlots.reading,
            lambda n: n == inbox.MAX_UNREAD_BODIES,
            30,
            "every slot taken by a body that does not come",
        )
        extra = _raw_request(served, _current_headers(), 100)
        status, answer = _status_of(extra)
        extra.close()
        assert status == 503 and b"retry-after: 1" in answer.lower(), answer
        held.pop().close()  # its caller gives up: its slot is free again
        wait_for(lambda: inbox.BodySlots.reading, lambda n: n < inbox.MAX_UNREAD_BODIES, 30, "a slot freed")
        body = b'{"source": "deployment_a", "events": []}'
        late = _raw_request(served, _current_headers(), len(body), body)
        status, answer = _status_of(late)
        late.close()
        assert status == 401, answer  # read and checked: the signature is not one
    finally:
        for conn in held:
            conn.close()
    wait_for(lambda: inbox.BodySlots.reading, lambda n: n == 0, 30, "every slot freed once the callers left")


def test_a_body_trickled_in_too_slowly_is_a_408_and_frees_its_slot(
    served: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(inbox, "BODY_READ_SECONDS", 1)
    slow = _raw_request(served, _current_headers(), 1000, b"{")
    try:
        status, answer = _status_of(slow)
    finally:
        slow.close()
    assert status == 408, answer
    wait_for(lambda: inbox.BodySlots.reading, lambda n: n == 0, 30, "the slot freed")


@pytest.mark.parametrize("offset", [-3600, 3600])
def test_a_clock_off_is_said_apart_from_a_bad_signature_before_the_body_is_read(
    served: int, offset: int
) -> None:
    headers = _current_headers()
    headers[signing.TIMESTAMP_HEADER] = str(int(time.time()) + offset)
    conn = _raw_request(served, headers, inbox.MAX_BODY)  # the body never comes: refused from the headers
    status, answer = _status_of(conn)
    conn.close()
    assert status == 401 and b'"reason":"clock_skew"' in answer, answer
    assert (b"ahead of" if offset > 0 else b"behind") in answer
    body = b'{"source": "deployment_a", "events": []}'
    bad = _raw_request(served, _current_headers(), len(body), body)
    status, answer = _status_of(bad)
    bad.close()
    assert status == 401 and b'"reason":"not_authenticated"' in answer, answer


async def test_the_relay_retries_a_clock_off_without_dead_lettering_and_says_why(
    pg_db: str, served: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The relay host's clock is an hour behind: its events stay pending past ``max_attempts`` (a refusal
    would have dead-lettered them) and the row says why."""
    monkeypatch.setenv("BRIDGE_SECRET_SKEW_TEST", SECRET)
    real_sign = signing.sign
    skew = {"seconds": -3600.0}

    def sign_with_the_hosts_clock(source: str, secret: str, body: bytes, now: float | None = None) -> Any:
        return real_sign(source, secret, body, now=time.time() + skew["seconds"])

    monkeypatch.setattr(signing, "sign", sign_with_the_hosts_clock)
    routes = Routes.parse(
        {
            "source": "deployment_a",
            "targets": {
                "b": {
                    "url": f"http://127.0.0.1:{served}/inbox",
                    "secret_env": "BRIDGE_SECRET_SKEW_TEST",
                    "assets": ["x"],
                    "max_attempts": 2,
                }
            },
        }
    )
    pool = await asyncpg.create_pool(pg_db, min_size=1, max_size=2)
    try:
        async with pool.acquire() as conn:
            for _version, _name, sql in store.migrations():  # the bridge's schema, as a migration makes it
                await conn.execute(sql)
        await pool.execute(
            "INSERT INTO dataset_bridge.outbox (target, asset_event_id, asset_uri, asset_name, "
            "event_timestamp, attempts) VALUES ('b', 1, 'x', 'x', $1, 5)",
            dt.datetime.now(dt.UTC),
        )
        async with aiohttp.ClientSession() as session:
            relay = Relay(pool, routes, RelaySettings())
            assert await relay.deliver_target(session, routes.targets[0]) == 0
        row = await pool.fetchrow("SELECT status, attempts, last_error FROM dataset_bridge.outbox")
        assert row is not None
        assert (row["status"], row["attempts"]) == ("pending", 6), row  # past max_attempts, still pending
        assert "behind the receiver's" in row["last_error"] and "NTP" in row["last_error"], row
    finally:
        await pool.close()
