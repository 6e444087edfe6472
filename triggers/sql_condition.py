"""Waiting for a SQL condition on a PostgreSQL Airflow connection.

The condition holds when the first column of the first row of ``sql`` is truthy; ``failure_sql`` (checked
first) ends the wait as failed. Both are run with their ``parameters`` as bind values ($1, $2, ...): the
statement text is the author's, the values are never spliced into it. There are no Python callables here
(``SqlSensor``'s ``success``/``failure``): a trigger's arguments must serialise to plain data.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

import asyncpg
from airflow.triggers.base import BaseTrigger, TriggerEvent

from triggers.connections import CONNECTION_PATIENCE
from triggers.identity import DedupableTrigger
from triggers.pg import SourceError, read_only, refuse_writable_role, shared_pool, target_for
from triggers.polling import channel_names, listening, one_or_many, poll_until

STATEMENT_TIMEOUT = 60.0


async def sql_condition(
    source: asyncpg.Connection | asyncpg.Pool,
    sql: str,
    parameters: Sequence[Any],
    failure_sql: str | None,
    failure_parameters: Sequence[Any],
) -> dict[str, Any] | None:
    async def reads(conn: asyncpg.Connection) -> dict[str, Any] | None:
        if failure_sql:
            # Two statements of the author's in one transaction: the first must not be able to end it
            # (COMMIT) or turn it read-write (SET TRANSACTION READ WRITE works only before the first query,
            # so one runs first) and so let the second write.
            await conn.fetchval("SELECT 1", timeout=STATEMENT_TIMEOUT)
            failed = await conn.fetchval(failure_sql, *failure_parameters, timeout=STATEMENT_TIMEOUT)
            _still_in_transaction(conn, "failure_sql")
            if failed:
                return {"status": "failed", "message": "the failure condition holds"}
        if await conn.fetchval(sql, *parameters, timeout=STATEMENT_TIMEOUT):
            return {"status": "success", "message": "the condition holds"}
        return None

    return await read_only(source, reads)


def _still_in_transaction(conn: asyncpg.Connection, argument: str) -> None:
    if not conn.is_in_transaction():
        raise SourceError(
            f"{argument} ended the read-only transaction (COMMIT, ROLLBACK): a sensor's SQL may only read"
        )


class SqlConditionTrigger(DedupableTrigger, BaseTrigger):
    calls_sync_sdk = False  # connections and comms are asked with await: no greenback portal needed
    identity_kwargs = ("conn_id", "sql", "parameters", "failure_sql", "failure_parameters")
    # a group listens on every channel any of its members listens on (a NOTIFY is never dropped)
    execution_merge = {"notify_channel": "union", "read_only_role": "any"}
    # never the SQL itself: it may hold a rendered secret (a fingerprint tells two statements apart)
    wait_description = "a true answer from {conn_id} to query {sql!h}"
    # rendered in the triggerer when the task starts there (start_from_trigger)
    template_fields = ("sql", "parameters", "failure_sql", "failure_parameters")

    def __init__(
        self,
        conn_id: str,
        sql: str,
        *,
        parameters: Sequence[Any] = (),
        failure_sql: str | None = None,
        failure_parameters: Sequence[Any] = (),
        poll_interval: float = 60.0,
        notify_channel: str | Sequence[str] | None = None,
        read_only_role: bool = False,
    ) -> None:
        super().__init__()
        self.conn_id, self.sql, self.failure_sql = conn_id, sql, failure_sql
        # the connection reaches Airflow's metadata database: refuse a login that could write there
        self.read_only_role = bool(read_only_role)
        self.parameters, self.failure_parameters = list(parameters), list(failure_parameters)
        self.poll_interval = float(poll_interval)
        self.notify_channel = one_or_many(channel_names(notify_channel))

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            "triggers.sql_condition.SqlConditionTrigger",
            {
                "conn_id": self.conn_id,
                "sql": self.sql,
                "parameters": self.parameters,
                "failure_sql": self.failure_sql,
                "failure_parameters": self.failure_parameters,
                "poll_interval": self.poll_interval,
                "notify_channel": self.notify_channel,
                "read_only_role": self.read_only_role,
            },
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        target = await target_for(self.conn_id, patience=CONNECTION_PATIENCE)
        role_checked = not self.read_only_role

        async def check() -> dict[str, Any] | None:
            nonlocal role_checked
            pool = await shared_pool(target)
            if not role_checked:  # once per trigger: a SourceError ends the wait with the cause
                await refuse_writable_role(pool, self.conn_id)
                role_checked = True
            return await sql_condition(
                pool, self.sql, self.parameters, self.failure_sql, self.failure_parameters
            )

        async with listening(target, self.notify_channel) as hint:
            payload = await poll_until(check, poll_interval=self.poll_interval, log=self.log, hint=hint)
        yield TriggerEvent(payload)
