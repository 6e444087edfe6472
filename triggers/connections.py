"""Airflow connections looked up from a running trigger, patiently.

Airflow's lookup answers "The conn_id `x` isn't defined" (``AirflowNotFoundException``) both for a
conn_id that does not exist and for a lookup that failed: every secrets backend's error is swallowed,
including the triggerer asking its supervisor while the metadata database restarts or a migration locks
its ``connection`` table. A wait that started at that moment would fail its task for a database blip. So a
trigger tries the lookup again with backoff for ``CONNECTION_PATIENCE`` seconds before a missing
connection fails the task with Airflow's message (a worker-side check does not wait: its task would rather
fail now and retry).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import structlog

from triggers.pg import backoff_seconds

CONNECTION_PATIENCE = 60.0

log = structlog.get_logger(logger_name=__name__)


_lookups: dict[tuple[str, int], asyncio.Task[Any]] = {}


async def aget_connection(conn_id: str, *, patience: float = CONNECTION_PATIENCE) -> Any:
    """``BaseHook.aget_connection``, tried again on "isn't defined" for up to ``patience`` seconds.

    The waits of one runner that look up the same conn_id meanwhile share one lookup (each lookup is a
    request the triggerer's supervisor answers from the metadata database, on the loop that renews its
    leases: thousands of waits starting in an outage must not each ask every few seconds). A wait that
    joins a lookup late shares its outcome: the connection has been missing for ``patience`` seconds.
    """
    if patience <= 0:
        from airflow.sdk import BaseHook

        return await BaseHook.aget_connection(conn_id)
    loop = asyncio.get_running_loop()
    key = (conn_id, id(loop))
    lookup = _lookups.get(key)
    if lookup is None:
        lookup = loop.create_task(_patiently(conn_id, patience))
        _lookups[key] = lookup
        lookup.add_done_callback(lambda done: _forget(key, done))
    # shielded: a wait cancelled meanwhile (its task cleared) leaves the lookup to the others
    return await asyncio.shield(lookup)


def _forget(key: tuple[str, int], done: asyncio.Task[Any]) -> None:
    if _lookups.get(key) is done:
        del _lookups[key]
    if not done.cancelled():
        done.exception()  # retrieved: its waits may all have been cancelled


async def _patiently(conn_id: str, patience: float) -> Any:
    from airflow.sdk import BaseHook
    from airflow.sdk.exceptions import AirflowNotFoundException

    deadline = time.monotonic() + patience
    attempt = 0
    while True:
        try:
            return await BaseHook.aget_connection(conn_id)
        except AirflowNotFoundException:
            attempt += 1
            delay = min(backoff_seconds(attempt, base=0.5, cap=10.0), deadline - time.monotonic())
            if delay <= 0:
                raise
            if attempt == 1:  # the conn_id, never its values
                log.warning(
                    "connection not found; looking it up again before failing the wait",
                    conn_id=conn_id,
                    for_seconds=round(patience),
                )
            await asyncio.sleep(delay)


async def aextra_dejson(conn: Any) -> dict[str, Any]:
    """The connection's extra as a dict, its values registered for masking with ``await``: Airflow's
    ``extra_dejson`` tells the supervisor with a sync call, which from a coroutine without greenback's portal
    (our triggers run without one) fails, and the failure is swallowed: the supervisor would not mask the
    extra's values one by one. Airflow's own ``aextra_dejson`` where it has one (task SDK 1.3.2 on)."""
    if hasattr(conn, "aextra_dejson"):
        return dict(await conn.aextra_dejson() or {})
    import json

    from airflow.sdk.log import amask_secret

    if not conn.extra:
        return {}
    try:
        extra = json.loads(conn.extra)
    except json.JSONDecodeError:
        log.exception("Failed to deserialize extra property `extra`, returning empty dictionary")
        return {}
    await amask_secret(extra)
    return dict(extra or {})
