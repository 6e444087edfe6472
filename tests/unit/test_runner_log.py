"""The runner's log lines per coroutine: Airflow's ``run_trigger`` under ``SmartTriggerRunner``'s logger."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import nullcontext
from typing import Any

import pytest
from airflow.triggers.base import BaseTrigger, TriggerEvent
from structlog.testing import capture_logs

from triggerer.runner import HANDOVER_CANCEL_MSG, SmartTriggerRunner

NAME = "test trigger"
STARTING = f"trigger {NAME} starting"


class _Trigger(BaseTrigger):
    """Fires ``events`` events, then returns; waits forever when ``forever``."""

    def __init__(self, events: int, forever: bool = False) -> None:
        super().__init__()
        self.events, self.forever = events, forever
        self.task_instance = None

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{__name__}._Trigger", {"events": self.events, "forever": self.forever})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        for n in range(self.events):
            yield TriggerEvent({"n": n})
        while self.forever:
            await asyncio.sleep(3600)


def _lines_of(trigger: _Trigger, *, cancel: bool = False) -> list[str]:
    """The events logged while one coroutine runs to its end (or is cancelled as at a handover)."""

    async def run() -> None:
        runner = SmartTriggerRunner()
        task = asyncio.create_task(runner.run_trigger(1, trigger))
        runner.triggers[1] = {"task": task, "is_watcher": False, "name": NAME, "events": 0}
        if cancel:
            while runner.triggers[1]["events"] < trigger.events:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)
            task.cancel(HANDOVER_CANCEL_MSG)
        with pytest.raises(asyncio.CancelledError) if cancel else nullcontext():
            await task

    with capture_logs() as captured:
        asyncio.run(run())
    return [entry["event"] for entry in captured]


def test_a_coroutine_that_fired_leaves_out_trigger_completed() -> None:
    assert _lines_of(_Trigger(events=1)) == [STARTING, "Trigger fired event"]


def test_a_coroutine_that_ended_without_an_event_says_completed() -> None:
    assert _lines_of(_Trigger(events=0)) == [STARTING, "trigger completed"]


def test_a_cancelled_coroutine_says_completed_even_after_firing() -> None:
    """A watcher fires and keeps running; cancelled at a handover, its log still says it ended."""
    lines = _lines_of(_Trigger(events=2, forever=True), cancel=True)
    assert lines == [STARTING, "Trigger fired event", "Trigger fired event", "trigger completed"]


def test_a_fired_line_is_sent_at_once_other_lines_wait_for_the_loop() -> None:
    """The runner batches its log lines (runner.py item 6) but sends a "Trigger fired event" line at once:
    an instance killed before its next sync still leaves in its log what it fired."""
    drains: list[int] = []

    class _Channel:
        def drain(self) -> None:
            drains.append(1)

    async def run() -> None:
        runner = SmartTriggerRunner()
        runner.log_channel = _Channel()  # type: ignore[assignment]
        trigger = _Trigger(events=2)
        task = asyncio.create_task(runner.run_trigger(1, trigger))
        runner.triggers[1] = {"task": task, "is_watcher": False, "name": NAME, "events": 0}
        await task

    with capture_logs():
        asyncio.run(run())
    assert len(drains) == 2  # one per fired line; "starting" waits for the loop's pass
