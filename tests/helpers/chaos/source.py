"""The HTTP condition source PollTrigger polls."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

from aiohttp import web

from tests.helpers.chaos.constants import BRIDGE_SOURCE


class KeySource:
    """``GET /poll/{key}`` answers ``{"ready": bool}``; a key is ready once the harness flipped it. A key
    with an event of its own (the poison, the NUL extra) answers it too: ``chaos_triggers`` yields it.

    ``POST /inbox`` is the relay's target: it checks the signature as the bridge's inbox does, answers
    "created" (or "duplicate") per event and counts the deliveries of each asset event id.
    """

    def __init__(self) -> None:
        self.ready: set[str] = set()
        self.events: dict[str, dict[str, Any]] = {}
        self.polls = 0
        self.port = 0
        self.secret = os.urandom(16).hex()
        self.received: Counter[int] = Counter()
        self.inbox_refusals = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _poll(self, request: web.Request) -> web.Response:
        self.polls += 1
        key = request.match_info["key"]
        if key not in self.ready:
            return web.json_response({"ready": False})
        return web.json_response({"ready": True, "event": self.events.get(key, {"key": key})})

    async def _inbox(self, request: web.Request) -> web.Response:
        from dataset_bridge import signing

        body = await request.read()
        try:
            signing.verify(
                {BRIDGE_SOURCE: self.secret}, {k.lower(): v for k, v in request.headers.items()}, body
            )
        except signing.SignatureError as err:
            self.inbox_refusals += 1
            return web.json_response({"detail": str(err)}, status=401)
        results = []
        for event in json.loads(body)["events"]:
            event_id = int(event["id"])
            results.append({"id": event_id, "status": "duplicate" if self.received[event_id] else "created"})
            self.received[event_id] += 1
        return web.json_response({"results": results})

    @contextlib.contextmanager
    def running(self) -> Iterator[KeySource]:
        loop = asyncio.new_event_loop()
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_get("/poll/{key}", self._poll)
        app.router.add_post("/inbox", self._inbox)
        runner = web.AppRunner(app, access_log=None)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0, backlog=4096)
        loop.run_until_complete(site.start())
        assert site._server is not None
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
        thread = threading.Thread(target=loop.run_forever, name="chaos-key-source", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)
            loop.close()
