"""SqlConditionSensor: wait until a parameterised SQL query returns a truthy first cell."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import asyncpg

from deferrables.base import CheckThenDeferSensor
from triggers.pg import target_for
from triggers.sql_condition import SqlConditionTrigger, sql_condition


class SqlConditionSensor(CheckThenDeferSensor):
    """Wait until ``sql`` (bind values in ``parameters``, as $1, $2, ...) returns a truthy first cell.

    ``failure_sql`` ends the wait as failed when it returns a truthy first cell. Rendered templates are
    text: cast them in SQL (``CAST($1 AS text)::date``). Unlike Airflow's
    ``SqlSensor`` there are no ``success``/``failure`` Python callables: the wait runs in the triggerer,
    whose arguments must serialise to plain data, so callables are refused when the DAG is parsed.
    """

    template_fields: Sequence[str] = ("sql", "parameters", "failure_sql", "failure_parameters")
    template_ext: Sequence[str] = (".sql",)

    def __init__(
        self,
        *,
        conn_id: str,
        sql: str,
        parameters: Sequence[Any] | None = None,
        failure_sql: str | None = None,
        failure_parameters: Sequence[Any] | None = None,
        notify_channel: str | None = None,
        success: Any = None,
        failure: Any = None,
        start_from_trigger: bool = False,
        **kwargs: Any,
    ) -> None:
        for name, value in (("success", success), ("failure", failure)):
            if value is not None:
                raise ValueError(
                    f"{name}= takes no Python callable here: the wait runs in the triggerer and "
                    "must serialise; put the condition in sql / failure_sql instead"
                )
        super().__init__(**kwargs)
        if not isinstance(conn_id, str) or not conn_id:
            raise ValueError(f"conn_id must be a non-empty connection id, got {conn_id!r}")
        if not isinstance(sql, str) or not sql.strip():
            raise ValueError("sql must be a non-empty SQL statement")
        if failure_sql is not None and (not isinstance(failure_sql, str) or not failure_sql.strip()):
            raise ValueError("failure_sql must be a non-empty SQL statement or None")
        for name, values in (("parameters", parameters), ("failure_parameters", failure_parameters)):
            if values is not None and (isinstance(values, str | bytes) or not isinstance(values, Sequence)):
                raise ValueError(f"{name} must be a list of bind values, got {type(values).__name__}")
        self.conn_id, self.sql, self.failure_sql = conn_id, sql, failure_sql
        self.parameters = list(parameters or [])
        self.failure_parameters = list(failure_parameters or [])
        self.notify_channel = notify_channel
        if start_from_trigger:
            self._start_in_triggerer(self.trigger())

    async def check(self) -> dict[str, Any] | None:
        target = await target_for(self.conn_id)
        conn = await asyncpg.connect(**target.connect_kwargs())
        try:
            return await sql_condition(
                conn, self.sql, self.parameters, self.failure_sql, self.failure_parameters
            )
        except asyncpg.PostgresError as err:
            return {"status": "error", "message": f"{type(err).__name__}: {err}"}
        finally:
            await conn.close()

    def trigger(self) -> SqlConditionTrigger:
        return SqlConditionTrigger(
            self.conn_id,
            self.sql,
            parameters=self.parameters,
            failure_sql=self.failure_sql,
            failure_parameters=self.failure_parameters,
            poll_interval=self.poke_interval,
            notify_channel=self.notify_channel,
        )
