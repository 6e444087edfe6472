"""The relay: deployment A's outbox -> each target's inbox, in order, exactly once on the target's side.

- Wakes on ``LISTEN dataset_bridge_outbox`` (the outbox notifies on commit), polls as the safety net.
- Per target: pending rows go in outbox order, in batches; a target whose head batch fails waits (retries
  with exponential backoff and full jitter) so a later event never overtakes an earlier one. Nothing past
  an outbox id whose transaction may still commit is sent (``horizon.py``): a lower id that commits late
  goes first, never after. Whether a row is due is the database's clock's say, never the relay host's.
  Targets are delivered concurrently, at most ``concurrency`` at a time.
- After ``max_attempts`` failed attempts of its own a row is dead-lettered (``status = 'dead'``) with its
  last error, and the target moves on. An event the inbox refuses for good (unknown asset) is dead-lettered
  at once. A batch the inbox finds too large (413) is sent in halves; a single event still too large is
  dead-lettered. A reply without a result for every event sent is a failure, never a delivery.
- A server error that is not an outage (a 5xx other than 502/503/504: B failing on what it was sent) splits
  the batch in halves, so the events before the one B fails on are delivered; that one alone counts its
  server errors and is dead-lettered at the target's ``max_server_errors``, with the error B's answer gives
  (secrets masked). Connection errors, timeouts, 502-504, 408 and 429 never count toward that bound, and
  neither does a 401 whose ``reason`` is ``clock_skew`` (this host's clock is off by more than the inbox's
  window): it is retried without end and logged as an error each time, never dead-lettered.
- A database error (PostgreSQL restarting) fails that pass only: the relay backs off, listens again and
  carries on from the outbox.
- All state is in the outbox table, so a relay that crashes resumes where it was: a batch delivered but
  not yet marked is delivered again, and the inbox's (source, event id) key makes that harmless.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import random
import re
import ssl
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import asyncpg
import structlog

from dataset_bridge import signing
from dataset_bridge.horizon import Horizon
from dataset_bridge.outbox import CHANNEL
from dataset_bridge.retention import DEFAULT as DEFAULT_RETENTION
from dataset_bridge.retention import Retention
from dataset_bridge.routes import Routes, Target

log = structlog.get_logger(__name__)

# pending rows after id $3 up to the final id $4; due: the database's clock says it may be sent now
PENDING = """
SELECT id, asset_event_id, asset_uri, asset_name, extra, event_timestamp, attempts,
       next_attempt_at <= now() AS due
FROM dataset_bridge.outbox WHERE target = $1 AND status = 'pending' AND id > $3 AND id <= $4
ORDER BY id LIMIT $2
"""
# Only pending rows change: with two relays overlapping (a rolling deploy) one's late failure must not turn
# the other's delivery into a dead letter.
MARK_DELIVERED = """
UPDATE dataset_bridge.outbox SET status = 'delivered', delivered_at = now(), attempts = attempts + 1,
last_error = NULL WHERE id = ANY($1::bigint[]) AND status = 'pending'
"""
MARK_DEAD = """
UPDATE dataset_bridge.outbox SET status = 'dead', attempts = attempts + 1, last_error = $2
WHERE id = ANY($1::bigint[]) AND status = 'pending'
"""
# Each row counts its own attempts (rows join a batch at different times): a row that reached
# max_attempts ($4), or max_server_errors ($6) with this server error ($5: 1, else 0), is dead-lettered,
# the others wait for the retry.
MARK_RETRY = """
UPDATE dataset_bridge.outbox SET attempts = attempts + 1, last_error = $2,
next_attempt_at = now() + make_interval(secs => $3), server_errors = server_errors + $5,
status = CASE WHEN attempts + 1 >= $4 OR server_errors + $5 >= $6 THEN 'dead' ELSE status END
WHERE id = ANY($1::bigint[]) AND status = 'pending'
RETURNING id, status, attempts
"""
NEVER = 2**31 - 1  # a bound no row reaches


@dataclass(frozen=True)
class RelaySettings:
    batch: int = 1000
    concurrency: int = 4
    poll_seconds: float = 2.0
    backoff_base: float = 1.0
    backoff_cap: float = 60.0
    timeout_seconds: float = 30.0
    sweep_every: float = 10.0
    retention: Retention = DEFAULT_RETENTION
    prune_every: float = 600.0


# what a target that is down or overloaded answers (a proxy in front of a stopped api-server, B's database
# unreachable): retried without end
OUTAGE = (502, 503, 504)


class DeliveryError(Exception):
    """The target did not take the batch; ``permanent`` when retrying the same request cannot help.

    A refusal (a 4xx other than 408/429, a reply that is not the inbox's) counts toward a target's
    ``max_attempts``; a server error (a 5xx other than 502-504: B fails on what it was sent) toward its
    ``max_server_errors``. An unreachable or overloaded target (connection error, timeout, 502-504, 408,
    429) is retried without end, backing off, so that an outage of B never dead-letters A's events.
    """

    def __init__(
        self,
        message: str,
        *,
        permanent: bool = False,
        status: int | None = None,
        refusal: bool = False,
        clock_skew: bool = False,
    ) -> None:
        super().__init__(message)
        self.permanent = permanent
        self.status = status
        self.clock_skew = clock_skew  # the inbox refused our timestamp: fixed by a clock, not by the event
        self.refusal = not clock_skew and (
            refusal or (status is not None and 400 <= status < 500 and status not in (408, 429))
        )
        self.server_error = status is not None and status >= 500 and status not in OUTAGE


def backoff(attempts: int, base: float, cap: float) -> float:
    """Exponential backoff with full jitter: relays retrying one dead target do not retry in step."""
    return random.uniform(base / 2, min(cap, base * 2 ** min(attempts, 16)))  # noqa: S311 (not crypto)


def body_for(source: str, rows: Sequence[Any]) -> bytes:
    events = [
        {
            "id": row["asset_event_id"],
            "uri": row["asset_uri"],
            "name": row["asset_name"],
            "extra": json.loads(row["extra"]) if isinstance(row["extra"], str) else row["extra"],
            "timestamp": row["event_timestamp"].isoformat(),
        }
        for row in rows
    ]
    return json.dumps({"source": source, "events": events}).encode()


class Relay:
    def __init__(self, pool: asyncpg.Pool, routes: Routes, settings: RelaySettings) -> None:
        self.pool, self.routes, self.settings = pool, routes, settings
        self.wake = asyncio.Event()
        self.gate = asyncio.Semaphore(settings.concurrency)
        self.listener: _Listener | None = None
        self.last_sweep = self.last_prune = float("-inf")
        self.horizon = Horizon()

    async def final_id(self) -> int:
        """The outbox ids no open transaction can still commit below (read before any of this pass's
        marks: they too lock the outbox)."""
        async with self.pool.acquire() as conn:
            return await self.horizon.look(conn, "dataset_bridge.outbox")

    async def deliver_target(
        self, session: aiohttp.ClientSession, target: Target, final: int | None = None
    ) -> int:
        """Deliver what is due for one target, batch after batch, up to the ``final`` outbox id (read now
        when not given); returns rows delivered."""
        delivered, batch = 0, self.settings.batch
        final = await self.final_id() if final is None else final
        async with self.gate:
            rows = await self.pool.fetch(PENDING, target.name, batch, 0, final)
            # nothing due when the head of this target's queue is backing off
            while rows and rows[0]["due"]:
                # pipelined: the next batch is read while this one is on the wire (still sent after it)
                after = rows[-1]["id"]
                upcoming = (
                    asyncio.ensure_future(self.pool.fetch(PENDING, target.name, batch, after, final))
                    if len(rows) == batch
                    else None
                )
                sent = await self._send(session, target, rows)
                delivered += sent
                if upcoming is None:
                    return delivered
                if sent == len(rows):
                    rows = await upcoming
                else:  # some failed or were dead-lettered: start again from the head of the queue
                    await asyncio.gather(upcoming, return_exceptions=True)
                    rows = await self.pool.fetch(PENDING, target.name, batch, 0, final)
        return delivered

    async def _send(self, session: aiohttp.ClientSession, target: Target, rows: Sequence[Any]) -> int:
        ids = [row["id"] for row in rows]
        try:
            results = await self._post(session, target, body_for(self.routes.source, rows))
        except DeliveryError as err:
            if (err.status == 413 or err.server_error) and len(rows) > 1:
                # too large, or B fails on one of them: the events before that one still go
                return await self._split(session, target, rows, err)
            await self._failed(target, rows, err)
            return 0
        refused = {
            int(r["id"]): str(r.get("error", r.get("status")))
            for r in results
            if r.get("status") not in ("created", "duplicate")
        }
        by_event = {row["asset_event_id"]: row["id"] for row in rows}
        dead = [by_event[event_id] for event_id in refused if event_id in by_event]
        done = [i for i in ids if i not in dead]
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute(MARK_DELIVERED, done)
            for event_id, error in refused.items():
                if event_id in by_event:
                    await conn.execute(MARK_DEAD, [by_event[event_id]], f"refused by {target.name}: {error}")
        if dead:
            log.warning("events refused by the target, dead-lettered", target=target.name, events=len(dead))
        return len(done)

    async def _split(
        self, session: aiohttp.ClientSession, target: Target, rows: Sequence[Any], err: DeliveryError
    ) -> int:
        """The target refused the batch as too large, or failed on it: send it in halves, in order,
        stopping at a failure."""
        half = len(rows) // 2
        log.info(
            "batch not taken whole by the target; splitting",
            target=target.name,
            events=len(rows),
            status=err.status,
        )
        delivered = await self._send(session, target, rows[:half])
        if delivered < half:
            return delivered  # the first half is not through (backing off or dead): keep the order
        return delivered + await self._send(session, target, rows[half:])

    async def _post(
        self, session: aiohttp.ClientSession, target: Target, body: bytes
    ) -> list[dict[str, Any]]:
        secret = target.secret()
        headers = {"Content-Type": "application/json", **signing.sign(self.routes.source, secret, body)}
        tls = _tls_context(target.ca_file) if target.ca_file else True
        try:
            async with session.post(target.url, data=body, headers=headers, ssl=tls) as response:
                text = await response.text()
                if response.status >= 400:
                    # 4xx other than 408/429 will not change by retrying the same request as is, but the
                    # target's config might (a rotated secret): retry until max_attempts anyway
                    raise DeliveryError(
                        f"HTTP {response.status}: {answer_error(text, secret)}",
                        status=response.status,
                        clock_skew=response.status == 401 and answer_reason(text) == signing.CLOCK_SKEW,
                    )
                return _results(json.loads(text), body, response.status)
        except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as err:
            raise DeliveryError(f"{type(err).__name__}: {err}") from err

    async def _failed(self, target: Target, rows: Sequence[Any], err: DeliveryError) -> None:
        ids, error = [row["id"] for row in rows], str(err)
        if err.permanent or err.status == 413:
            await self.pool.execute(MARK_DEAD, ids, error)
            log.error("events dead-lettered", target=target.name, events=len(ids), error=error)
            return
        # the head row decides when the batch is tried again (later rows cannot overtake it)
        delay = backoff(rows[0]["attempts"] + 1, self.settings.backoff_base, self.settings.backoff_cap)
        # a transient failure never dead-letters
        limit = target.max_attempts if err.refusal else NEVER
        server_limit = target.max_server_errors if err.server_error else NEVER
        marked = await self.pool.fetch(
            MARK_RETRY, ids, error, delay, limit, int(err.server_error), server_limit
        )
        dead = [r["id"] for r in marked if r["status"] == "dead"]
        if dead:
            log.error(
                "events dead-lettered",
                target=target.name,
                events=len(dead),
                bound="max_server_errors" if err.server_error else "max_attempts",
                error=error,
            )
        if err.clock_skew:  # retried without end: said loudly, each time, until the clocks agree
            log.error(
                "the target refuses this host's clock; fix the clocks (NTP): delivery waits, nothing "
                "is dead-lettered",
                target=target.name,
                retry_in=round(delay, 1),
                error=error,
            )
        elif len(dead) < len(ids):
            log.warning(
                "delivery failed; backing off",
                target=target.name,
                attempt=rows[0]["attempts"] + 1,
                retry_in=round(delay, 1),
                error=error,
            )

    async def sweep(self) -> None:
        """Outbox rows for events made without one, and now and then the prune of delivered rows. Either
        failing is logged and tried again at the next sweep: delivery goes on regardless (a database that
        is away fails the delivery too, and the pass backs off)."""
        await _logged("outbox sweep", asyncio.to_thread(_sweep_blocking, self.routes))
        if time.monotonic() - self.last_prune >= self.settings.prune_every:
            self.last_prune = time.monotonic()
            await _logged("outbox prune", asyncio.to_thread(_prune_blocking, self.settings.retention))

    def notified(self, *args: object) -> None:
        self.wake.set()

    async def run(self, stop: asyncio.Event) -> None:
        timeout = aiohttp.ClientTimeout(total=self.settings.timeout_seconds)
        failures = 0
        try:
            async with aiohttp.ClientSession(timeout=timeout) as session:
                while not stop.is_set():
                    self.wake.clear()
                    try:
                        await self._pass(session)
                        failures = 0
                    except Exception as err:
                        # PostgreSQL restarting, a failover, a network blip: all state is in the outbox,
                        # so ride it out and carry on where the last committed mark left off
                        failures += 1
                        delay = backoff(failures, self.settings.backoff_base, 10.0)
                        log.warning(
                            "relay pass failed; retrying",
                            error=f"{type(err).__name__}: {err}",
                            attempt=failures,
                            retry_in=round(delay, 1),
                        )
                        await self._drop_listener()
                        await _wait_any(stop, asyncio.Event(), delay)
                        continue
                    await _wait_any(stop, self.wake, self.settings.poll_seconds)
        finally:
            await self._drop_listener()

    async def _pass(self, session: aiohttp.ClientSession) -> None:
        if self.listener is None or self.listener.closed():
            await self._drop_listener()
            self.listener = await _listen(self.pool, self.notified)
        if time.monotonic() - self.last_sweep >= self.settings.sweep_every:
            await self.sweep()
            self.last_sweep = time.monotonic()
        final = await self.final_id()
        outcomes = await asyncio.gather(
            *(self.deliver_target(session, target, final) for target in self.routes.targets),
            return_exceptions=True,
        )
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome

    async def _drop_listener(self) -> None:
        listener, self.listener = self.listener, None
        if listener is not None:
            await listener.close()


async def _logged(what: str, work: Awaitable[None]) -> None:
    try:
        await work
    except Exception as err:
        log.warning("relay step failed; trying again at the next sweep", step=what, error=_first_line(err))


def _first_line(err: BaseException) -> str:
    """The error's type and first line (SQLAlchemy's later lines hold the statement and its parameters)."""
    return f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"


@functools.cache
def _tls_context(ca_file: str) -> ssl.SSLContext:
    """One context per CA file for the relay's life (loading a CA for every batch is wasted work)."""
    return ssl.create_default_context(cafile=ca_file)


def _sweep_blocking(routes: Routes) -> None:
    from airflow.utils.session import create_session

    from dataset_bridge import outbox

    with create_session() as session:
        added = outbox.sweep(session, routes)
    if added:
        log.info("outbox rows added for events made without one", rows=added)


class _Listener:
    """A pool connection LISTENing on the outbox channel for as long as it lives."""

    def __init__(self, pool: asyncpg.Pool, conn: Any, callback: Any) -> None:
        self.pool, self.conn, self.callback = pool, conn, callback

    def closed(self) -> bool:
        try:
            return bool(self.conn.is_closed())
        except asyncpg.InterfaceError:
            return True  # the pool took the lost connection back already

    async def close(self) -> None:
        # Any error here means the connection is gone or broken (asyncpg raises InternalClientError on
        # one that read a restart's FATAL): the pool replaces it. Raising would end the relay's loop.
        with contextlib.suppress(Exception):
            if not self.closed():
                await self.conn.remove_listener(CHANNEL, self.callback)
        with contextlib.suppress(Exception):
            await self.pool.release(self.conn)


def _prune_blocking(retention: Retention) -> None:
    from airflow.utils.session import create_session

    from dataset_bridge import retention as pruning

    pruning.prune(create_session, ["dataset_bridge.outbox"], retention)


async def _listen(pool: asyncpg.Pool, callback: Any) -> _Listener:
    conn = await pool.acquire()
    try:
        await conn.add_listener(CHANNEL, callback)
        # a lost LISTEN connection (PostgreSQL restarting) wakes the relay, which listens again
        conn.add_termination_listener(lambda *_: callback())
    except BaseException:
        await pool.release(conn)
        raise
    return _Listener(pool, conn, callback)


_CREDENTIALS = (
    re.compile(r"(?P<keep>[a-z][a-z0-9+.-]*://[^/\s:@]*:)[^@\s]+(?=@)", re.IGNORECASE),  # scheme://user:***@
    re.compile(
        r"(?P<keep>\b(?:password|passwd|pwd|secret|token|api[_-]?key)\b\s*[=:]\s*)[^\s,;&)'\"]+",
        re.IGNORECASE,
    ),
)


def answer_error(text: str, secret: str, limit: int = 300) -> str:
    """What a failing target's answer says went wrong, for the log and the dead letter: its JSON
    ``detail`` (or ``error``) when it has one, else the text; one line, at most ``limit`` characters,
    with this target's secret and anything that looks like a credential masked."""
    try:
        reply = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        reply = None
    said = reply.get("detail", reply.get("error")) if isinstance(reply, dict) else None
    message = " ".join((said if isinstance(said, str) else text).split())
    if secret:
        message = message.replace(secret, "***")
    for pattern in _CREDENTIALS:
        message = pattern.sub(r"\g<keep>***", message)
    return message if len(message) <= limit else message[: limit - 3] + "..."


def answer_reason(text: str) -> str | None:
    """The ``reason`` of an inbox's refusal (``signing.CLOCK_SKEW`` ...), None for any other answer."""
    try:
        reply = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None
    reason = reply.get("reason") if isinstance(reply, dict) else None
    return reason if isinstance(reason, str) else None


def _results(reply: Any, body: bytes, status: int) -> list[dict[str, Any]]:
    """The per-event results of an inbox reply; DeliveryError when the reply does not account for every
    event sent (a proxy's page, a wrong URL answering 200): nothing is marked delivered on faith."""
    sent = {event["id"] for event in json.loads(body)["events"]}
    results = reply.get("results") if isinstance(reply, dict) else None
    if not isinstance(results, list) or not all(isinstance(r, dict) and "id" in r for r in results):
        raise DeliveryError(
            f"HTTP {status} without per-event results: not a dataset-bridge inbox?", refusal=True
        )
    answered = {r["id"] for r in results}
    if not sent <= answered:
        raise DeliveryError(
            f"HTTP {status}: the reply has no result for {len(sent - answered)} event(s)", refusal=True
        )
    return list(results)


async def _wait_any(stop: asyncio.Event, wake: asyncio.Event, seconds: float) -> None:
    waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(wake.wait())]
    try:
        await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waits:
            waiter.cancel()


def metadata_dsn() -> str:
    """Airflow's metadata database as a libpq DSN (asyncpg does not take SQLAlchemy URLs)."""
    from airflow.configuration import conf
    from sqlalchemy.engine import make_url

    url = make_url(conf.get("database", "sql_alchemy_conn"))
    return url.set(drivername="postgresql").render_as_string(hide_password=False)


def prepare(routes: Routes) -> None:
    from airflow.utils.session import create_session

    from dataset_bridge import outbox

    with create_session() as session:
        outbox.ensure_schema(session)
    with create_session() as session:
        outbox.register_targets(session, routes)


async def run_relay(routes: Routes, settings: RelaySettings, stop: asyncio.Event) -> int:
    for target in routes.targets:
        target.secret()  # fail at start, naming the variable, rather than at the first event
    await asyncio.to_thread(prepare, routes)
    # per target a read-ahead and a mark may overlap, plus the LISTEN connection
    pool = await asyncpg.create_pool(metadata_dsn(), min_size=1, max_size=2 * settings.concurrency + 2)
    log.info("relay running", source=routes.source, targets=[t.name for t in routes.targets])
    try:
        await Relay(pool, routes, settings).run(stop)
    finally:
        await pool.close()
    return 0


STATUS = """
SELECT target, count(*) FILTER (WHERE status = 'pending') AS backlog,
       count(*) FILTER (WHERE status = 'delivered') AS delivered,
       count(*) FILTER (WHERE status = 'dead') AS dead,
       min(next_attempt_at) FILTER (WHERE status = 'pending') AS next_attempt,
       (array_agg(last_error ORDER BY id DESC) FILTER (WHERE last_error IS NOT NULL))[1] AS last_error
FROM dataset_bridge.outbox GROUP BY target ORDER BY target
"""


async def relay_status() -> list[dict[str, Any]]:
    conn = await asyncpg.connect(metadata_dsn())
    try:
        if not await conn.fetchval("SELECT to_regclass('dataset_bridge.outbox') IS NOT NULL"):
            return []
        rows = await conn.fetch(STATUS)
    finally:
        await conn.close()
    return [
        {
            "target": r["target"],
            "backlog": r["backlog"],
            "delivered": r["delivered"],
            "dead": r["dead"],
            "next_attempt": r["next_attempt"].isoformat() if r["next_attempt"] else None,
            "last_error": r["last_error"],
        }
        for r in rows
    ]


# Dead letters back into the queue, from their first attempt: their ids are older than the pending rows,
# so the relay sends them first and per-target order is kept. A row without its extra (jsonb refused it)
# cannot be sent and stays dead.
REPLAY = """
UPDATE dataset_bridge.outbox SET status = 'pending', attempts = 0, server_errors = 0, next_attempt_at = now()
WHERE status = 'dead' AND target = ANY($1::text[]) AND extra IS NOT NULL RETURNING target
"""


async def replay_dead(conn: asyncpg.Connection, targets: Sequence[str]) -> dict[str, int]:
    """Requeue the dead letters of ``targets`` (after fixing what refused them); count per target."""
    rows = await conn.fetch(REPLAY, list(targets))
    await conn.execute("SELECT pg_notify($1, '')", CHANNEL)  # a running relay picks them up at once
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["target"]] = counts.get(row["target"], 0) + 1
    return counts


async def replay(targets: Sequence[str]) -> dict[str, int]:
    conn = await asyncpg.connect(metadata_dsn())
    try:
        if not await conn.fetchval("SELECT to_regclass('dataset_bridge.outbox') IS NOT NULL"):
            return {}
        await asyncio.to_thread(_ensure_schema)  # an outbox made by an earlier version gains its columns
        return await replay_dead(conn, targets)
    finally:
        await conn.close()


def _ensure_schema() -> None:
    from airflow.utils.session import create_session

    from dataset_bridge import outbox

    with create_session() as session:
        outbox.ensure_schema(session)
