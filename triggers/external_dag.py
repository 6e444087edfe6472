"""Waiting for another DAG's run, or some of its tasks, at a logical date (or a run id).

The states come through Airflow's own task-SDK messages (``GetTaskStates``, ``GetDRCount``): awaited on
the runner's event loop in the triggerer, sent synchronously in a worker. Unlike Airflow's deferrable
ExternalTaskSensor as reported in apache/airflow#47298, failed and skipped states end the wait: ``failed``
at once, ``skipped`` as the sensor's ``on_skipped`` says.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from triggers.coalesce import KeyedBatch, coalescing, shared_batch
from triggers.identity import DedupableTrigger
from triggers.polling import poll_until

ALLOWED = ("success",)
FAILED = ("failed", "upstream_failed")
SKIPPED = ("skipped",)


@dataclass(frozen=True)
class ExternalTarget:
    dag_id: str
    task_ids: tuple[str, ...] = ()
    logical_date: str | None = None
    run_id: str | None = None
    allowed_states: tuple[str, ...] = ALLOWED
    failed_states: tuple[str, ...] = FAILED
    skipped_states: tuple[str, ...] = SKIPPED

    def __post_init__(self) -> None:
        if (self.logical_date is None) == (self.run_id is None):
            raise ValueError("give exactly one of logical_date and run_id")
        overlap = set(self.allowed_states) & (set(self.failed_states) | set(self.skipped_states))
        if overlap:
            raise ValueError(f"allowed_states and failed/skipped states overlap: {sorted(overlap)}")

    def _selector(self) -> dict[str, Any]:
        if self.run_id:
            return {"run_ids": [self.run_id]}
        assert self.logical_date is not None
        return {"logical_dates": [dt.datetime.fromisoformat(self.logical_date)]}

    def requests(self) -> list[Any]:
        """The task-SDK messages that answer this wait: the tasks' states, or the counts of runs in the
        failed and in the allowed states."""
        from airflow.sdk.execution_time.comms import GetDRCount, GetTaskStates

        if self.task_ids:
            return [GetTaskStates(dag_id=self.dag_id, task_ids=list(self.task_ids), **self._selector())]
        return [
            GetDRCount(dag_id=self.dag_id, states=list(states), **self._selector())
            for states in (self.failed_states, self.allowed_states)
        ]

    def verdict(self, responses: list[Any]) -> dict[str, Any] | None:
        """The answers to ``requests()``, in order -> the event's payload, or None to wait on."""
        if self.task_ids:
            runs = responses[0].task_states
            return self.judge({task: state for tasks in runs.values() for task, state in tasks.items()})
        failed, succeeded = (response.count for response in responses)
        if failed:
            return {"status": "failed", "message": f"run of {self.dag_id} is in {list(self.failed_states)}"}
        if succeeded:
            return {"status": "success", "message": f"run of {self.dag_id} succeeded"}
        return None

    def check_sync(self) -> dict[str, Any] | None:
        """In a worker (the sensor's own poke): the worker's comms are synchronous."""
        from airflow.sdk.execution_time.task_runner import SUPERVISOR_COMMS

        return self.verdict([SUPERVISOR_COMMS.send(request) for request in self.requests()])

    async def check(self) -> dict[str, Any] | None:
        """In the triggerer: the runner's comms answered on its own event loop. No thread: a sync call made
        from a thread waits on the loop (and all such calls share one thread), so one unanswered request
        would hold every other wait's check behind it."""
        from airflow.sdk.execution_time.task_runner import SUPERVISOR_COMMS

        return self.verdict([await SUPERVISOR_COMMS.asend(request) for request in self.requests()])

    def judge(self, states: dict[str, str | None]) -> dict[str, Any] | None:
        """Task states -> payload: failed beats skipped beats waiting; all allowed is success."""
        where = f"{self.dag_id} at {self.logical_date or self.run_id}"
        failed = sorted(t for t in self.task_ids if states.get(t) in self.failed_states)
        if failed:
            return {"status": "failed", "message": f"{', '.join(failed)} of {where} failed"}
        skipped = sorted(t for t in self.task_ids if states.get(t) in self.skipped_states)
        if skipped:
            return {"status": "skipped", "message": f"{', '.join(skipped)} of {where} skipped"}
        if all(states.get(t) in self.allowed_states for t in self.task_ids):
            return {"status": "success", "message": f"{', '.join(self.task_ids)} of {where} succeeded"}
        return None


class ExternalDagTrigger(DedupableTrigger, BaseTrigger):
    calls_sync_sdk = False  # connections and comms are asked with await: no greenback portal needed
    identity_kwargs = (
        "external_dag_id",
        "external_task_ids",
        "logical_date",
        "run_id",
        "allowed_states",
        "failed_states",
        "skipped_states",
    )
    wait_description = (
        "DAG {external_dag_id}[ run {run_id}][ of {logical_date}], "
        "tasks {external_task_ids} in {allowed_states}"
    )
    # rendered in the triggerer when the task starts there (start_from_trigger)
    template_fields = ("external_dag_id", "external_task_ids", "logical_date", "run_id")

    def __init__(
        self,
        external_dag_id: str,
        *,
        external_task_ids: Sequence[str] = (),
        logical_date: str | None = None,
        run_id: str | None = None,
        allowed_states: Sequence[str] = ALLOWED,
        failed_states: Sequence[str] = FAILED,
        skipped_states: Sequence[str] = SKIPPED,
        poll_interval: float = 60.0,
    ) -> None:
        super().__init__()
        self.external_dag_id, self.external_task_ids = external_dag_id, sorted(external_task_ids)
        self.logical_date, self.run_id = logical_date, run_id
        self.allowed_states, self.failed_states = list(allowed_states), list(failed_states)
        self.skipped_states = list(skipped_states)
        self.poll_interval = float(poll_interval)
        self.target()  # validates now; rebuilt at run time from the (possibly rendered) fields

    def target(self) -> ExternalTarget:
        return ExternalTarget(
            self.external_dag_id,
            tuple(self.external_task_ids),
            self.logical_date or None,
            self.run_id or None,
            tuple(self.allowed_states),
            tuple(self.failed_states),
            tuple(self.skipped_states),
        )

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            "triggers.external_dag.ExternalDagTrigger",
            {
                "external_dag_id": self.external_dag_id,
                "external_task_ids": list(self.external_task_ids),
                "logical_date": self.logical_date,
                "run_id": self.run_id,
                "allowed_states": self.allowed_states,
                "failed_states": self.failed_states,
                "skipped_states": self.skipped_states,
                "poll_interval": self.poll_interval,
            },
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        target = self.target()
        if not target.task_ids or not coalescing():
            # a whole run's state is a count per wait (GetDRCount answers one selector, not several)
            yield TriggerEvent(await poll_until(target.check, poll_interval=self.poll_interval, log=self.log))
            return
        yield TriggerEvent(await self._wait_in_batch(target))

    async def _wait_in_batch(self, target: ExternalTarget) -> dict[str, Any]:
        """The waits on tasks of one DAG (at one logical date, or at any run ids) share one
        ``GetTaskStates`` per tick, over the union of their tasks and runs."""
        batch = task_states_batch(target)
        async with batch.join(member_keys(target), self.poll_interval) as member:
            while True:
                answer = await member.next()
                if answer.error is not None:
                    return {"status": "error", "message": answer.error}
                verdict = target.judge({task: state for _run, task, state in answer.rows})
                if verdict is not None:
                    return verdict


_SEP = "\x1f"  # between a run id and a task id in a batch key (neither holds a control character)


def member_keys(target: ExternalTarget) -> list[str]:
    """A wait's keys in its batch: its tasks (one logical date per batch), or (run, task) pairs."""
    if target.run_id:
        return [f"{target.run_id}{_SEP}{task}" for task in target.task_ids]
    return list(target.task_ids)


def task_states_batch(target: ExternalTarget) -> KeyedBatch:
    """The running loop's batch for the tasks of ``target``'s DAG at its logical date, or at run ids:
    states come back keyed by run id, so waits at different logical dates cannot share a call."""
    from airflow.sdk.execution_time.comms import GetTaskStates, TaskStatesResult

    by_run = target.run_id is not None
    logical_date = None if by_run else dt.datetime.fromisoformat(str(target.logical_date))

    async def fetch(keys: Sequence[str]) -> Sequence[tuple[str, str, str | None]]:
        from airflow.sdk.execution_time.task_runner import SUPERVISOR_COMMS

        if not keys:
            return []
        if by_run:
            pairs = [key.rsplit(_SEP, 1) for key in keys]  # a task id holds no control character
            request = GetTaskStates(
                dag_id=target.dag_id,
                task_ids=sorted({t for _r, t in pairs}),
                run_ids=sorted({r for r, _t in pairs}),
            )
        else:
            assert logical_date is not None
            request = GetTaskStates(dag_id=target.dag_id, task_ids=sorted(keys), logical_dates=[logical_date])
        response = await SUPERVISOR_COMMS.asend(request)
        if not isinstance(response, TaskStatesResult):
            raise TypeError(f"GetTaskStates answered {type(response).__name__}")
        return [
            (run, task, state) for run, tasks in response.task_states.items() for task, state in tasks.items()
        ]

    def key_of(row: tuple[str, str, str | None]) -> str:
        return f"{row[0]}{_SEP}{row[1]}" if by_run else row[1]

    def make() -> KeyedBatch:
        return KeyedBatch(f"task states of {target.dag_id}", fetch, key_of)

    return shared_batch(("external_dag", target.dag_id, "runs" if by_run else target.logical_date), make)
