"""The runner creates coroutines as Airflow's ``create_triggers`` does, yielding to the event loop once per
``CREATE_YIELD_EVERY`` triggers instead of twice per trigger (docs/design.md, runner: Creating coroutines)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from airflow.executors.workloads.task import TaskInstanceDTO
from airflow.executors.workloads.trigger import RunTrigger
from airflow.jobs.triggerer_job_runner import TriggerRunner, messages
from airflow.models.trigger import Trigger
from airflow.triggers.base import BaseEventTrigger, BaseTrigger, TriggerEvent
from structlog.testing import capture_logs

from smart_triggerer.runner import trigger_runner as runner_module
from smart_triggerer.runner.trigger_runner import CREATE_YIELD_EVERY, SmartTriggerRunner
from tests.helpers.task_instances import task_instance_dto

STARTED: dict[int, BaseTrigger] = {}  # trigger id -> the trigger whose run() started


class _Waiting(BaseTrigger):
    def __init__(self, key: str) -> None:
        super().__init__()
        self.key = key

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{__name__}._Waiting", {"key": self.key})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        STARTED[self.trigger_id] = self  # type: ignore[index]  # the runner sets it before run()
        await asyncio.sleep(3600)
        yield TriggerEvent(None)


class _Watching(_Waiting, BaseEventTrigger):
    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{__name__}._Watching", {"key": self.key})


def _workload(
    trigger_id: int, classpath: str = f"{__name__}._Waiting", ti: TaskInstanceDTO | None = None, **kwargs: Any
) -> RunTrigger:
    return RunTrigger(
        id=trigger_id,
        classpath=classpath,
        encrypted_kwargs=Trigger.encrypt_kwargs(kwargs or {"key": f"k{trigger_id}"}),
        ti=ti,
    )


def _mixed() -> list[RunTrigger]:
    """A good one, one for a task, a bad classpath, kwargs the class refuses, an id already running, and a
    watcher of assets."""
    watcher = _workload(6, f"{__name__}._Watching")
    watcher.watched_assets = {"orders": "s3://bucket/orders"}
    task = task_instance_dto(try_number=2, map_index=3)
    return [
        _workload(1),
        _workload(2, ti=task),
        _workload(3, "no.such.module.Trigger"),
        _workload(4, unexpected="x"),
        _workload(1),
        watcher,
    ]


async def _created(runner: SmartTriggerRunner) -> dict[int, tuple[Any, ...]]:
    """What each created coroutine runs, as a comparable summary, once each runs its trigger."""
    async with asyncio.timeout(30):
        while not set(runner.triggers) <= set(STARTED):
            await asyncio.sleep(0.01)
    found = {}
    for trigger_id, details in runner.triggers.items():
        trigger: Any = STARTED[trigger_id]
        store = getattr(trigger, "asset_state_store", None)
        found[trigger_id] = (
            details["name"],
            details["is_watcher"],
            details["events"],
            details["task"].get_name(),
            type(trigger).__name__,
            trigger.key,
            trigger.trigger_id,
            trigger.triggerer_job_id,
            trigger.timeout_after,
            trigger.task_instance,
            type(store).__name__,
        )
    return found


Create = Callable[[SmartTriggerRunner], Awaitable[None]]


def _create(workloads: list[RunTrigger], create: Create) -> tuple[dict[int, Any], list[Any], list[Any]]:
    async def run() -> tuple[dict[int, Any], list[Any]]:
        runner = SmartTriggerRunner()
        runner.job_id = 7
        runner.to_create.extend(workloads)
        STARTED.clear()
        await create(runner)
        created = await _created(runner)
        failed = [(trigger_id, type(error).__name__) for trigger_id, error in runner.failed_triggers]
        for details in runner.triggers.values():
            details["task"].cancel()
        await asyncio.gather(*(d["task"] for d in runner.triggers.values()), return_exceptions=True)
        return created, failed

    with capture_logs() as lines:
        created, failed = asyncio.run(run())
    # the creating loop's lines in order; each coroutine's own first line comes when it first runs (here
    # at the next yield, in Airflow's loop at once), so those are compared as a set
    said: list[Any] = [
        (line["event"], line.get("classpath"))
        for line in lines
        if not line["event"].endswith(" starting") and "completed" not in line["event"]
    ]
    said.append(sorted(line["event"] for line in lines if line["event"].endswith(" starting")))
    return created, failed, said


def test_coroutines_failures_and_log_lines_are_airflows() -> None:
    ours = _create(_mixed(), lambda runner: runner.create_triggers())
    airflows = _create(_mixed(), TriggerRunner.create_triggers)
    assert ours == airflows
    created, failed, said = ours
    assert sorted(created) == [1, 2, 6]
    assert created[2][0] == "d/r/t/3/2 (ID 2)" and created[6][1] is True and created[6][-1] != "NoneType"
    assert failed == [(3, "ModuleNotFoundError"), (4, "TypeError")]
    assert ("Trigger 1 had insertion attempted twice", None) in said


def test_the_loop_is_yielded_to_once_per_batch_and_every_coroutine_starts() -> None:
    count = 300

    async def passes_while_creating(create: Create) -> int:
        runner = SmartTriggerRunner()
        runner.job_id = 7
        runner.get_trigger_by_classpath(f"{__name__}._Waiting")  # imported already: no yield for it
        runner.to_create.extend(_workload(n) for n in range(1, count + 1))
        passes = 0
        creating = True

        async def ticker() -> None:
            nonlocal passes
            while creating:
                passes += 1
                await asyncio.sleep(0)

        ticking = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        STARTED.clear()
        await create(runner)
        creating = False
        await ticking
        async with asyncio.timeout(30):  # every coroutine reaches its trigger's run
            while len(STARTED) < count:
                await asyncio.sleep(0.01)
        for details in runner.triggers.values():
            details["task"].cancel()
        await asyncio.gather(*(d["task"] for d in runner.triggers.values()), return_exceptions=True)
        return passes

    ours = asyncio.run(passes_while_creating(lambda runner: runner.create_triggers()))
    airflows = asyncio.run(passes_while_creating(TriggerRunner.create_triggers))
    print(f"\nloop passes while creating {count} coroutines: {ours} (Airflow's loop: {airflows})")
    assert airflows >= 2 * count
    assert ours <= math.ceil(count / CREATE_YIELD_EVERY) + 2


def test_while_piles_come_the_next_one_is_asked_for_before_this_one_is_done(monkeypatch: Any) -> None:
    """A takeover's coroutines come in piles, one per sync with the supervisor; the runner asks for the
    next with ``PREFETCH_BELOW`` left and goes on creating while the supervisor answers (it may be
    reading the next part of the takeover), asks again while a pile lasts, creates what the answers
    bring in the same call, and cancels what they say at once (a handover must not wait for the rest)."""
    monkeypatch.setattr(runner_module, "PREFETCH_BELOW", 200)  # smaller piles than in production: quicker
    first, second = 600, 200

    async def run() -> tuple[list[int], list[int], list[bool], int]:
        runner = SmartTriggerRunner()
        runner.job_id = 7
        runner.get_trigger_by_classpath(f"{__name__}._Waiting")
        runner.to_create.extend(_workload(n) for n in range(1, first + 1))
        runner._handing_over = True  # the last sync brought a pile: more may come
        left_when_asked: list[int] = []
        created_while_answering: list[int] = []
        handed_over_by_then: list[bool] = []
        first_task: list[asyncio.Task[Any]] = []

        async def supervisor(msg: Any) -> messages.TriggerStateSync:
            left_when_asked.append(len(runner.to_create))
            if len(left_when_asked) == 1:
                first_task.append(runner.triggers[1]["task"])
            if len(left_when_asked) == 2:  # the first answer's cancel (trigger 1) was applied already
                task = first_task[0]  # (it may have ended and been cleaned up by this question)
                handed_over_by_then.append(task.cancelling() > 0 or task.cancelled())
            before = len(runner.triggers)
            # the supervisor is busy (reading): the answer comes once the runner created on for a while
            for _ in range(100_000):
                if len(runner.triggers) >= before + CREATE_YIELD_EVERY or not runner.to_create:
                    break
                await asyncio.sleep(0)
            else:
                raise AssertionError("the runner stopped creating while its question was out")
            created_while_answering.append(len(runner.triggers) - before)
            if len(left_when_asked) == 1:
                pile = [_workload(n) for n in range(first + 1, first + second + 1)]
                return messages.TriggerStateSync(to_create=pile, to_cancel={-1})
            return messages.TriggerStateSync(to_create=[], to_cancel=set())

        runner.asend = supervisor  # type: ignore[method-assign]
        STARTED.clear()
        await runner.create_triggers()
        created = len(runner.triggers | {1: "handed over"})  # trigger 1 may be cleaned up already
        await runner._asked_ahead()
        for details in runner.triggers.values():
            details["task"].cancel()
        await asyncio.gather(*(d["task"] for d in runner.triggers.values()), return_exceptions=True)
        return left_when_asked, created_while_answering, handed_over_by_then, created

    left_when_asked, created_while_answering, handed_over_by_then, created = asyncio.run(run())
    assert created == first + second  # the pile asked ahead was created in the same call
    assert 0 < left_when_asked[0] <= 200
    assert len(left_when_asked) >= 2 and left_when_asked[1] > 0  # asked again while that pile lasted
    assert created_while_answering[0] > 0  # creating went on while the supervisor answered
    assert handed_over_by_then == [True]


def test_the_loop_syncs_unless_an_answer_asked_ahead_left_coroutines_and_nothing_happened() -> None:
    runner = SmartTriggerRunner()
    assert runner._sync_needed(asked=False)
    assert runner._sync_needed(asked=True)  # an empty answer: the loop asks again, as it always did
    runner.to_create.append(_workload(1))
    assert runner._sync_needed(asked=False)
    assert not runner._sync_needed(asked=True)  # its pile is created first
    runner._ended.append(1)  # a coroutine ended: the supervisor hears it now
    assert runner._sync_needed(asked=True)
