"""ExternalDagSensor: wait for another DAG's run or tasks; failed and skipped states end the wait."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any

from airflow.sdk import Context
from airflow.sdk.exceptions import AirflowException

from deferrables.base import CheckThenDeferSensor
from triggers.external_dag import ALLOWED, FAILED, SKIPPED, ExternalDagTrigger, ExternalTarget

ON_SKIPPED = ("skip", "fail", "success")


class ExternalDagSensor(CheckThenDeferSensor):
    """Wait for ``external_dag_id``'s run at ``logical_date`` (templated; default: this run's logical
    date) or ``run_id``, or for its ``external_task_ids`` in that run.

    All watched tasks (or the run) in ``allowed_states``: success. Any in ``failed_states``: the task fails
    at once (it does not wait for its timeout). Any in ``skipped_states``: ``on_skipped`` decides
    (``skip``, ``fail`` or ``success``).
    """

    template_fields: Sequence[str] = ("external_dag_id", "external_task_ids", "logical_date", "run_id")

    def __init__(
        self,
        *,
        external_dag_id: str,
        external_task_ids: Sequence[str] | None = None,
        logical_date: str | None = "{{ logical_date }}",
        run_id: str | None = None,
        allowed_states: Sequence[str] = ALLOWED,
        failed_states: Sequence[str] = FAILED,
        skipped_states: Sequence[str] = SKIPPED,
        on_skipped: str = "skip",
        start_from_trigger: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if not isinstance(external_dag_id, str) or not external_dag_id:
            raise ValueError(f"external_dag_id must be a DAG id, got {external_dag_id!r}")
        if isinstance(external_task_ids, str):
            raise ValueError("external_task_ids must be a list of task ids, not a single string")
        if on_skipped not in ON_SKIPPED:
            raise ValueError(f"on_skipped={on_skipped!r} must be one of {ON_SKIPPED}")
        if run_id is not None:
            logical_date = None
        ExternalTarget(external_dag_id, tuple(external_task_ids or ()), logical_date or None, run_id,
                       tuple(allowed_states), tuple(failed_states), tuple(skipped_states))  # validates
        self.external_dag_id, self.external_task_ids = external_dag_id, list(external_task_ids or [])
        self.logical_date, self.run_id = logical_date, run_id
        self.allowed_states, self.failed_states = list(allowed_states), list(failed_states)
        self.skipped_states, self.on_skipped = list(skipped_states), on_skipped
        if start_from_trigger:
            self._start_in_triggerer(self._trigger(self.logical_date))

    def _target(self) -> ExternalTarget:
        logical_date = None
        if not self.run_id:
            logical_date = dt.datetime.fromisoformat(str(self.logical_date)).isoformat()
        return ExternalTarget(self.external_dag_id, tuple(sorted(self.external_task_ids)), logical_date,
                              self.run_id, tuple(self.allowed_states), tuple(self.failed_states),
                              tuple(self.skipped_states))

    def _check_now(self) -> dict[str, Any] | None:
        return self._target().check_sync()  # the worker's comms are synchronous

    def finish(self, payload: dict[str, Any]) -> None:
        if payload.get("status") == "skipped":
            payload = {**payload, "status": {"skip": "skipped", "fail": "failed",
                                              "success": "success"}[self.on_skipped]}
            if payload["status"] == "skipped":
                from airflow.sdk.exceptions import AirflowSkipException

                raise AirflowSkipException(f"{self.task_id}: {payload['message']}")
        super().finish(payload)

    def execute(self, context: Context) -> None:
        try:
            super().execute(context)
        except ValueError as err:  # a logical date that does not parse
            raise AirflowException(f"{self.task_id}: {err}") from err

    def trigger(self) -> ExternalDagTrigger:
        return self._trigger(self._target().logical_date)

    def _trigger(self, logical_date: str | None) -> ExternalDagTrigger:
        return ExternalDagTrigger(
            self.external_dag_id, external_task_ids=self.external_task_ids, logical_date=logical_date,
            run_id=self.run_id, allowed_states=self.allowed_states, failed_states=self.failed_states,
            skipped_states=self.skipped_states, poll_interval=self.poke_interval,
        )
