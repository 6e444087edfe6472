"""The bench's HTTP source speaks enough HTTP/1.1 for its clients: what it counts is what the benches
report, so a request it misreads would be a figure wrong."""

from __future__ import annotations

import asyncio
import socket

import aiohttp
import pytest

from bench.source import PollSource


@pytest.fixture(scope="module")
def source() -> PollSource:
    started = PollSource()
    started.start()
    return started


def exchange(source: PollSource, *parts: bytes) -> bytes:
    """Send ``parts`` one write each on one connection, then read until the source closes it."""
    with socket.create_connection(("127.0.0.1", source.port), timeout=10) as sock:
        for part in parts:
            sock.sendall(part)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    return received


def test_aiohttp_polls_are_counted_with_their_key_and_trigger_id(source: PollSource) -> None:
    async def poll_twice() -> list[bool]:
        async with aiohttp.ClientSession() as session:
            answers = []
            for trigger_id in (7, 8):  # one kept-alive connection, two requests
                async with session.get(f"{source.url}/poll/k%20one", params={"t": str(trigger_id)}) as got:
                    answers.append((await got.json())["ready"])
            return answers

    before = source.polls
    source.flip_keys({"k one"})
    assert asyncio.run(poll_twice()) == [True, True]
    assert source.polls == before + 2
    assert [(key, trigger_id) for _, key, trigger_id in source.poll_log[-2:]] == [("k one", 7), ("k one", 8)]
    assert "k one" in source.first_ready


def test_requests_in_one_write_split_over_writes_and_with_a_body_are_each_answered(
    source: PollSource,
) -> None:
    before = source.polls
    received = exchange(
        source,
        b"GET /poll/a?t=1 HTTP/1.1\r\nHost: x\r\n\r\nGET /poll/b HTTP/1.1\r\nHost: x\r\n\r\nGET /po",
        b"ll/c?t=x HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhel",
        b"lo",
        b"GET /polls HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    assert received.count(b"HTTP/1.1 200 OK\r\n") == 4
    assert received.count(b'{"ready": false}') == 3
    assert received.endswith(b'{"polls": %d}' % (before + 3))
    polled = [(key, trigger_id) for _, key, trigger_id in source.poll_log[-3:]]
    assert polled == [("a", 1), ("b", 0), ("c", 0)]


def test_an_unknown_path_and_another_method_are_refused_and_http_1_0_is_closed(source: PollSource) -> None:
    before = source.polls
    assert exchange(source, b"GET /nothing HTTP/1.0\r\n\r\n").startswith(b"HTTP/1.1 404 Not Found\r\n")
    refused = exchange(source, b"POST /poll/a HTTP/1.1\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
    assert refused.startswith(b"HTTP/1.1 405 Method Not Allowed\r\n")
    assert source.polls == before
