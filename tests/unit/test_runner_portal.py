"""Greenback's portal only for coroutines that may need it (triggerer/runner.py, item 10): a trigger class
that says it makes no sync SDK call runs without one; every other, and one with templates to render, gets
Airflow's portal, and its sync calls work. A sync call made without a portal fails that trigger alone, with
Airflow's error naming the async equivalent."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import AsyncIterator
from typing import Any

import greenback
import pytest
from airflow.executors.workloads.trigger import RunTrigger
from airflow.jobs import triggerer_job_runner
from airflow.jobs.triggerer_job_runner import TriggerCommsDecoder
from airflow.models.trigger import Trigger
from airflow.sdk.execution_time import task_runner
from airflow.sdk.execution_time.comms import ConnectionResult, GetConnection
from airflow.triggers.base import BaseTrigger, TriggerEvent

from bench.triggers import PollTrigger
from dataset_bridge.status_table import TableStatusTrigger
from triggerer.runner import SmartTriggerRunner, _PortalOnDemand, needs_portal
from triggers.external_dag import ExternalDagTrigger
from triggers.http import HttpConditionTrigger
from triggers.sql_condition import SqlConditionTrigger
from triggers.table_load import TableLoadTrigger

SEEN: dict[int, Any] = {}  # trigger id -> whether it had a portal, or what its sync call answered


class _Probe(BaseTrigger):
    """Says nothing about sync calls, as every trigger written for Airflow: it gets a portal."""

    def __init__(self, call: bool = False) -> None:
        super().__init__()
        self.call = call

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{__name__}.{type(self).__name__}", {"call": self.call})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        SEEN[self.trigger_id] = greenback.has_portal()
        if self.call:  # a sync SDK call from async code, as BaseHook.get_connection() makes
            answer = task_runner.SUPERVISOR_COMMS.send(GetConnection(conn_id="warehouse"))
            SEEN[self.trigger_id] = answer.conn_id
        await asyncio.sleep(3600)
        yield TriggerEvent(None)


class _AsyncOnly(_Probe):
    calls_sync_sdk = False


class _Comms(TriggerCommsDecoder):
    """Airflow's comms of the runner, on this loop; the supervisor's answer to a connection request is
    given here (``send`` is Airflow's: it checks for the portal)."""

    async def asend(self, msg: Any) -> Any:
        return ConnectionResult(conn_id=msg.conn_id, conn_type="postgres", host=None, schema=None, login=None,
                                password=None, port=None, extra=None)


def _workload(trigger_id: int, trigger_class: type, call: bool = False) -> RunTrigger:
    return RunTrigger(id=trigger_id, classpath=f"{__name__}.{trigger_class.__name__}",
                      encrypted_kwargs=Trigger.encrypt_kwargs({"call": call}))


def _run(workloads: list[RunTrigger]) -> tuple[dict[int, Any], dict[int, str]]:
    """Create the workloads in our runner; what each coroutine saw, and the failures by trigger id."""

    async def run() -> tuple[dict[int, Any], dict[int, str]]:
        left, right = socket.socketpair()  # never written: the answer is given in ``asend``
        comms = _Comms(async_writer=None, async_reader=None, socket=left)  # type: ignore[arg-type]
        comms._loop, comms._loop_thread_id = asyncio.get_running_loop(), threading.get_ident()
        task_runner.SUPERVISOR_COMMS = comms
        runner = SmartTriggerRunner()
        runner.job_id = 7
        runner.to_create.extend(workloads)
        SEEN.clear()
        await runner.create_triggers()
        async with asyncio.timeout(30):  # each coroutine has run up to its sleep, or ended
            while any(w.id not in SEEN and not runner.triggers[w.id]["task"].done() for w in workloads):
                await asyncio.sleep(0.01)
        ended = [d["task"] for d in runner.triggers.values() if d["task"].done()]
        await asyncio.gather(*ended, return_exceptions=True)
        runner._ended.extend(runner.triggers)
        await runner.cleanup_finished_triggers()
        failed = {trigger_id: str(error) for trigger_id, error in runner.failed_triggers}
        running = [d["task"] for d in runner.triggers.values()]
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        left.close()
        right.close()
        return dict(SEEN), failed

    return asyncio.run(run())


@pytest.fixture(autouse=True)
def _portal_on_demand(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(triggerer_job_runner, "greenback", _PortalOnDemand())  # as the runner's run() does
    monkeypatch.setattr(task_runner, "SUPERVISOR_COMMS", None, raising=False)


def test_only_a_trigger_that_makes_no_sync_call_runs_without_a_portal() -> None:
    seen, failed = _run([_workload(1, _Probe), _workload(2, _AsyncOnly), _workload(3, _Probe, call=True)])
    assert seen == {1: True, 2: False, 3: "warehouse"}  # the portal's sync call was answered
    assert failed == {}


def test_a_sync_call_without_a_portal_fails_that_trigger_alone_with_the_cause() -> None:
    seen, failed = _run([_workload(1, _AsyncOnly, call=True), _workload(2, _AsyncOnly),
                         _workload(3, _Probe, call=True)])
    assert list(failed) == [1]
    assert "use the async equivalent" in failed[1]
    assert seen == {1: False, 2: False, 3: "warehouse"}  # the others run on


def test_templates_to_render_keep_the_portal() -> None:
    assert needs_portal(_Probe, None) and needs_portal(_Probe, {"ds": "2026-11-27"})
    assert not needs_portal(_AsyncOnly, None)
    assert needs_portal(_AsyncOnly, {"ds": "2026-11-27"})  # a template may read a Variable


@pytest.mark.parametrize("trigger_class", [ExternalDagTrigger, HttpConditionTrigger, SqlConditionTrigger,
                                           TableLoadTrigger, TableStatusTrigger, PollTrigger])
def test_our_triggers_say_they_make_no_sync_call(trigger_class: type) -> None:
    assert not needs_portal(trigger_class, None)
