"""Polling the metadata database from tests: bounded waits that fail with what was last seen."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

import psycopg2

T = TypeVar("T")


def rows(dsn: str, query: str, *params: object) -> list[tuple[Any, ...]]:
    with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
        cur.execute(query, params)
        result: list[tuple[Any, ...]] = cur.fetchall()
    conn.close()
    return result


def execute(dsn: str, statement: str, *params: object) -> None:
    """One statement, committed."""
    with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
        cur.execute(statement, params)
    conn.close()


def wait_for(
    probe: Callable[[], T], done: Callable[[T], bool], timeout: float, what: str, interval: float = 0.2
) -> T:
    deadline = time.monotonic() + timeout
    value = probe()
    while not done(value):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last value: {value!r}")
        time.sleep(interval)
        value = probe()
    return value


def ti_states(dsn: str, dag_id: str) -> dict[int, str]:
    return {
        r[0]: r[1] for r in rows(dsn, "SELECT map_index, state FROM task_instance WHERE dag_id = %s", dag_id)
    }


def lease_owners(dsn: str) -> dict[int, int | None]:
    return {
        r[0]: r[1]
        for r in rows(
            dsn,
            "SELECT shard, CASE WHEN expires_at > clock_timestamp() THEN owner_job_id END "
            "FROM smart_triggerer.shard_lease WHERE queues = '' ORDER BY shard",
        )
    }


def settled_owners(dsn: str, quiet: float = 10.0, timeout: float = 120.0) -> dict[int, int | None]:
    """The shard map once every shard has an owner and none has changed owner for ``quiet`` seconds."""
    deadline = time.monotonic() + timeout
    last, since = lease_owners(dsn), time.monotonic()
    while time.monotonic() - since < quiet or None in last.values():
        if time.monotonic() > deadline:
            raise AssertionError(f"shards still moving after {timeout:.0f}s: {last}")
        time.sleep(0.5)
        now = lease_owners(dsn)
        if now != last:
            last, since = now, time.monotonic()
    return last


def db_now(dsn: str) -> Any:
    """The database's clock (what the waits below compare with)."""
    return rows(dsn, "SELECT clock_timestamp()")[0][0]


def scheduler_looped_since(dsn: str, since: Any, timeout: float = 60) -> None:
    """Two scheduler heartbeats after ``since``: at least one whole scheduling loop ran after it (the
    scheduler heartbeats at the end of its loop)."""

    def heartbeat() -> Any:
        return rows(
            dsn, "SELECT max(latest_heartbeat) FROM job WHERE job_type = 'SchedulerJob' AND state = 'running'"
        )[0][0]

    first = wait_for(heartbeat, lambda hb: hb is not None and hb > since, timeout, "a scheduler heartbeat")
    wait_for(heartbeat, lambda hb: hb > first, timeout, "the scheduler's next heartbeat")


def queried_since(dsn: str, pids: list[int], since: Any) -> bool:
    """A session of these processes (matched by their TCP ports) began a statement after ``since``."""
    import psutil

    ports = []
    for pid in pids:
        try:
            ports += [c.laddr.port for c in psutil.Process(pid).net_connections(kind="tcp") if c.raddr]
        except psutil.NoSuchProcess:
            continue
    if not ports:
        return False
    return bool(
        rows(
            dsn,
            "SELECT count(*) FROM pg_stat_activity WHERE client_port = ANY(%s) AND query_start > %s",
            ports,
            since,
        )[0][0]
    )
