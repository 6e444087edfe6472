"""ExternalDagSensor: wait for another DAG's run or tasks; failed and skipped states end the wait."""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Sequence
from typing import Any

from airflow.sdk import Context
from airflow.sdk.exceptions import AirflowException

from deferrables.base import CheckThenDeferSensor
from triggers.external_dag import ALLOWED, FAILED, SKIPPED, ExternalDagTrigger, ExternalTarget
from triggers.pg import read_only, refuse_writable_role, target_for

ON_SKIPPED = ("skip", "fail", "success")
LATEST_RUN_SQL = "SELECT run_id FROM dag_run WHERE dag_id = $1 ORDER BY run_after DESC, id DESC LIMIT 1"


async def latest_run_id(conn_id: str, dag_id: str) -> str | None:
    import asyncpg

    target = await target_for(conn_id)
    conn = await asyncpg.connect(**target.connect_kwargs())
    try:
        await refuse_writable_role(conn, conn_id)  # the metadata database: DAG code only reads it
        run_id: str | None = await read_only(conn, lambda c: c.fetchval(LATEST_RUN_SQL, dag_id))
        return run_id
    finally:
        await conn.close()


class ExternalDagSensor(CheckThenDeferSensor):
    """Wait for ``external_dag_id``'s run at ``logical_date`` (templated; default: this run's logical
    date), or ``run_id``, or its latest run (``latest_run=True``: resolved when the task starts, from the
    metadata database through ``metadata_conn_id``), or for its ``external_task_ids`` in that run.

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
        latest_run: bool = False,
        metadata_conn_id: str = "airflow_db",
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
        if latest_run and (run_id is not None or start_from_trigger):
            raise ValueError(
                "latest_run=True resolves the run when the task starts: it takes no run_id "
                "and no start_from_trigger"
            )
        if run_id is not None or latest_run:
            logical_date = None
        ExternalTarget(
            external_dag_id,
            tuple(external_task_ids or ()),
            logical_date or None,
            run_id or ("(latest)" if latest_run else None),
            tuple(allowed_states),
            tuple(failed_states),
            tuple(skipped_states),
        )  # validates
        self.external_dag_id, self.external_task_ids = external_dag_id, list(external_task_ids or [])
        self.logical_date, self.run_id = logical_date, run_id
        self.allowed_states, self.failed_states = list(allowed_states), list(failed_states)
        self.skipped_states, self.on_skipped = list(skipped_states), on_skipped
        self.latest_run, self.metadata_conn_id = latest_run, metadata_conn_id
        if start_from_trigger:
            self._start_in_triggerer(self._trigger(self.logical_date))

    def _target(self) -> ExternalTarget:
        logical_date = None
        if not self.run_id:
            logical_date = dt.datetime.fromisoformat(str(self.logical_date)).isoformat()
        return ExternalTarget(
            self.external_dag_id,
            tuple(sorted(self.external_task_ids)),
            logical_date,
            self.run_id,
            tuple(self.allowed_states),
            tuple(self.failed_states),
            tuple(self.skipped_states),
        )

    def _check_now(self) -> dict[str, Any] | None:
        return self._target().check_sync()  # the worker's comms are synchronous

    def finish(self, payload: dict[str, Any]) -> None:
        if payload.get("status") == "skipped":
            payload = {
                **payload,
                "status": {"skip": "skipped", "fail": "failed", "success": "success"}[self.on_skipped],
            }
            if payload["status"] == "skipped":
                from airflow.sdk.exceptions import AirflowSkipException

                raise AirflowSkipException(f"{self.task_id}: {payload['message']}")
        super().finish(payload)

    def execute(self, context: Context) -> None:
        if self.latest_run:
            self.run_id = self._latest_run_id()
            self.log.info("waiting for the latest run of %s: %s", self.external_dag_id, self.run_id)
        try:
            super().execute(context)
        except ValueError as err:  # a logical date that does not parse
            raise AirflowException(f"{self.task_id}: {err}") from err

    def _latest_run_id(self) -> str:
        """The task SDK cannot list another DAG's runs: read the metadata database (one parameterised
        query through the Postgres connection ``metadata_conn_id``)."""
        run_id = asyncio.run(latest_run_id(self.metadata_conn_id, self.external_dag_id))
        if run_id is None:
            raise AirflowException(f"{self.task_id}: {self.external_dag_id} has no run yet (latest_run=True)")
        return run_id

    def trigger(self) -> ExternalDagTrigger:
        return self._trigger(self._target().logical_date)

    def _trigger(self, logical_date: str | None) -> ExternalDagTrigger:
        return ExternalDagTrigger(
            self.external_dag_id,
            external_task_ids=self.external_task_ids,
            logical_date=logical_date,
            run_id=self.run_id,
            allowed_states=self.allowed_states,
            failed_states=self.failed_states,
            skipped_states=self.skipped_states,
            poll_interval=self.poke_interval,
        )
