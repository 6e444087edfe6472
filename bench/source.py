"""An HTTP "source" for the benchmark: answers polls and counts them, server side."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter

from aiohttp import web


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
        self._runner: web.AppRunner | None = None
        self._ready = threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _poll(self, request: web.Request) -> web.Response:
        key = request.match_info["key"]
        now = time.time()
        self.polls += 1
        self.per_key[key] += 1
        self.last_poll[key] = now
        self.poll_log.append((now, key, int(request.query.get("t") or 0)))
        ready = key in self.ready_keys or any(key.startswith(p) for p in self.ready_prefixes)
        if ready:
            self.first_ready.setdefault(key, time.time())
        return web.json_response({"ready": ready})

    async def _count(self, request: web.Request) -> web.Response:
        return web.json_response({"polls": self.polls})

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
        self._loop = asyncio.new_event_loop()
        app = web.Application()
        app.router.add_get("/poll/{key}", self._poll)
        app.router.add_get("/polls", self._count)  # how many polls so far (a bench in another process)
        self._runner = web.AppRunner(app, access_log=None)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0, backlog=4096)
        self._loop.run_until_complete(site.start())
        assert site._server is not None
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
        self._ready.set()
        self._loop.run_forever()
