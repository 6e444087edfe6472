"""PostgreSQL for triggers: one asyncpg pool per connection and event loop, one LISTEN connection per
source and event loop, error classes.

Thousands of waiting triggers run in one triggerer process; they must share connections. A pool is keyed
by a digest of the connection's parameters (never by Python's ``hash()``, never logged) and by the event
loop it belongs to (asyncpg pools are loop-bound; the worker-side check runs its own short loop).
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import asyncpg

POOL_MAX_SIZE = 5
LISTEN_TIMEOUT = 10.0  # seconds to connect and LISTEN before a hint is given up until the next check
# the listeners' application_name: a source's DBA sees which sessions are ours (pg_stat_activity)
LISTENER_NAME = "smart-triggerer listener"
LISTEN_GRACE_SECONDS = 5.0  # a channel nobody listens on is unlistened after this; a source's connection too


@dataclass(frozen=True)
class PgTarget:
    """Where to connect; built from an Airflow connection (password included, so never logged)."""

    host: str
    port: int
    user: str | None
    password: str | None
    database: str | None
    ssl: str | None = None

    def __repr__(self) -> str:  # keep the password out of any accidental log line
        return f"PgTarget(host={self.host!r}, port={self.port}, database={self.database!r})"

    @property
    def key(self) -> str:
        fields = (self.host, self.port, self.user, self.password, self.database, self.ssl)
        raw = "\0".join(str(v) for v in fields)
        return hashlib.sha256(raw.encode()).hexdigest()

    def connect_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "host": self.host,
            "port": self.port,
            "user": self.user,
            "password": self.password,
            "database": self.database,
        }
        if self.ssl:
            kwargs["ssl"] = self.ssl
        return kwargs


class SourceError(Exception):
    """The source rejected the check itself (bad SQL, missing table or column): retrying cannot help."""


T = TypeVar("T")


async def read_only(source: asyncpg.Connection | asyncpg.Pool, reads: Callable[[Any], Awaitable[T]]) -> T:
    """Run a sensor's reads in a READ ONLY transaction of their own: a check is a read, and a statement
    that writes (a data-modifying CTE, a function with side effects) fails instead of changing data.
    BEGIN READ ONLY also holds against SQL that turns ``default_transaction_read_only`` off."""
    if isinstance(source, asyncpg.Pool):
        async with source.acquire() as conn, conn.transaction(readonly=True):
            return await reads(conn)
    async with source.transaction(readonly=True):
        return await reads(source)


# Can this login change anything in the tables it sees? (superuser, or any write privilege on a table in
# its search path.) For connections to Airflow's own metadata database, which DAG code must only read.
WRITABLE_ROLE_SQL = """
SELECT (SELECT rolsuper FROM pg_roles WHERE rolname = current_user)
    OR EXISTS (SELECT 1 FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
               WHERE c.relkind IN ('r', 'p') AND n.nspname = ANY(current_schemas(false))
                 AND has_table_privilege(c.oid, 'INSERT, UPDATE, DELETE, TRUNCATE'))
"""


async def refuse_writable_role(conn: asyncpg.Connection | asyncpg.Pool, conn_id: str) -> None:
    """SourceError when ``conn_id`` logs in as a role that can write: a metadata-DB connection that DAG
    code may use must be read-only (docs/guides/sensors.md, "Metadata-DB sensors: a
    read-only role for airflow_db")."""
    if await conn.fetchval(WRITABLE_ROLE_SQL):
        raise SourceError(
            f"connection {conn_id!r} logs in as a role that can write to Airflow's metadata "
            "database; give it a read-only role (docs/guides/sensors.md, "
            "'Metadata-DB sensors: a read-only role for airflow_db')"
        )


async def target_for(conn_id: str, *, patience: float = 0.0) -> PgTarget:
    """Resolve an Airflow connection (works in the triggerer, in workers and in plain processes); a
    trigger passes ``patience`` (triggers/connections.py: a failed lookup looks like a missing one)."""
    from triggers.connections import aextra_dejson, aget_connection

    conn = await aget_connection(conn_id, patience=patience)
    extra = await aextra_dejson(conn)
    return PgTarget(
        host=conn.host or "localhost",
        port=int(conn.port or 5432),
        user=conn.login,
        password=conn.password,
        database=conn.schema or None,
        ssl=extra.get("sslmode"),
    )


_pools: dict[tuple[str, int], asyncpg.Pool] = {}
_pool_locks: dict[tuple[str, int], asyncio.Lock] = {}


async def shared_pool(target: PgTarget, max_size: int = POOL_MAX_SIZE) -> asyncpg.Pool:
    """The process-wide pool for this target on the running loop (created on first use)."""
    key = (target.key, id(asyncio.get_running_loop()))
    lock = _pool_locks.setdefault(key, asyncio.Lock())
    async with lock:
        pool = _pools.get(key)
        if pool is None or pool.is_closing():
            pool = await asyncpg.create_pool(min_size=0, max_size=max_size, **target.connect_kwargs())
            _pools[key] = pool
        return pool


def is_permanent(exc: BaseException) -> bool:
    """Errors in the check itself (SQL, schema, privileges); everything else is worth retrying."""
    permanent = (
        asyncpg.PostgresSyntaxError,
        asyncpg.UndefinedTableError,
        asyncpg.UndefinedColumnError,
        asyncpg.InsufficientPrivilegeError,
        asyncpg.DataError,
        asyncpg.InvalidCatalogNameError,
        asyncpg.InvalidPasswordError,
        asyncpg.InvalidAuthorizationSpecificationError,
        asyncpg.ReadOnlySQLTransactionError,  # a check that writes: it will write on every retry too
        asyncpg.InvalidTransactionStateError,  # a check that changes its transaction's mode: likewise
    )
    # but the source's own limits on a transaction (idle in it, or open, too long: a stalled triggerer)
    # and a transaction an earlier error aborted say nothing of the check: worth another try
    timed_out = (
        asyncpg.IdleInTransactionSessionTimeoutError,
        asyncpg.TransactionTimeoutError,
        asyncpg.InFailedSQLTransactionError,
    )
    return isinstance(exc, (*permanent, SourceError)) and not isinstance(exc, timed_out)


def backoff_seconds(attempt: int, base: float = 1.0, cap: float = 60.0) -> float:
    """Exponential backoff with full jitter (so a thousand waiters do not retry in step)."""
    return random.uniform(0, min(cap, base * 2 ** min(attempt, 16)))  # noqa: S311 (not cryptographic)


class SourceListener:
    """One LISTEN connection per source and event loop, for every channel any wait of that loop listens on.

    A notification is a hint that wakes the waiters at once; polling stays the source of truth, so a lost
    notification or a dropped listener costs at most one poll interval. The source is the ETL's own
    database: a runner that serves channels per table must not hold a connection per channel (that
    exhausts its ``max_connections``), nor keep one for channels nobody listens on any more. A channel
    whose last subscriber left is unlistened, and the connection closed once no channel is left, after
    ``LISTEN_GRACE_SECONDS`` (a group restarting, a wait deferring again, finds it still open).
    """

    def __init__(self, target: PgTarget, on_closed: Callable[[], None] | None = None) -> None:
        self.target = target
        self.subscribers: dict[str, set[asyncio.Event]] = {}
        self.conn: asyncpg.Connection | None = None
        self.listening: set[str] = set()  # channels LISTENed on ``conn``
        self.lock = asyncio.Lock()
        self.on_closed = on_closed
        self._tidy_at: asyncio.TimerHandle | None = None
        self._tidying: set[asyncio.Task[None]] = set()

    def _notified(self, _conn: object, _pid: int, channel: str, _payload: object) -> None:
        for event in list(self.subscribers.get(channel, ())):
            event.set()

    def _lost(self, *args: object) -> None:
        self.conn, self.listening = None, set()

    async def ensure(self, channel: str) -> bool:
        """Listening on ``channel`` now? A listener is only a hint, so no error of its own may end a wait:
        besides PostgreSQL's refusals and network errors, asyncpg raises client-side errors on a
        connection the server is terminating (``InternalClientError: cannot switch to state 12`` while a
        PostgreSQL restart's FATAL is being read). Any failure leaves no connection behind and is tried
        again at the next check."""
        async with self.lock:
            if self.conn is not None and self.conn.is_closed():
                self._lost()
            try:
                # bounded: every wait on the source arms it (under the lock) before its check, so a
                # source that accepts and then says nothing must not hold them all
                if self.conn is None:
                    conn = await asyncpg.connect(
                        **self.target.connect_kwargs(),
                        timeout=LISTEN_TIMEOUT,
                        server_settings={"application_name": LISTENER_NAME},
                    )
                    conn.add_termination_listener(self._lost)
                    self.conn, self.listening = conn, set()
                if channel not in self.listening:
                    await asyncio.wait_for(self.conn.add_listener(channel, self._notified), LISTEN_TIMEOUT)
                    self.listening.add(channel)
            except BaseException as err:
                self._terminate()  # also when cancelled half-way: no connection left behind
                if not isinstance(err, Exception):
                    raise
                return False
            return True

    def subscribe(self, channel: str, event: asyncio.Event) -> None:
        self.subscribers.setdefault(channel, set()).add(event)

    def unsubscribe(self, channel: str, event: asyncio.Event) -> None:
        events = self.subscribers.get(channel)
        if events is None:
            return
        events.discard(event)
        if not events:
            del self.subscribers[channel]
            if self._tidy_at is None:
                self._tidy_at = asyncio.get_running_loop().call_later(LISTEN_GRACE_SECONDS, self._tidy_soon)

    def _tidy_soon(self) -> None:
        self._tidy_at = None
        task = asyncio.get_running_loop().create_task(self.tidy())
        self._tidying.add(task)
        task.add_done_callback(self._tidying.discard)

    async def tidy(self) -> None:
        """Unlisten the channels nobody subscribes to; close the connection once none is left."""
        async with self.lock:
            if self.conn is None:
                if not self.subscribers and self.on_closed is not None:
                    self.on_closed()
                return
            if not self.subscribers:
                conn, self.conn, self.listening = self.conn, None, set()
                try:
                    await asyncio.wait_for(conn.close(), LISTEN_TIMEOUT)
                except Exception:  # a hint only: a connection that does not close politely is cut
                    conn.terminate()
                if self.on_closed is not None:
                    self.on_closed()
                return
            for channel in self.listening - self.subscribers.keys():
                try:
                    await asyncio.wait_for(self.conn.remove_listener(channel, self._notified), LISTEN_TIMEOUT)
                except Exception:
                    self._terminate()  # the next arm of a remaining channel listens afresh
                    return
                self.listening.discard(channel)

    def _terminate(self) -> None:
        if self.conn is not None:
            self.conn.terminate()
        self.conn, self.listening = None, set()


class ChannelListener:
    """One channel of a source's shared listener: what a wait subscribes to and arms before each check."""

    def __init__(self, target: PgTarget, channel: str, source: SourceListener | None = None) -> None:
        self.target, self.channel = target, channel
        self.source = source or SourceListener(target)

    @property
    def conn(self) -> asyncpg.Connection | None:
        return self.source.conn

    async def ensure(self) -> bool:
        return await self.source.ensure(self.channel)

    @contextmanager
    def subscription(self, event: asyncio.Event | None = None) -> Iterator[asyncio.Event]:
        event = event or asyncio.Event()
        self.source.subscribe(self.channel, event)
        try:
            yield event
        finally:
            self.source.unsubscribe(self.channel, event)


_sources: dict[tuple[str, int], SourceListener] = {}


def shared_listener(target: PgTarget, channel: str) -> ChannelListener:
    """``channel`` on the one listening connection of ``target`` in this event loop."""
    key = (target.key, id(asyncio.get_running_loop()))
    source = _sources.get(key)
    if source is None:
        source = _sources[key] = SourceListener(target, on_closed=lambda: _forget_source(key, source))
    return ChannelListener(target, channel, source)


def _forget_source(key: tuple[str, int], source: SourceListener | None) -> None:
    """A closed listener leaves the registry (its lock is bound to its loop; a later loop makes its own)."""
    if _sources.get(key) is source and not (source and source.subscribers):
        _sources.pop(key, None)


async def wait_or_hint(hint: asyncio.Event | None, seconds: float) -> bool:
    """Sleep up to ``seconds``; return early (True) when the hint is set. The caller clears it before
    each check, so a notification that arrives during a check is not lost."""
    if hint is None:
        await asyncio.sleep(seconds)
        return False
    try:
        await asyncio.wait_for(hint.wait(), seconds)
    except TimeoutError:
        return False
    return True
