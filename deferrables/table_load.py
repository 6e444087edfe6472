"""TableLoadSensor: one sensor waits for n tables recorded in an ETL load-status table."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any

from airflow.sdk.exceptions import AirflowException

from deferrables.base import CheckThenDeferSensor
from triggers.table_load import StatusTable, TableLoadTrigger, check_once, parse_since


class TableLoadSensor(CheckThenDeferSensor):
    """Wait until every ``required_tables`` entry's latest status in ``status_table`` is SUCCESS.

    A latest FAILED fails the task (skips it with ``soft_fail``); a latest START (mid-load) or no row keeps
    waiting. ``since`` (templated, e.g. ``"{{ data_interval_end }}"``) ignores loads not newer than it.
    With ``notify_channel``, a ``NOTIFY <channel>`` from the ETL wakes the wait at once; polling every
    ``poke_interval`` stays the safety net. With ``end_from_trigger`` (and ``start_from_trigger``) a
    successful wait ends in the triggerer and never uses a worker slot. Deferrable by default: the worker
    checks once, then hands the wait to the triggerer, where identical waits of other DAGs share one poll.
    """

    template_fields: Sequence[str] = ("required_tables", "since")
    ui_color = "#e3f2e8"

    def __init__(
        self,
        *,
        conn_id: str,
        required_tables: Sequence[str],
        status_table: str = "meta.detail_process_table_status",
        table_column: str = "table_name",
        status_column: str = "status",
        time_column: str = "created_dttm",
        since: str | dt.datetime | None = None,
        notify_channel: str | None = None,
        start_from_trigger: bool = False,
        end_from_trigger: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if not isinstance(conn_id, str) or not conn_id:
            raise ValueError(f"conn_id must be a non-empty connection id, got {conn_id!r}")
        if isinstance(required_tables, str) or not required_tables:
            raise ValueError(
                f"required_tables must be a non-empty list of table names, got {required_tables!r}"
            )
        if not all(isinstance(t, str) and t for t in required_tables):
            raise ValueError(f"required_tables must hold non-empty strings, got {list(required_tables)!r}")
        if notify_channel is not None and not notify_channel.replace("_", "").isalnum():
            raise ValueError(
                f"notify_channel={notify_channel!r} is not a plain channel name (letters, digits, _)"
            )
        self.conn_id = conn_id
        self.required_tables = list(required_tables)
        self.status = StatusTable(status_table, table_column, status_column, time_column)
        if isinstance(since, str) and "{{" not in since and "{%" not in since:
            try:
                parse_since(since)
            except ValueError as err:
                raise ValueError(f"since={since!r} is neither a timestamp nor a template: {err}") from err
        self.since = since
        self.notify_channel = notify_channel
        self.end_from_trigger = end_from_trigger
        if start_from_trigger:
            self._start_in_triggerer(self._trigger(str(since) if since else None))

    def _since(self) -> dt.datetime | None:
        try:
            return parse_since(self.since)
        except ValueError as err:
            raise AirflowException(f"since={self.since!r} is not a timestamp: {err}") from err

    async def check(self) -> dict[str, Any] | None:
        state = await check_once(self.conn_id, self.status, self.required_tables, self._since())
        if not state.done:
            self.log.info("%s", state.message())
            return None
        return state.payload()

    def trigger(self) -> TableLoadTrigger:
        since = self._since()
        return self._trigger(since.isoformat() if since else None)

    def _trigger(self, since: str | None) -> TableLoadTrigger:
        return TableLoadTrigger(
            self.conn_id,
            self.required_tables,
            status_table=self.status.status_table,
            table_column=self.status.table_column,
            status_column=self.status.status_column,
            time_column=self.status.time_column,
            since=since,
            poll_interval=self.poke_interval,
            notify_channel=self.notify_channel,
            end_from_trigger=self.end_from_trigger,
        )
