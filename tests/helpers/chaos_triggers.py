"""Triggers of the chaos run whose event is what the HTTP source says, so the source can hand out an event
the database cannot store (a ``\\u0000`` in a string: PostgreSQL's jsonb refuses it).

``GET {url}/poll/{key}`` answers ``{"ready": bool, "event": {...}}``; the event is the payload yielded.
Importable by the triggerer processes the chaos run starts (PYTHONPATH = repo root).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from airflow.triggers.base import BaseEventTrigger, BaseTrigger, TriggerEvent

from triggers.http import shared_request
from triggers.identity import DedupableTrigger


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
        return (f"{__name__}.SourcePollTrigger",
                {"url": self.url, "key": self.key, "poll_interval": self.poll_interval})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        yield TriggerEvent(await poll_until_ready(self.url, self.key, self.poll_interval))


class SourceWatchTrigger(BaseEventTrigger):
    """An asset watcher: one asset event, the source's for ``key`` (its ``idempotency_key`` keeps it one
    across restarts of the watcher), then nothing more."""

    def __init__(self, url: str, key: str, poll_interval: float = 2.0) -> None:
        super().__init__()
        self.url, self.key, self.poll_interval = url, key, poll_interval

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{__name__}.SourceWatchTrigger",
                {"url": self.url, "key": self.key, "poll_interval": self.poll_interval})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        yield TriggerEvent(await poll_until_ready(self.url, self.key, self.poll_interval))
        while True:  # a watcher runs for as long as its asset is watched
            await asyncio.sleep(3600)
