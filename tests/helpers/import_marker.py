"""A trigger whose module records every process that imports it (``SMART_TRIGGERER_IMPORT_MARKER``).

The supervisor holds the metadata database and must never import trigger code (DAG authors' code): only
the runner subprocess may.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from triggers.identity import DedupableTrigger

_MARKER = os.environ.get("SMART_TRIGGERER_IMPORT_MARKER")
if _MARKER:
    with open(_MARKER, "a") as marker:
        marker.write(f"{os.getpid()}\n")


class MarkerTrigger(DedupableTrigger, BaseTrigger):
    identity_kwargs = ("key",)

    def __init__(self, key: str) -> None:
        super().__init__()
        self.key = key

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{__name__}.MarkerTrigger", {"key": self.key})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        while True:
            await asyncio.sleep(3600)
        yield  # pragma: no cover
