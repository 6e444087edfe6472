"""The benchmark's trigger: polls an HTTP source that counts every request it receives."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from airflow.triggers.base import BaseTrigger, TriggerEvent

from triggers.http import shared_request
from triggers.identity import DedupableTrigger


class PollTrigger(DedupableTrigger, BaseTrigger):
    """Waits until ``GET {url}/poll/{key}`` answers ready; ``poll_interval`` is how, not what."""

    calls_sync_sdk = False  # connections and comms are asked with await: no greenback portal needed
    identity_kwargs = ("url", "key")
    wait_description = "{key} ready at {url!p}"

    def __init__(self, url: str, key: str, poll_interval: float = 5.0) -> None:
        super().__init__()
        self.url, self.key, self.poll_interval = url, key, poll_interval

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            "bench.triggers.PollTrigger",
            {"url": self.url, "key": self.key, "poll_interval": self.poll_interval},
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        while True:
            try:
                # the polling coroutine's trigger id (set by the runner) lets the bench tell who polled
                params = {"t": str(self.trigger_id or 0)}
                async with shared_request("GET", f"{self.url}/poll/{self.key}", params=params) as response:
                    if (await response.json())["ready"]:
                        yield TriggerEvent({"key": self.key})
                        return
            except aiohttp.ClientError:
                pass  # the source is down: poll again next interval
            await asyncio.sleep(self.poll_interval)
