from __future__ import annotations

from typing import Any

import pytest

from deferrables import ExternalDagSensor
from triggers.external_dag import ExternalTarget

TARGET = ExternalTarget("producer", ("a", "b"), logical_date="2026-11-22T00:00:00+00:00")


def test_all_allowed_is_success() -> None:
    assert TARGET.judge({"a": "success", "b": "success"})["status"] == "success"  # type: ignore[index]


def test_waiting_while_any_task_is_not_final() -> None:
    assert TARGET.judge({"a": "success", "b": "running"}) is None
    assert TARGET.judge({}) is None


def test_failed_and_skipped_end_the_wait() -> None:
    """apache/airflow#47298: a deferrable external wait that ignores these hangs until its timeout."""
    failed = TARGET.judge({"a": "upstream_failed", "b": "skipped"})
    assert failed is not None and failed["status"] == "failed" and "a of producer" in failed["message"]
    skipped = TARGET.judge({"a": "success", "b": "skipped"})
    assert skipped is not None and skipped["status"] == "skipped"


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"external_dag_id": ""}, "external_dag_id"),
        ({"external_task_ids": "a"}, "external_task_ids"),
        ({"on_skipped": "ignore"}, "on_skipped"),
        ({"allowed_states": ["success", "failed"]}, "allowed_states"),
        ({"latest_run": True, "run_id": "r1"}, "latest_run"),
    ],
)
def test_bad_arguments_fail_at_parse_time(kwargs: dict[str, Any], argument: str) -> None:
    with pytest.raises(ValueError, match=argument):
        ExternalDagSensor(**{"task_id": "wait", "external_dag_id": "producer", **kwargs})


def test_start_from_trigger_keeps_the_logical_date_template_for_the_triggerer() -> None:
    from triggers import ExternalDagTrigger

    sensor = ExternalDagSensor(
        task_id="wait", external_dag_id="producer", external_task_ids=["load"], start_from_trigger=True
    )
    args = sensor.start_trigger_args
    assert sensor.start_from_trigger and args is not None and args.trigger_kwargs is not None
    assert args.trigger_kwargs["logical_date"] == "{{ logical_date }}"
    assert "logical_date" in ExternalDagTrigger.template_fields


class _AsyncComms:
    """The triggerer runner's comms: answers awaited on the loop (no thread), each request recorded."""

    sent: list[Any]

    def __init__(self, answers: list[Any]) -> None:
        self.answers, self.sent = answers, []

    async def asend(self, msg: Any) -> Any:
        self.sent.append(msg)
        return self.answers.pop(0)


async def test_in_the_triggerer_the_check_awaits_the_runners_comms(monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from airflow.sdk.execution_time import task_runner
    from airflow.sdk.execution_time.comms import DRCount, TaskStatesResult

    states = TaskStatesResult(task_states={"run1": {"a": "success", "b": "skipped"}})
    comms = _AsyncComms([states])
    monkeypatch.setattr(task_runner, "SUPERVISOR_COMMS", comms, raising=False)
    before = threading.active_count()
    verdict = await TARGET.check()
    assert verdict is not None and verdict["status"] == "skipped"
    assert [type(m).__name__ for m in comms.sent] == ["GetTaskStates"]
    assert comms.sent[0].task_ids == ["a", "b"] and comms.sent[0].dag_id == "producer"
    assert threading.active_count() == before  # no thread was started for it

    whole_run = ExternalTarget("producer", run_id="r1")
    comms.answers = [DRCount(count=0), DRCount(count=1)]  # none failed, one succeeded
    verdict = await whole_run.check()
    assert verdict == {"status": "success", "message": "run of producer succeeded"}
    wanted = [list(whole_run.failed_states), list(whole_run.allowed_states)]
    assert [m.states for m in comms.sent[1:]] == wanted


def test_in_a_worker_the_check_sends_synchronously(monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow.sdk.execution_time import task_runner
    from airflow.sdk.execution_time.comms import TaskStatesResult

    sent: list[Any] = []

    class _SyncComms:
        def send(self, msg: Any) -> Any:
            sent.append(msg)
            return TaskStatesResult(task_states={"run1": {"a": "success", "b": "success"}})

    monkeypatch.setattr(task_runner, "SUPERVISOR_COMMS", _SyncComms(), raising=False)
    verdict = TARGET.check_sync()
    assert verdict is not None and verdict["status"] == "success"
    assert [type(m).__name__ for m in sent] == ["GetTaskStates"]


async def test_waits_on_tasks_of_one_dag_share_one_call_per_tick(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 28.1: three waits on different tasks of one DAG at one logical date, and two at run ids, are
    answered by one GetTaskStates each per tick; each judges its own tasks."""
    import asyncio

    from airflow.sdk.execution_time import task_runner
    from airflow.sdk.execution_time.comms import GetTaskStates, TaskStatesResult

    from triggers import ExternalDagTrigger

    sent: list[Any] = []

    class _Comms:
        async def asend(self, msg: Any) -> Any:
            sent.append(msg)
            await asyncio.sleep(0)
            if msg.run_ids:
                return TaskStatesResult(
                    task_states={
                        "r1": {"a": "success", "b": "running"},
                        "r2": {"a": "failed", "b": "success"},
                    }
                )
            return TaskStatesResult(
                task_states={"scheduled__x": {"a": "success", "b": "skipped", "c": "running"}}
            )

    monkeypatch.setattr(task_runner, "SUPERVISOR_COMMS", _Comms(), raising=False)
    monkeypatch.delenv("AIRFLOW__SMART_TRIGGERER__COALESCE_CHECKS", raising=False)
    date = "2026-11-22T00:00:00+00:00"
    waits = [
        ExternalDagTrigger("producer", external_task_ids=tasks, logical_date=date, poll_interval=0.1)
        for tasks in (["a"], ["a", "b"], ["c"])
    ]
    waits += [
        ExternalDagTrigger("producer", external_task_ids=["a"], run_id=run, poll_interval=0.1)
        for run in ("r1", "r2")
    ]

    async def first(trigger: ExternalDagTrigger) -> dict[str, Any]:
        event = await trigger.run().__anext__()
        return dict(event.payload)

    tasks = [asyncio.create_task(first(w)) for w in waits]
    done = await asyncio.wait_for(asyncio.gather(tasks[0], tasks[1], tasks[3], tasks[4]), 10)
    assert [e["status"] for e in done] == ["success", "skipped", "success", "failed"]
    assert not tasks[2].done()  # c is still running
    by_date = [m for m in sent if m.logical_dates]
    by_run = [m for m in sent if m.run_ids]
    assert all(isinstance(m, GetTaskStates) for m in sent)
    assert by_date[0].task_ids == ["a", "b", "c"] and by_run[0].run_ids == ["r1", "r2"]
    assert len(by_date) == 1 or by_date[1].task_ids == ["c"]  # the waits that ended leave the batch
    assert len(by_run) == 1  # both ended on the first answer
    tasks[2].cancel()
    await asyncio.gather(tasks[2], return_exceptions=True)
