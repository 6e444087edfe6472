"""A real aiohttp server in a thread, on a free localhost port, whose answers a test controls."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from aiohttp import web


class ControlledServer:
    def __init__(self) -> None:
        self.state: dict[str, Any] = {"job": {"state": "running"}}
        self.status = 200
        self.requests = 0
        self.auth_seen: list[str | None] = []
        self.port = 0
        # /poll/{key} (tests.helpers.chaos_triggers.SourcePollTrigger): keys ready for good, keys ready to
        # their next poll only (then never again until made ready), and the keys answered "ready" so far
        self.ready: set[str] = set()
        self.ready_once: set[str] = set()
        self.answered_ready: set[str] = set()
        self.polls: dict[str, int] = {}
        self.poll_log: list[tuple[float, str]] = []  # (time.time(), key) of every poll, oldest first
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _status(self, request: web.Request) -> web.Response:
        self.requests += 1
        self.auth_seen.append(request.headers.get("Authorization"))
        return web.json_response(self.state, status=self.status)

    async def _poll(self, request: web.Request) -> web.Response:
        key = request.match_info["key"]
        self.polls[key] = self.polls.get(key, 0) + 1
        self.poll_log.append((time.time(), key))
        if key in self.ready or key in self.ready_once:
            self.ready_once.discard(key)
            self.answered_ready.add(key)
            return web.json_response({"ready": True, "event": {"key": key}})
        return web.json_response({"ready": False})

    def polled_since(self, since: float) -> dict[str, float]:
        """Each key's first poll at or after ``since`` (wall clock)."""
        first: dict[str, float] = {}
        for at, key in reversed(self.poll_log):  # newest first: stop at ``since``
            if at < since:
                break
            first[key] = at
        return first

    async def _missing(self, request: web.Request) -> web.Response:
        return web.Response(status=404, text="no such job")

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_get("/api/job", self._status)
        app.router.add_get("/api/gone", self._missing)
        app.router.add_get("/poll/{key}", self._poll)
        self._runner = web.AppRunner(app, access_log=None)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        assert site._server is not None
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
        self._ready.set()
        self._loop.run_forever()

    @contextmanager
    def running(self) -> Iterator[ControlledServer]:
        thread = threading.Thread(target=self._serve, daemon=True)
        thread.start()
        self._ready.wait(10)
        try:
            yield self
        finally:
            assert self._runner is not None
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            thread.join(10)
