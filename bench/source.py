"""An HTTP "source" for the benchmark: answers polls and counts them, server side.

It stands for the services a deployment's sensors poll, which run on other hosts: here it shares the
two cores with the triggerers it measures, so it answers with as little CPU as it can. A plain asyncio
protocol on uvloop answers a poll in about a fifth of the CPU of an ``aiohttp.web`` handler (measured at
the change, bench/RESULTS.md): at 50,000 waiters the source answers 1,000 polls a second while they wait
and a takeover's thousands of first polls at once, and through ``aiohttp.web`` it took a sixth of the
machine during a handover. It speaks just enough HTTP/1.1 for its clients (aiohttp, requests): GET,
keep-alive, a body skipped by its ``Content-Length``."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter
from urllib.parse import parse_qsl, unquote

import uvloop

HEAD_END = b"\r\n\r\n"
MAX_HEAD = 64 * 1024  # a request head longer than this is not one of ours: the connection is closed


class PollSource:
    def __init__(self) -> None:
        self.polls = 0
        self.per_key: Counter[str] = Counter()
        self.ready_prefixes: set[str] = set()
        self.first_ready: dict[str, float] = {}  # key -> wall-clock time of its first "ready" answer
        self.last_poll: dict[str, float] = {}  # key -> wall-clock time of its latest poll
        self.before_flip: dict[str, float] = {}  # key -> its last poll before its prefix flipped
        self.ready_keys: set[str] = set()  # keys made ready one by one (flip_keys)
        # every poll as (wall-clock time, key, trigger id of the polling coroutine): when each wait polled
        # again after a failover, and when each first polled after a start
        self.poll_log: list[tuple[float, str, int]] = []
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def poll(self, key: str, trigger_id: int) -> bool:
        """Count a poll of ``key`` by the coroutine of ``trigger_id``; whether the key is ready."""
        now = time.time()
        self.polls += 1
        self.per_key[key] += 1
        self.last_poll[key] = now
        self.poll_log.append((now, key, trigger_id))
        ready = key in self.ready_keys or any(key.startswith(p) for p in self.ready_prefixes)
        if ready:
            self.first_ready.setdefault(key, now)
        return ready

    def answer(self, target: str) -> tuple[int, bytes]:
        """(status, JSON body) for a GET of ``target`` (path and query)."""
        path, _, query = target.partition("?")
        if path.startswith("/poll/"):
            trigger_id = dict(parse_qsl(query)).get("t", "0")
            ready = self.poll(unquote(path[len("/poll/") :]), int(trigger_id) if trigger_id.isdigit() else 0)
            return 200, b'{"ready": true}' if ready else b'{"ready": false}'
        if path == "/polls":
            return 200, json.dumps({"polls": self.polls}).encode()
        return 404, b'{"error": "not found"}'

    def flip(self, prefix: str) -> float:
        """Make every key with this prefix ready; returns the wall-clock time of the flip."""
        self.before_flip.update((k, t) for k, t in list(self.last_poll.items()) if k.startswith(prefix))
        self.ready_prefixes.add(prefix)
        return time.time()

    def flip_keys(self, keys: set[str]) -> float:
        """Make these keys ready; returns the wall-clock time of the flip."""
        self.ready_keys |= keys
        return time.time()

    def start(self) -> None:
        threading.Thread(target=self._serve, daemon=True, name="poll-source").start()
        if not self._ready.wait(10):
            raise RuntimeError("poll source did not start")

    def _serve(self) -> None:
        self._loop = uvloop.new_event_loop()
        server = self._loop.run_until_complete(
            self._loop.create_server(lambda: _SourceProtocol(self), "127.0.0.1", 0, backlog=4096)
        )
        self.port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]  # an asyncio.Server
        self._ready.set()
        self._loop.run_forever()


class _SourceProtocol(asyncio.Protocol):
    """One client connection: requests in, answers out, in order, kept alive unless told otherwise."""

    def __init__(self, source: PollSource) -> None:
        self.source = source
        self.buffer = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while self.transport is not None and not self.transport.is_closing():
            end = self.buffer.find(HEAD_END)
            if end < 0:
                if len(self.buffer) > MAX_HEAD:
                    self.transport.close()
                return
            head = self.buffer[:end].decode("latin-1")
            line, _, fields = head.partition("\r\n")
            fields = "\r\n" + fields.lower()  # names and the values read here are case-insensitive
            body = _content_length(fields)
            if len(self.buffer) < end + len(HEAD_END) + body:
                return  # the rest of the body is still to come
            self.buffer = self.buffer[end + len(HEAD_END) + body :]
            self._respond(line, fields)

    def _respond(self, line: str, fields: str) -> None:
        assert self.transport is not None
        method, _, rest = line.partition(" ")
        target, _, version = rest.rpartition(" ")
        status, body = self.source.answer(target) if method == "GET" else (405, b'{"error": "GET only"}')
        close = "\r\nconnection: close" in fields or (
            version == "HTTP/1.0" and "\r\nconnection: keep-alive" not in fields
        )
        reason = {200: "OK", 404: "Not Found", 405: "Method Not Allowed"}[status]
        self.transport.write(
            f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{'Connection: close' if close else 'Connection: keep-alive'}"
            f"\r\n\r\n".encode()
            + body
        )
        if close:
            self.transport.close()


def _content_length(fields: str) -> int:
    """The request's ``Content-Length`` from its lower-cased header lines, each after a CRLF (0 without
    one)."""
    at = fields.find("\r\ncontent-length:")
    if at < 0:
        return 0
    value = fields[at + len("\r\ncontent-length:") :].partition("\r\n")[0].strip()
    return int(value) if value.isdigit() else 0
