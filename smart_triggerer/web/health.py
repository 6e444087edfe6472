"""``GET /health`` and ``GET /metrics`` (Prometheus text), served by aiohttp in a thread.

They expose counts, never trigger kwargs. On 127.0.0.1 (the default) they need no authentication; on any
other address (Kubernetes probes, Prometheus) every request must carry ``Authorization: Bearer <token>``.
"""

from __future__ import annotations

import asyncio
import hmac
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from aiohttp import web

from smart_triggerer.config import is_loopback
from smart_triggerer.waker import leave_stop_signals_to_the_main_thread

log = structlog.get_logger(logger_name=__name__)

Snapshot = Callable[[], dict[str, Any]]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

METRICS = (
    ("smart_triggerer_waiters", "gauge", "Deferred waiters (trigger rows) this instance runs", "waiters"),
    ("smart_triggerer_groups", "gauge", "Running identity groups (one coroutine each)", "groups"),
    (
        "smart_triggerer_coroutines",
        "gauge",
        "Trigger coroutines running in the runner subprocess",
        "coroutines",
    ),
    ("smart_triggerer_shards_owned", "gauge", "Shards whose lease this instance holds", "shards_owned"),
    ("smart_triggerer_events_total", "counter", "Trigger events received from the runner", "events_total"),
    ("smart_triggerer_resumed_total", "counter", "Task instances resumed by an event", "resumed_total"),
    (
        "smart_triggerer_failures_total",
        "counter",
        "Task instances failed by a trigger failure",
        "failures_total",
    ),
    ("smart_triggerer_events_pending", "gauge", "Events received but not yet stored", "events_pending"),
    (
        "smart_triggerer_watchers_failing",
        "gauge",
        "Asset-watcher groups whose coroutine failed and has not stored an event since",
        "watchers_failing",
    ),
    (
        "smart_triggerer_watcher_restarts_total",
        "counter",
        "Asset-watcher coroutines started again after a failure",
        "watcher_restarts_total",
    ),
    (
        "smart_triggerer_capacity",
        "gauge",
        "Groups (coroutines) this instance may hold (--capacity)",
        "capacity",
    ),
    (
        "smart_triggerer_loop_lag_p99_ms",
        "gauge",
        "The runner's event-loop lag, 99th percentile over the last minute (ms)",
        "lag_p99_ms",
    ),
    (
        "smart_triggerer_loop_lag_recent_p99_ms",
        "gauge",
        "The runner's event-loop lag, 99th percentile over the last 10 s (ms; what max_loop_lag_ms judges)",
        "lag_recent_ms",
    ),
    (
        "smart_triggerer_shards_taken_total",
        "counter",
        "Shards this instance took (start, takeover, placement)",
        "shards_taken_total",
    ),
    (
        "smart_triggerer_shards_handed_over_total",
        "counter",
        "Shards this instance handed over or dropped (placement, a lapse)",
        "shards_handed_over_total",
    ),
    ("smart_triggerer_rss_mb", "gauge", "Resident memory of the supervisor and its runner (MB)", "rss_mb"),
    (
        "smart_triggerer_accepting",
        "gauge",
        "1 while this instance takes new shards, 0 while it sheds (lag or memory over its limit)",
        "accepting",
    ),
    (
        "smart_triggerer_fleet_full",
        "gauge",
        "1 while every instance is at its capacity or limits (instances keep what they run)",
        "fleet_full",
    ),
    (
        "smart_triggerer_waiting_for_room",
        "gauge",
        "Identity groups this instance holds but does not run: it is at its capacity (they start, most "
        "urgent first, as room frees or an instance joins)",
        "waiting_for_room",
    ),
    (
        "smart_triggerer_task_state_requests_total",
        "counter",
        "Task-state questions the triggers asked Airflow (GetTaskStates, GetDRCount; coalesced: one per tick "
        "for the waits on one DAG run)",
        "task_state_requests_total",
    ),
    (
        "smart_triggerer_events_dead_total",
        "counter",
        "Asset-watcher events set aside (smart_triggerer.dead_event) after failing to be stored many times",
        "events_dead_total",
    ),
)


def render_metrics(snapshot: dict[str, Any]) -> str:
    lines = []
    job = snapshot.get("job_id", "")
    for name, kind, help_text, key in METRICS:
        lines += [
            f"# HELP {name} {help_text}",
            f"# TYPE {name} {kind}",
            f'{name}{{job_id="{job}"}} {int(snapshot.get(key, 0))}',
        ]
    return "\n".join(lines) + "\n"


def is_healthy(snapshot: dict[str, Any], lease_seconds: float) -> bool:
    """The runner lives and answers, the leases are renewed, and no event waits longer than a lease to be
    stored."""
    return (
        bool(snapshot.get("runner_alive"))
        and not snapshot.get("runner_stalled")
        and snapshot.get("lease_age", float("inf")) < lease_seconds
        and snapshot.get("events_stuck_seconds", 0.0) < lease_seconds
    )


class HealthServer:
    """Runs in a daemon thread; ``start()`` returns once the port is bound.

    ``token`` is required on a non-loopback ``host``: the endpoint is then reachable from the network.
    """

    def __init__(self, port: int, lease_seconds: float, host: str = "127.0.0.1", token: str = "") -> None:
        if not is_loopback(host) and not token:
            raise ValueError("a health endpoint on a non-loopback address needs a token")
        self.host, self.port, self.lease_seconds = host, port, lease_seconds
        self._expected = f"Bearer {token}".encode() if token else b""
        self.snapshot: Snapshot = dict
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._ready = threading.Event()
        self._bind_error: OSError | None = None
        self._thread = threading.Thread(target=self._serve, name="smart-triggerer-health", daemon=True)

    @property
    def url(self) -> str:
        host = self.host
        if host in ("0.0.0.0", "::"):  # noqa: S104 (naming the wildcard, not binding it)
            from airflow.utils.net import get_hostname

            host = get_hostname()  # every address: publish one others can reach
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}"

    @web.middleware
    async def _authenticate(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if self._expected:
            given = request.headers.get("Authorization", "").encode("utf-8", "replace")
            if not hmac.compare_digest(given, self._expected):
                return web.json_response(
                    {"error": "missing or wrong bearer token"},
                    status=401,
                    headers={"WWW-Authenticate": "Bearer"},
                )
        return await handler(request)

    def start(self) -> None:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError(f"health endpoint could not bind {self.host}:{self.port}")
        if self._bind_error is not None:
            from smart_triggerer.errors import UserError

            raise UserError(
                f"cannot serve the health endpoint on {self.host}:{self.port} "
                f"({self._bind_error.strerror or self._bind_error}): choose another "
                "--health-port / --health-host"
            ) from self._bind_error
        log.info("health endpoint listening", url=self.url)

    def stop(self) -> None:
        if self._loop is not None and self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(5)
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    async def _health(self, request: web.Request) -> web.Response:
        snapshot = self.snapshot()
        healthy = is_healthy(snapshot, self.lease_seconds)
        return web.json_response({"healthy": healthy, **snapshot}, status=200 if healthy else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=render_metrics(self.snapshot()), content_type="text/plain")

    def _serve(self) -> None:
        leave_stop_signals_to_the_main_thread()
        self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)
        app = web.Application(middlewares=[self._authenticate])
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, self.host, self.port)
        try:
            self._loop.run_until_complete(site.start())
        except OSError as err:  # port taken, address not on this host: reported by start()
            self._bind_error = err
            self._loop.run_until_complete(self._runner.cleanup())
            self._ready.set()
            return
        server = site._server
        if server is not None and self.port == 0:
            self.port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
        self._ready.set()
        self._loop.run_forever()
