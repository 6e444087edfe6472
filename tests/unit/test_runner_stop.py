"""A runner stopped by a signal: what fired before the stop, and what fires while its coroutines end,
reaches the supervisor in its last sync, also when one coroutine is slow to end
(``SmartTriggerRunner._final_sync``)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

from airflow.executors.workloads.trigger import RunTrigger
from airflow.models.trigger import Trigger
from airflow.triggers.base import BaseTrigger, TriggerEvent

from smart_triggerer.runner.trigger_runner import FINAL_SYNC_SECONDS, SmartTriggerRunner

RELEASE = asyncio.Event()  # ends _SlowToEnd's cleanup once the test has what it measures


class _SlowToEnd(BaseTrigger):
    """Waits; cancelled, its cleanup takes far longer than the runner's stop budget (a stalled server)."""

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{__name__}._SlowToEnd", {})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        try:
            await asyncio.sleep(3600)
        finally:
            await asyncio.shield(RELEASE.wait())
        yield TriggerEvent(None)


class _FiresWhenCancelled(BaseTrigger):
    """Waits; cancelled, it yields the event it has just taken (the take came before the cancel)."""

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{__name__}._FiresWhenCancelled", {})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(3600)
        yield TriggerEvent({"taken": "a message"})


def entry_type(runner: SmartTriggerRunner) -> Any:
    """Airflow's event entry (3.3.2 queues ``TriggerEventEntry``; earlier releases plain tuples)."""
    from airflow.jobs import triggerer_job_runner

    return getattr(triggerer_job_runner, "TriggerEventEntry", None)


def _workload(trigger_id: int, name: str) -> RunTrigger:
    return RunTrigger(
        id=trigger_id, classpath=f"{__name__}.{name}", encrypted_kwargs=Trigger.encrypt_kwargs({}), ti=None
    )


def test_the_last_sync_carries_events_fired_before_and_while_coroutines_end() -> None:
    async def stop() -> tuple[list[int], float]:
        runner = SmartTriggerRunner()
        runner.job_id = 7
        runner.to_create.extend([_workload(1, "_SlowToEnd"), _workload(2, "_FiresWhenCancelled")])
        await runner.create_triggers()
        await asyncio.sleep(0.05)  # both run their trigger
        fired = TriggerEvent({"fired": "before the stop"})
        # a plain tuple for the releases before 3.3.2 (typed for this one's TriggerEventEntry)
        runner.events.append(entry_type(runner)(9, fired, None) if entry_type(runner) else (9, fired))  # type: ignore[arg-type]
        reader = asyncio.create_task(asyncio.sleep(3600))  # the supervisor still answers
        runner.comms_decoder = SimpleNamespace(_reader_task=reader)  # type: ignore[assignment]
        synced: list[int] = []

        async def sync(finished_ids: list[int]) -> None:
            synced.extend(entry[0] for entry in runner.events)
            runner.events.clear()

        runner.sync_state_to_supervisor = sync  # type: ignore[method-assign]
        started = time.monotonic()
        await runner._final_sync()
        took = time.monotonic() - started
        reader.cancel()
        RELEASE.set()  # the slow cleanup may end now: the run's own teardown does not wait for it
        await asyncio.gather(*(d["task"] for d in runner.triggers.values()), return_exceptions=True)
        return synced, took

    synced, took = asyncio.run(stop())
    assert 9 in synced, "an event that fired before the stop was never synced"
    assert 2 in synced, "an event fired while the coroutines ended was never synced"
    assert took < FINAL_SYNC_SECONDS + 0.5, took
