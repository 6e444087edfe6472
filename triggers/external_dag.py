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
        return [GetDRCount(dag_id=self.dag_id, states=list(states), **self._selector())
                for states in (self.failed_states, self.allowed_states)]

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
    identity_kwargs = ("external_dag_id", "external_task_ids", "logical_date", "run_id", "allowed_states",
                       "failed_states", "skipped_states")
    wait_description = ("DAG {external_dag_id}[ run {run_id}][ of {logical_date}], "
                        "tasks {external_task_ids} in {allowed_states}")
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
        return ExternalTarget(self.external_dag_id, tuple(self.external_task_ids), self.logical_date or None,
                              self.run_id or None, tuple(self.allowed_states), tuple(self.failed_states),
                              tuple(self.skipped_states))

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return ("triggers.external_dag.ExternalDagTrigger", {
            "external_dag_id": self.external_dag_id, "external_task_ids": list(self.external_task_ids),
            "logical_date": self.logical_date, "run_id": self.run_id,
            "allowed_states": self.allowed_states, "failed_states": self.failed_states,
            "skipped_states": self.skipped_states, "poll_interval": self.poll_interval,
        })

    async def run(self) -> AsyncIterator[TriggerEvent]:
        check = self.target().check
        yield TriggerEvent(await poll_until(check, poll_interval=self.poll_interval, log=self.log))
