"""What every sensor of ours does: check once in the worker, then defer; the same check when polling.

Subclasses give ``check`` (the async check, returning the event payload when the wait is over, else None)
and ``trigger`` (the trigger that runs the same check in the triggerer). Payloads carry ``status``:
``success`` finishes the task, ``failed`` fails it (skips it with ``soft_fail``), ``error`` fails it with
the cause (bad SQL, bad URL: retrying the wait cannot help).
"""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any

from airflow.sdk import BaseSensorOperator, Context
from airflow.sdk.exceptions import AirflowException, AirflowSkipException
from airflow.triggers.base import BaseTrigger


class CheckThenDeferSensor(BaseSensorOperator):
    def __init__(self, *, deferrable: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.deferrable = deferrable

    def _start_in_triggerer(self, trigger: BaseTrigger) -> None:
        """``start_from_trigger``: the scheduler defers the task straight into ``trigger`` (no worker
        slot until it resumes); the triggerer renders the trigger's templated fields."""
        from airflow.triggers.base import StartTriggerArgs

        if not self.deferrable:
            raise ValueError("start_from_trigger=True needs deferrable=True")
        classpath, kwargs = trigger.serialize()
        self.start_from_trigger = True
        self.start_trigger_args = StartTriggerArgs(
            trigger_cls=classpath,
            trigger_kwargs=kwargs,
            next_method="execute_complete",
            next_kwargs=None,
            timeout=dt.timedelta(seconds=self.timeout) if self.timeout else None,
        )

    async def check(self) -> dict[str, Any] | None:
        raise NotImplementedError

    def trigger(self) -> BaseTrigger:
        raise NotImplementedError

    def _check_now(self) -> dict[str, Any] | None:
        return asyncio.run(self.check())

    def finish(self, payload: dict[str, Any]) -> None:
        status = payload.get("status")
        if status == "success":
            self.log.info("%s", payload.get("message", "condition met"))
            return
        message = f"{self.task_id}: {payload.get('message', status)}"
        if status == "error":
            raise AirflowException(f"{self.task_id}: the check itself failed: {payload.get('message')}")
        if self.soft_fail:
            raise AirflowSkipException(message)
        raise AirflowException(message)

    def poke(self, context: Context) -> bool:
        payload = self._check_now()
        if payload is None:
            return False
        self.finish(payload)
        return True

    def execute(self, context: Context) -> None:
        if not self.deferrable:
            super().execute(context)
            return
        # Finish at once when the condition already holds: no triggerer round trip, and no
        # resume-within-seconds-of-deferral (Airflow 3.3.2, apache/airflow#71580).
        payload = self._check_now()
        if payload is not None:
            self.finish(payload)
            return
        self.defer(
            trigger=self.trigger(),
            method_name="execute_complete",
            timeout=dt.timedelta(seconds=self.timeout) if self.timeout else None,
        )

    def execute_complete(self, context: Context, event: dict[str, Any] | None = None) -> None:
        if not event:
            raise AirflowException(f"{self.task_id}: resumed without an event")
        self.finish(event)
