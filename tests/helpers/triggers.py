"""Triggers for tests, importable by the triggerer processes a test starts (PYTHONPATH = repo root)."""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import AsyncIterator
from typing import Any, ClassVar

from airflow.triggers.base import BaseTrigger, TriggerEvent

from triggers.identity import DedupableTrigger


class AtTimeTrigger(DedupableTrigger, BaseTrigger):
    """Fires at ``moment`` (what is waited on); polls every ``poll_interval`` seconds (how)."""

    identity_kwargs = ("moment",)
    wait_description = "the time {moment}"

    def __init__(self, moment: str, poll_interval: float = 0.2) -> None:
        super().__init__()
        self.moment = moment
        self.poll_interval = poll_interval

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{__name__}.AtTimeTrigger", {"moment": self.moment, "poll_interval": self.poll_interval})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        target = dt.datetime.fromisoformat(self.moment)
        while dt.datetime.now(dt.UTC) < target:
            await asyncio.sleep(self.poll_interval)
        yield TriggerEvent({"moment": self.moment, "status": "success"})


class FlagFileTrigger(DedupableTrigger, BaseTrigger):
    """Fires once the file ``flag`` exists (the test says when); ``key`` tells its waits apart."""

    identity_kwargs = ("key", "flag")

    def __init__(self, key: str, flag: str, poll_interval: float = 0.5) -> None:
        super().__init__()
        self.key = key
        self.flag = flag
        self.poll_interval = poll_interval

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{__name__}.FlagFileTrigger",
            {"key": self.key, "flag": self.flag, "poll_interval": self.poll_interval},
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        from pathlib import Path

        while not Path(self.flag).exists():
            await asyncio.sleep(self.poll_interval)
        yield TriggerEvent({"key": self.key, "status": "success"})


class FailingTrigger(DedupableTrigger, BaseTrigger):
    """Raises after ``delay`` seconds: the source is unreachable."""

    identity_kwargs = ("target",)

    def __init__(self, target: str, delay: float = 0.5) -> None:
        super().__init__()
        self.target = target
        self.delay = delay

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{__name__}.FailingTrigger", {"target": self.target, "delay": self.delay})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        await asyncio.sleep(self.delay)
        raise RuntimeError(f"boom: {self.target} is unreachable")
        yield  # pragma: no cover - makes this an async generator


class KillMarkerTrigger(DedupableTrigger, BaseTrigger):
    """Waits forever; ``on_kill`` (a user action in Airflow's eyes) writes a marker file."""

    identity_kwargs: ClassVar[tuple[str, ...]] = ("key",)

    def __init__(self, key: str, marker_dir: str) -> None:
        super().__init__()
        self.key = key
        self.marker_dir = marker_dir

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{__name__}.{type(self).__name__}", {"key": self.key, "marker_dir": self.marker_dir})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        while True:
            await asyncio.sleep(3600)
        yield  # pragma: no cover

    async def on_kill(self) -> None:
        from pathlib import Path

        Path(self.marker_dir, f"on_kill-{self.key}-{self.trigger_id}").write_text("killed")


class LoneKillMarkerTrigger(KillMarkerTrigger):
    """The same, but it declares no identity: every task runs its own coroutine, as in stock Airflow."""

    identity_kwargs = ()


# the queue ConsumeOnceTrigger takes its messages from, and the trail of its coroutines' starts
CONSUME_DDL = """
CREATE TABLE consumable (key text PRIMARY KEY, payload text NOT NULL);
CREATE TABLE consume_start (key text NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp());
"""


class ConsumeOnceTrigger(DedupableTrigger, BaseTrigger):
    """Takes the message for ``key`` from the queue table ``consumable`` and fires with it: its source hands
    a message out once (taken, it is gone), so an event dropped after it fired is lost for good. Each
    start of its coroutine is written to ``consume_start``."""

    identity_kwargs = ("dsn", "key")

    def __init__(self, dsn: str, key: str, poll_interval: float = 0.2) -> None:
        super().__init__()
        self.dsn = dsn
        self.key = key
        self.poll_interval = poll_interval

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{__name__}.ConsumeOnceTrigger",
            {"dsn": self.dsn, "key": self.key, "poll_interval": self.poll_interval},
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        import asyncpg

        conn = await asyncpg.connect(self.dsn)
        try:
            await conn.execute("INSERT INTO consume_start (key) VALUES ($1)", self.key)
            while True:
                taken = await conn.fetchval(
                    "DELETE FROM consumable WHERE key = $1 RETURNING payload", self.key
                )
                if taken is not None:
                    # yielded before any other await: a cancel (a handover, a stop) can no longer come
                    # between the take and the event, as a trigger of a consuming source must be written
                    yield TriggerEvent({"key": self.key, "payload": taken})
                    return
                await asyncio.sleep(self.poll_interval)
        finally:
            conn.terminate()  # no round trip: the event is out already


# PollTrailTrigger's trail of polls (which process polled which key, when) and what releases its waits
POLL_TRAIL_DDL = """
CREATE TABLE poll_trail (key text NOT NULL, pid int NOT NULL,
                         at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE TABLE poll_release (key text PRIMARY KEY);
"""


class PollTrailTrigger(DedupableTrigger, BaseTrigger):
    """Writes each poll to ``poll_trail`` (key, the runner's pid) and fires once ``poll_release`` holds its
    key. With ``block_flag``: once that file exists, the first coroutine to see it (the file
    ``<block_flag>.taken`` made exclusively; it holds the runner's pid) blocks its whole event loop with
    ``time.sleep`` until the file ``<block_flag>.end`` exists, as a trigger calling a blocking client with
    no timeout does."""

    identity_kwargs = ("dsn", "key")

    def __init__(self, dsn: str, key: str, block_flag: str = "", poll_interval: float = 0.5) -> None:
        super().__init__()
        self.dsn = dsn
        self.key = key
        self.block_flag = block_flag
        self.poll_interval = poll_interval

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{__name__}.PollTrailTrigger",
            {
                "dsn": self.dsn,
                "key": self.key,
                "block_flag": self.block_flag,
                "poll_interval": self.poll_interval,
            },
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        import os

        import asyncpg

        conn = await asyncpg.connect(self.dsn)
        try:
            while True:
                await conn.execute("INSERT INTO poll_trail (key, pid) VALUES ($1, $2)", self.key, os.getpid())
                if await conn.fetchval("SELECT 1 FROM poll_release WHERE key = $1", self.key):
                    break
                self._block_once()
                await asyncio.sleep(self.poll_interval)
        finally:
            await conn.close()
        yield TriggerEvent({"key": self.key, "status": "released"})

    def _block_once(self) -> None:
        import os
        import time
        from pathlib import Path

        if not self.block_flag or not Path(self.block_flag).exists():
            return
        try:
            taken = os.open(f"{self.block_flag}.taken", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return
        os.write(taken, str(os.getpid()).encode())
        os.close(taken)
        while not Path(f"{self.block_flag}.end").exists():
            time.sleep(0.1)  # the whole event loop waits here


class TeamMarkTrigger(DedupableTrigger, BaseTrigger):
    """Fires at ``moment`` with the ``TEAM_MARK`` of the environment it ran in: a team's triggerer runs
    its trigger code in that team's environment, so each task's payload tells where its wait ran."""

    identity_kwargs = ("moment",)

    def __init__(self, moment: str, poll_interval: float = 0.2) -> None:
        super().__init__()
        self.moment = moment
        self.poll_interval = poll_interval

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{__name__}.TeamMarkTrigger", {"moment": self.moment, "poll_interval": self.poll_interval})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        import os

        target = dt.datetime.fromisoformat(self.moment)
        while dt.datetime.now(dt.UTC) < target:
            await asyncio.sleep(self.poll_interval)
        yield TriggerEvent({"moment": self.moment, "ran_in": os.environ.get("TEAM_MARK")})
