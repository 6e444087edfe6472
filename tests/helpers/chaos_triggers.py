"""Triggers of the chaos run whose event is what the HTTP source says, so the source can hand out an event
the database cannot store (a ``\\u0000`` in a string: PostgreSQL's jsonb refuses it).

``GET {url}/poll/{key}`` answers ``{"ready": bool, "event": {...}}``; the event is the payload yielded.
Importable by the triggerer processes the chaos run starts (PYTHONPATH = repo root).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from airflow.triggers.base import BaseEventTrigger, BaseTrigger, TriggerEvent

from triggers.http import shared_request
from triggers.identity import DedupableTrigger
from triggers.pg import shared_pool, target_for


async def poll_until_ready(url: str, key: str, poll_interval: float) -> dict[str, Any]:
    """The source's event for ``key``, once it is ready (connection errors: poll again)."""
    while True:
        try:
            async with shared_request("GET", f"{url}/poll/{key}") as response:
                answer = await response.json()
                if answer["ready"]:
                    event = answer.get("event")
                    return event if isinstance(event, dict) else {"key": key}
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(poll_interval)


class SourcePollTrigger(DedupableTrigger, BaseTrigger):
    """A task's wait: fires the source's event for ``key`` once it is ready."""

    identity_kwargs = ("url", "key")
    wait_description = "{key} ready at {url!p}"

    def __init__(self, url: str, key: str, poll_interval: float = 5.0) -> None:
        super().__init__()
        self.url, self.key, self.poll_interval = url, key, poll_interval

    def serialize(self) -> tuple[str, dict[str, Any]]:
        # the class's own name: a subclass (TeamSourcePollTrigger) serializes as itself
        return (
            f"{__name__}.{type(self).__name__}",
            {"url": self.url, "key": self.key, "poll_interval": self.poll_interval},
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        yield TriggerEvent(await poll_until_ready(self.url, self.key, self.poll_interval))


class TeamSourcePollTrigger(SourcePollTrigger):
    """``SourcePollTrigger`` whose event also says which team's environment ran it (``TEAM_MARK``, set in a
    team instance's environment; empty on an instance of no team). Identical waits of two teams have the
    same kwargs: a task resumed by another team's coroutine shows it in its payload."""

    async def run(self) -> AsyncIterator[TriggerEvent]:
        await poll_until_ready(self.url, self.key, self.poll_interval)
        yield TriggerEvent({"key": self.key, "ran_in": os.environ.get("TEAM_MARK", "")})


# The queue's message is deleted and its taking recorded in one statement: what was taken, by which
# instance process (PGAPPNAME, which the chaos run sets to the instance's name), when.
TAKE_SQL = """
WITH taken AS (DELETE FROM chaos.queue WHERE key = $1 RETURNING key, message)
INSERT INTO chaos.queue_taken (key, message, taker, at)
SELECT key, message, $2, clock_timestamp() FROM taken RETURNING message
"""


class QueueTakeTrigger(BaseTrigger):
    """A task's wait on a message its source hands out once (taken, it is gone: a queue). An event the
    triggerer dropped after this fired is lost for good, where a state-based trigger would fire again.
    Not deduplicable (each task takes its own message), so each wait runs alone, as in stock Airflow.

    The take is shielded from cancels (a handover ends the coroutine, and its cancel is sent again with
    every answer until the coroutine has ended): the take runs to its end, however many cancels come
    meanwhile, and its message is yielded before the cancel is honoured, so no cancel can come between the
    message leaving the queue and the event leaving the coroutine. That is how a trigger of a consuming
    source must be written; what the triggerer then does with the event is what the chaos run checks. A
    message taken stays ``TAKE_REPLY_SECONDS`` in the take (a slow reply), so that takes are in flight
    when an instance is stopped: the window a cancel must not fall into is wide."""

    def __init__(self, conn_id: str, key: str, poll_interval: float = 1.0) -> None:
        super().__init__()
        self.conn_id, self.key, self.poll_interval = conn_id, key, poll_interval

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{__name__}.QueueTakeTrigger",
            {"conn_id": self.conn_id, "key": self.key, "poll_interval": self.poll_interval},
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        # the connection is looked up before any take: a cancel there takes nothing
        pool = await shared_pool(await target_for(self.conn_id, patience=5.0))
        while True:
            take = asyncio.ensure_future(_take(pool, self.key))
            try:
                message = await asyncio.shield(take)
            except asyncio.CancelledError:
                message = await _ended(take)
                if message is not None:
                    yield TriggerEvent({"key": self.key, "message": message})
                raise
            except Exception:  # the source unreachable for a while: try again at the next poll
                message = None
            if message is not None:
                yield TriggerEvent({"key": self.key, "message": message})
                return
            await asyncio.sleep(self.poll_interval)


TAKE_REPLY_SECONDS = 0.3


async def _take(pool: Any, key: str) -> str | None:
    taken: str | None = await pool.fetchval(TAKE_SQL, key, os.environ.get("PGAPPNAME", ""))
    if taken is not None:
        await asyncio.sleep(TAKE_REPLY_SECONDS)
    return taken


async def _ended(take: asyncio.Future[str | None]) -> str | None:
    """The take's message once it has ended (None if it failed), shielded from every further cancel."""
    while True:
        try:
            return await asyncio.shield(take)
        except asyncio.CancelledError:
            continue  # another cancel of the coroutine, not of the take: it runs on
        except Exception:
            return None


class SourceWatchTrigger(BaseEventTrigger):
    """An asset watcher: one asset event, the source's for ``key`` (its ``idempotency_key`` keeps it one
    across restarts of the watcher), then nothing more."""

    def __init__(self, url: str, key: str, poll_interval: float = 2.0) -> None:
        super().__init__()
        self.url, self.key, self.poll_interval = url, key, poll_interval

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{__name__}.SourceWatchTrigger",
            {"url": self.url, "key": self.key, "poll_interval": self.poll_interval},
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        yield TriggerEvent(await poll_until_ready(self.url, self.key, self.poll_interval))
        while True:  # a watcher runs for as long as its asset is watched
            await asyncio.sleep(3600)
