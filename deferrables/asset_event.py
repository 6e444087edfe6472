"""AssetEventSensor: wait mid-DAG until an asset has an event newer than a given time."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from deferrables.sql_condition import SqlConditionSensor
from triggers.pg import SourceError, refuse_writable_role, target_for
from triggers.sql_condition import SqlConditionTrigger

# Parameterised: $1 is the asset's URI or name, $2 the time as text (templates render to text).
ASSET_EVENT_SQL = (
    "SELECT EXISTS (SELECT 1 FROM asset_event e JOIN asset a ON a.id = e.asset_id "
    "WHERE (a.uri = $1 OR a.name = $1) AND e.timestamp > CAST($2 AS text)::timestamptz)"
)


class AssetEventSensor(SqlConditionSensor):
    """Wait until ``asset`` (an ``Asset``, or its URI or name) has an event newer than ``since``.

    ``since`` is templated and defaults to this run's ``run_after``. The check reads Airflow's metadata
    database through the Postgres connection ``conn_id`` (default ``airflow_db``), with one parameterised
    query, so identical waits of many DAGs share one poll in the smart triggerer.
    """

    template_fields: Sequence[str] = ("since", "parameters")

    def __init__(
        self,
        *,
        asset: Any,
        since: str = "{{ dag_run.run_after }}",
        conn_id: str = "airflow_db",
        **kwargs: Any,
    ) -> None:
        reference = getattr(asset, "uri", None) or getattr(asset, "name", None) or asset
        if not isinstance(reference, str) or not reference:
            raise ValueError(f"asset must be an Asset or its URI or name, got {asset!r}")
        if not isinstance(since, str) or not since:
            raise ValueError(f"since must be a timestamp or a template, got {since!r}")
        super().__init__(conn_id=conn_id, sql=ASSET_EVENT_SQL, parameters=[reference, since], **kwargs)
        self.asset_reference, self.since = reference, since

    async def check(self) -> dict[str, Any] | None:
        """The worker-side check, after making sure ``conn_id`` cannot write to the metadata database."""
        import asyncpg

        target = await target_for(self.conn_id)
        conn = await asyncpg.connect(**target.connect_kwargs())
        try:
            await refuse_writable_role(conn, self.conn_id)
        except SourceError as err:
            return {"status": "error", "message": str(err)}
        finally:
            await conn.close()
        return await super().check()

    def trigger(self) -> SqlConditionTrigger:
        # also when the task starts in the triggerer (start_from_trigger): no worker step checks the role
        return SqlConditionTrigger(
            self.conn_id,
            self.sql,
            parameters=self.parameters,
            failure_sql=self.failure_sql,
            failure_parameters=self.failure_parameters,
            poll_interval=self.poke_interval,
            notify_channel=self.notify_channel,
            read_only_role=True,
        )

    def render_template_fields(self, context: Any, jinja_env: Any = None) -> None:
        super().render_template_fields(context, jinja_env)
        self.parameters = [self.asset_reference, str(self.since)]
