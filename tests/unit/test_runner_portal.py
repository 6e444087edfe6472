"""Greenback's portal only for coroutines that may need it (docs/design.md, runner: Greenback's portal): a
trigger class
that says it makes no sync SDK call runs without one; every other (a subclass that does not say it again
included), and one with templates to render, gets Airflow's portal, and its sync calls work. A sync call
made without a portal fails that trigger alone: a direct one with Airflow's error naming the async method,
a connection lookup as "isn't defined". The connection extras of our triggers are masked with ``await``."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

import greenback
import pytest
from airflow.executors.workloads.trigger import RunTrigger
from airflow.jobs import triggerer_job_runner
from airflow.jobs.triggerer_job_runner import TriggerCommsDecoder
from airflow.models.trigger import Trigger
from airflow.sdk import BaseHook, Connection
from airflow.sdk.execution_time import task_runner
from airflow.sdk.execution_time.comms import ConnectionResult, GetConnection
from airflow.triggers.base import BaseTrigger, TriggerEvent

from bench.triggers import PollTrigger
from dataset_bridge.status_table import TableStatusTrigger
from smart_triggerer.runner.trigger_runner import SmartTriggerRunner, _PortalOnDemand, needs_portal
from triggers.connections import aextra_dejson
from triggers.external_dag import ExternalDagTrigger
from triggers.http import HttpConditionTrigger
from triggers.sql_condition import SqlConditionTrigger
from triggers.table_load import TableLoadTrigger

SEEN: dict[int, Any] = {}  # trigger id -> whether it had a portal, or what its sync call answered


class _Probe(BaseTrigger):
    """Says nothing about sync calls, as every trigger written for Airflow: it gets a portal."""

    def __init__(self, call: str = "") -> None:
        super().__init__()
        self.call = call

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{__name__}.{type(self).__name__}", {"call": self.call})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        SEEN[self.trigger_id] = greenback.has_portal()  # type: ignore[index]  # set before run()
        if self.call == "send":  # a sync SDK call from async code, straight to the supervisor
            answer = task_runner.SUPERVISOR_COMMS.send(GetConnection(conn_id="warehouse"))
            assert isinstance(answer, ConnectionResult)
            SEEN[self.trigger_id] = answer.conn_id  # type: ignore[index]
        elif self.call == "hook":  # the same through Airflow's secrets backends, as a hook makes it
            SEEN[self.trigger_id] = BaseHook.get_connection("warehouse").conn_id  # type: ignore[index]
        await asyncio.sleep(3600)
        yield TriggerEvent(None)


class _AsyncOnly(_Probe):
    calls_sync_sdk = False


class _Inherited(_AsyncOnly):
    """A subclass that does not say it again (it may add a sync call): it gets the portal."""


class _Comms(TriggerCommsDecoder):
    """Airflow's comms of the runner, on this loop; the supervisor's answer to a connection request is
    given here (``send`` is Airflow's: it checks for the portal)."""

    async def asend(self, msg: Any) -> Any:
        return ConnectionResult(
            conn_id=msg.conn_id,
            conn_type="postgres",
            host=None,
            schema=None,  # type: ignore[call-arg]  # the alias of schema_
            login=None,
            password=None,
            port=None,
            extra=None,
        )


@contextmanager
def _comms_on_this_loop() -> Iterator[_Comms]:
    """``_Comms`` set up as the runner's ``start_reader`` would, for the running loop; its socket is never
    written (the answers are given in ``asend``) and is closed on the way out."""
    left, right = socket.socketpair()
    with left, right:
        comms = _Comms(async_writer=None, async_reader=None, socket=left)  # type: ignore[arg-type]
        comms._loop, comms._loop_thread_id = asyncio.get_running_loop(), threading.get_ident()
        yield comms


def _workload(trigger_id: int, trigger_class: type, call: str = "") -> RunTrigger:
    return RunTrigger(
        id=trigger_id,
        classpath=f"{__name__}.{trigger_class.__name__}",
        encrypted_kwargs=Trigger.encrypt_kwargs({"call": call}),
    )


def _run(workloads: list[RunTrigger]) -> tuple[dict[int, Any], dict[int, str]]:
    """Create the workloads in our runner; what each coroutine saw, and the failures by trigger id."""

    async def run() -> tuple[dict[int, Any], dict[int, str]]:
        with _comms_on_this_loop() as comms:
            task_runner.SUPERVISOR_COMMS = comms  # type: ignore[assignment]  # as Airflow's triggerer does
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
            return dict(SEEN), failed

    return asyncio.run(run())


@pytest.fixture(autouse=True)
def _portal_on_demand(monkeypatch: pytest.MonkeyPatch) -> None:
    # as the runner's run() does
    monkeypatch.setattr(triggerer_job_runner, "greenback", _PortalOnDemand(greenback))
    monkeypatch.setattr(task_runner, "SUPERVISOR_COMMS", None, raising=False)


def test_only_a_trigger_that_makes_no_sync_call_runs_without_a_portal() -> None:
    seen, failed = _run(
        [
            _workload(1, _Probe),
            _workload(2, _AsyncOnly),
            _workload(3, _Probe, call="send"),
            _workload(4, _Inherited),
            _workload(5, _Probe, call="hook"),
        ]
    )
    assert seen == {1: True, 2: False, 3: "warehouse", 4: True, 5: "warehouse"}  # the sync calls answered
    assert failed == {}


def test_a_sync_call_without_a_portal_fails_that_trigger_alone_with_the_cause() -> None:
    seen, failed = _run(
        [
            _workload(1, _AsyncOnly, call="send"),
            _workload(2, _AsyncOnly),
            _workload(3, _Probe, call="send"),
            _workload(4, _AsyncOnly, call="hook"),
        ]
    )
    assert sorted(failed) == [1, 4]
    assert "use the async equivalent" in failed[1]
    assert "isn't defined" in failed[4]  # Airflow's secrets backend swallows the cause
    assert seen == {1: False, 2: False, 3: "warehouse", 4: False}  # the others run on


def test_our_triggers_mask_connection_extras_with_await(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a portal, Airflow's sync ``extra_dejson`` could not tell the supervisor to mask the extra's
    values; ours asks with ``await`` (Airflow's ``aextra_dejson`` where the task SDK has one)."""
    told: list[Any] = []

    async def asend(msg: Any) -> Any:
        told.append(msg)

    async def run() -> tuple[dict[str, Any], dict[str, Any]]:
        with _comms_on_this_loop() as comms:
            monkeypatch.setattr(comms, "asend", asend)
            monkeypatch.setattr(task_runner, "SUPERVISOR_COMMS", comms)
            conn = Connection(
                conn_id="warehouse",
                conn_type="postgres",
                extra='{"sslmode": "require", "token": "s3cr3t-extra"}',
            )
            ours = await aextra_dejson(conn)
            monkeypatch.delattr(type(conn), "aextra_dejson", raising=False)  # as on the task SDK 1.3.1
            return ours, await aextra_dejson(conn)

    ours, older = asyncio.run(run())
    assert ours == older == {"sslmode": "require", "token": "s3cr3t-extra"}
    assert [type(msg).__name__ for msg in told] == ["MaskSecret", "MaskSecret"]
    assert all(msg.value == ours for msg in told)


def test_templates_to_render_keep_the_portal() -> None:
    assert needs_portal(_Probe, None) and needs_portal(_Probe, {"ds": "2026-11-27"})
    assert not needs_portal(_AsyncOnly, None) and needs_portal(_Inherited, None)
    assert needs_portal(_AsyncOnly, {"ds": "2026-11-27"})  # a template may read a Variable


@pytest.mark.parametrize(
    "trigger_class",
    [
        ExternalDagTrigger,
        HttpConditionTrigger,
        SqlConditionTrigger,
        TableLoadTrigger,
        TableStatusTrigger,
        PollTrigger,
    ],
)
def test_our_triggers_say_they_make_no_sync_call(trigger_class: type) -> None:
    assert not needs_portal(trigger_class, None)
