"""The async trigger runner subprocess: Airflow's own, with one change to cancellation.

Airflow cancels every trigger it is told to stop as a "user action" and calls ``on_kill()``. A shard
handover or a group whose members all left is not a user action: the supervisor sends those ids negated,
and this runner cancels them without ``on_kill()``.
"""

from __future__ import annotations

import asyncio

from airflow.jobs.triggerer_job_runner import _USER_ACTION_CANCEL_MSG, TriggerRunner

HANDOVER_CANCEL_MSG = "smart-triggerer handover"


class SmartTriggerRunner(TriggerRunner):
    async def cancel_triggers(self) -> None:
        while self.to_cancel:
            signed_id = self.to_cancel.popleft()
            trigger_id = abs(signed_id)
            message = HANDOVER_CANCEL_MSG if signed_id < 0 else _USER_ACTION_CANCEL_MSG
            if trigger_id in self.triggers:
                self.triggers[trigger_id]["task"].cancel(message)
            await asyncio.sleep(0)
