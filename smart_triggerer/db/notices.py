"""Membership notices: an instance that joins, stops or hands shards over says so at once (PostgreSQL's
NOTIFY, sent when its transaction commits), and every instance of its queue set that listens renews its
leases right away instead of at its next loop.

Without them a graceful stop left its shards unowned for up to a loop (``loop_seconds``) until a peer's
next renewal, and a newcomer waited as long for the shards its peers handed over. The notices only move
a renewal earlier: the leases decide who owns what, and an instance that misses a notice (its listening
connection broke, a peer of an earlier release that never sends one) renews at its next loop as before.

The listening connection is one of its own (detached from Airflow's pool: a LISTEN lives as long as
its session), in autocommit, read from the supervisor's selector when the server sends something. It is
one more server connection per instance, and needs a session of its own: through PgBouncer in
transaction pooling it would hear nothing (connect the triggerers to PostgreSQL directly, as bounded.py
asks anyway).
"""

from __future__ import annotations

import contextlib
import functools
import os
import selectors
import time
from collections.abc import Callable
from typing import Any

import structlog

from smart_triggerer.db.errors import cause

log = structlog.get_logger(logger_name=__name__)

CHANNEL = "smart_triggerer_membership"
RETRY_SECONDS = 10.0  # a broken listening connection is opened again this often at most
IDLE_SESSION_TIMEOUT_FROM = 140000  # PostgreSQL 14 ends idle sessions when a role or database says so


def notice_payload(job_id: int, queues: str | None) -> str:
    """Who sent the notice, and for which queue set (disjoint sets own separate shards)."""
    return f"{job_id} {queues or ''}"


class MembershipNotices:
    """LISTEN on ``CHANNEL``; ``on_notice`` is called once per readable batch that holds a notice of a
    peer of the same queue set."""

    def __init__(self, job_id: int, queues: str | None, on_notice: Callable[[], None]) -> None:
        self.own = notice_payload(job_id, queues)
        self.queues = queues or ""
        self.on_notice = on_notice
        self.sock: _Socket | None = None
        self.selector: selectors.BaseSelector | None = None
        self.tried_at = -float("inf")
        self.failing = False  # the last attempt failed: said once, not every RETRY_SECONDS
        self.received = 0  # peers' notices, for tests and the log

    def attach(self, selector: selectors.BaseSelector) -> None:
        """Listen through ``selector`` (again, after the connection broke; at most every RETRY_SECONDS)."""
        if self.sock is not None or time.monotonic() - self.tried_at < RETRY_SECONDS:
            return
        self.tried_at = time.monotonic()
        try:
            conn = _listening_connection()
        except Exception as err:  # the database is away: renewals still run every loop
            (log.debug if self.failing else log.info)(
                "not listening for membership notices; trying again later",
                error=cause(err),
                retry_in=RETRY_SECONDS,
            )
            self.failing = True
            return
        if conn is None:
            return
        try:
            sock = _Socket(conn)
        except Exception:
            conn.close()
            raise
        try:
            selector.register(sock, selectors.EVENT_READ, (self._readable, self._closed))
        except Exception:
            sock.close()
            raise
        if self.failing:
            log.info("listening for membership notices again")
        self.sock, self.selector, self.failing = sock, selector, False

    @property
    def conn(self) -> Any:
        """The listening connection, None while not listening."""
        return None if self.sock is None else self.sock.conn

    def _readable(self, sock: _Socket) -> bool:
        """Read what the server sent; False (the connection is closed by the caller) when it broke."""
        conn = sock.conn
        try:
            conn.poll()
        except Exception as err:
            log.info("the membership notices' connection broke; listening again later", error=cause(err))
            return False
        peers = [n.payload for n in conn.notifies if self._from_a_peer(n.payload)]
        conn.notifies.clear()
        if peers:
            self.received += len(peers)
            log.info(
                "a peer joined, stopped or handed shards over: renewing the leases now",
                peers=sorted({p.split(" ", 1)[0] for p in peers}),
            )
            self.on_notice()
        return True

    def _from_a_peer(self, payload: str) -> bool:
        _, _, queues = payload.partition(" ")
        return payload != self.own and queues == self.queues

    def _closed(self, sock: _Socket) -> None:
        if self.selector is not None:
            with contextlib.suppress(KeyError, ValueError):  # the selector was closed at exit
                self.selector.unregister(sock)
        self.sock = self.selector = None

    def close(self) -> None:
        if (sock := self.sock) is not None:
            self._closed(sock)
            sock.close()


class _Socket:
    """The listening connection as the selector sees it: a duplicate of its descriptor, owned here.

    libpq closes the connection's own descriptor when the server ends the session, before the selector
    can let go of it; and the trigger runner, forked from the supervisor, may hold the same socket. epoll
    then kept the dead socket registered under a number the selector no longer knew (nothing ever removes
    it while another process holds the socket): it was readable for ever, and the loop spun at a whole
    core after any break of this connection (a restart, a terminated session). The duplicate stays open
    until the selector has let go of it, so unregistering always removes what was registered."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.fd = os.dup(int(conn.fileno()))
        self.closed = False

    def fileno(self) -> int:
        return self.fd

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.conn.close()
        finally:
            os.close(self.fd)


@functools.cache
def _say_unsupported(driver: str) -> None:
    log.info("membership notices need the psycopg2 driver; peers are noticed at each loop", driver=driver)


def _listening_connection() -> Any:
    """A connection of Airflow's metadata engine (with its connect settings), out of the pool, listening;
    None when the driver is not psycopg2 (only it is read this way; renewals then run every loop)."""
    from airflow import settings

    engine = settings.engine
    if engine is None:
        return None
    if engine.dialect.driver != "psycopg2":
        _say_unsupported(engine.dialect.driver)  # once
        return None
    pooled = engine.raw_connection()
    conn: Any = pooled.driver_connection
    pooled.detach()  # ours for as long as it listens; never handed back to the pool
    try:
        conn.rollback()  # nothing is open on a fresh connection; autocommit may only be set outside one
        conn.autocommit = True
        with conn.cursor() as cursor:
            if conn.server_version >= IDLE_SESSION_TIMEOUT_FROM:
                cursor.execute("SET idle_session_timeout = 0")  # it sits idle by design
            cursor.execute(f"LISTEN {CHANNEL}")
    except Exception:
        conn.close()
        raise
    return conn
