"""Waiting for ETL loads recorded in a load-status table (``table_name``, ``status``, timestamp).

One parameterised query per check covers all required tables: the latest row of each. With ``since``,
a latest row at or before ``since`` counts as no row at all, whatever its status. Then: the tables are
loaded when every latest status is SUCCESS; a latest FAILED fails the wait; a latest START (mid-load) or
a missing row keeps waiting. The same check serves the trigger (on a
shared pool) and the sensor's worker-side check (on a short-lived connection).

Identifiers (status table, columns) cannot be query parameters: they are validated against a strict
pattern and quoted; every value (table names, ``since``) is a parameter.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import asyncpg
from airflow.triggers.base import BaseTrigger, TaskSuccessEvent, TriggerEvent

from triggers.coalesce import KeyedBatch, coalescing, shared_batch
from triggers.connections import CONNECTION_PATIENCE
from triggers.identity import DedupableTrigger
from triggers.pg import PgTarget, read_only, shared_listener, shared_pool, target_for
from triggers.polling import channel_names, listening, one_or_many, poll_until

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
SUCCESS, START, FAILED = "SUCCESS", "START", "FAILED"


def quote_identifier(name: str, *, argument: str, qualified: bool = False) -> str:
    """``schema.table`` -> ``"schema"."table"``; anything else than plain identifiers is refused."""
    parts = name.split(".") if qualified else [name]
    if not name or len(parts) > 2 or not all(_IDENTIFIER.match(p) for p in parts):
        kind = "a table name like schema.table" if qualified else "a column name"
        raise ValueError(f"{argument}={name!r} is not {kind} (letters, digits, _)")
    return ".".join(f'"{p}"' for p in parts)


@dataclass(frozen=True)
class StatusTable:
    """Where loads are recorded; validated at construction so a bad name fails at DAG parse time."""

    status_table: str = "meta.detail_process_table_status"
    table_column: str = "table_name"
    status_column: str = "status"
    time_column: str = "created_dttm"

    def __post_init__(self) -> None:
        self.query()  # validates every identifier

    def query(self) -> str:
        table = quote_identifier(self.status_table, argument="status_table", qualified=True)
        name = quote_identifier(self.table_column, argument="table_column")
        status = quote_identifier(self.status_column, argument="status_column")
        at = quote_identifier(self.time_column, argument="time_column")
        return (
            f"SELECT DISTINCT ON ({name}) {name} AS table_name, upper({status}::text) AS status, {at} AS at "
            f"FROM {table} WHERE {name} = ANY($1::text[]) ORDER BY {name}, {at} DESC"
        )


@dataclass
class LoadState:
    """Outcome of one check of the required tables."""

    status: str  # "success", "waiting" or "failed"
    loaded: list[str] = field(default_factory=list)
    loading: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.status != "waiting"

    def message(self) -> str:
        if self.status == "failed":
            return f"latest load FAILED for {', '.join(self.failed)}"
        if self.status == "success":
            return f"all {len(self.loaded)} required tables loaded"
        parts = [
            f"{label}: {', '.join(names)}"
            for label, names in (("loading", self.loading), ("not loaded", self.missing))
            if names
        ]
        return "waiting for " + "; ".join(parts)

    def payload(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "message": self.message(),
            "loaded": self.loaded,
            "failed": self.failed,
        }


def evaluate(rows: Sequence[Any], required: Sequence[str], since: dt.datetime | None) -> LoadState:
    latest = {row["table_name"]: row for row in rows}
    state = LoadState(status="waiting")
    for table in required:
        row = latest.get(table)
        if row is None or (since is not None and _aware(row["at"]) <= since):
            # only loads newer than ``since`` count, whatever their status: yesterday's unfixed FAILED
            # load must not fail today's wait
            state.missing.append(table)
        elif row["status"] == FAILED:
            state.failed.append(table)
        elif row["status"] == SUCCESS:
            state.loaded.append(table)
        else:
            state.loading.append(table)  # START, or any status still in progress
    if state.failed:
        state.status = "failed"
    elif len(state.loaded) == len(required):
        state.status = "success"
    return state


def _aware(value: dt.datetime) -> dt.datetime:
    return value if value.tzinfo else value.replace(tzinfo=dt.UTC)


async def check_tables(
    conn: asyncpg.Connection | asyncpg.Pool,
    spec: StatusTable,
    required: Sequence[str],
    since: dt.datetime | None,
) -> LoadState:
    rows = await read_only(conn, lambda c: c.fetch(spec.query(), list(required)))
    return evaluate(rows, required, since)


async def check_once(
    conn_id: str, spec: StatusTable, required: Sequence[str], since: dt.datetime | None
) -> LoadState:
    """The worker-side check: one short-lived connection, no pool left behind."""
    target = await target_for(conn_id)
    conn = await asyncpg.connect(**target.connect_kwargs())
    try:
        return await check_tables(conn, spec, required, since)
    finally:
        await conn.close()


def parse_since(since: str | dt.datetime | None) -> dt.datetime | None:
    if since is None or since == "":
        return None
    value = since if isinstance(since, dt.datetime) else dt.datetime.fromisoformat(str(since))
    return _aware(value)


def _normalized_since(since: str | None) -> str | None:
    """An ISO timestamp in one canonical form; a template is kept as is (rendered in the triggerer)."""
    if not since:
        return None
    if "{{" in since or "{%" in since:
        return since
    parsed = parse_since(since)
    return parsed.isoformat() if parsed else None


class TableLoadTrigger(DedupableTrigger, BaseTrigger):
    """Fires once the required tables are loaded (or one failed). Push: optional LISTEN channel."""

    # end_from_trigger is identity: members of one group must agree on whether the wait ends here
    calls_sync_sdk = False  # connections and comms are asked with await: no greenback portal needed
    identity_kwargs = (
        "conn_id",
        "required_tables",
        "status_table",
        "table_column",
        "status_column",
        "time_column",
        "since",
        "end_from_trigger",
    )
    # a group listens on every channel any of its members listens on (a NOTIFY is never dropped)
    execution_merge = {"notify_channel": "union"}
    wait_description = "{required_tables} loaded[ since {since}] ({status_table} on {conn_id})"
    # rendered in the triggerer when the task starts there (start_from_trigger)
    template_fields = ("required_tables", "since")

    def __init__(
        self,
        conn_id: str,
        required_tables: Sequence[str],
        *,
        status_table: str = "meta.detail_process_table_status",
        table_column: str = "table_name",
        status_column: str = "status",
        time_column: str = "created_dttm",
        since: str | None = None,
        poll_interval: float = 60.0,
        notify_channel: str | Sequence[str] | None = None,
        end_from_trigger: bool = False,
    ) -> None:
        super().__init__()
        self.conn_id = conn_id
        self.end_from_trigger = bool(end_from_trigger)
        # sorted and de-duplicated: the same set of tables is the same wait
        self.required_tables = sorted(set(required_tables))
        self.spec = StatusTable(status_table, table_column, status_column, time_column)
        self.since = _normalized_since(since)
        self.poll_interval = float(poll_interval)
        self.notify_channel = one_or_many(channel_names(notify_channel))

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            "triggers.table_load.TableLoadTrigger",
            {
                "conn_id": self.conn_id,
                "required_tables": self.required_tables,
                "status_table": self.spec.status_table,
                "table_column": self.spec.table_column,
                "status_column": self.spec.status_column,
                "time_column": self.spec.time_column,
                "since": self.since,
                "poll_interval": self.poll_interval,
                "notify_channel": self.notify_channel,
                "end_from_trigger": self.end_from_trigger,
            },
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        target = await target_for(self.conn_id, patience=CONNECTION_PATIENCE)
        since = parse_since(self.since)
        self.required_tables = sorted(set(self.required_tables))
        if coalescing():
            payload = await self._wait_in_batch(target, since)
        else:
            payload = await self._wait_alone(target, since)
        if self.end_from_trigger and payload.get("status") == "success":
            # the task ends here, successful, without a worker; failures still go to the worker, which
            # applies soft_fail and the failure callbacks
            yield TaskSuccessEvent()
            return
        yield TriggerEvent(payload)

    async def _wait_alone(self, target: PgTarget, since: dt.datetime | None) -> dict[str, Any]:
        """One query per check for this wait's own tables (``coalesce_checks`` off)."""

        async def check() -> dict[str, Any] | None:
            state = await check_tables(await shared_pool(target), self.spec, self.required_tables, since)
            return state.payload() if state.done else None

        async with listening(target, self.notify_channel) as hint:
            return await poll_until(check, poll_interval=self.poll_interval, log=self.log, hint=hint)

    async def _wait_in_batch(self, target: PgTarget, since: dt.datetime | None) -> dict[str, Any]:
        """Every wait of this process on the same status table shares one query per tick."""
        batch = status_batch(target, self.spec, self.conn_id)
        async with batch.join(
            self.required_tables, self.poll_interval, channel_names(self.notify_channel)
        ) as member:
            while True:
                answer = await member.next()
                if answer.error is not None:
                    return {"status": "error", "message": answer.error}
                state = evaluate(answer.rows, self.required_tables, since)
                if state.done:
                    return state.payload()


def status_batch(target: PgTarget, spec: StatusTable, conn_id: str) -> KeyedBatch:
    """The running loop's batch for this status table on this connection."""
    statement = spec.query()

    async def fetch(keys: Sequence[str]) -> Sequence[Any]:
        return await read_only(await shared_pool(target), lambda c: c.fetch(statement, list(keys)))

    def make() -> KeyedBatch:
        return KeyedBatch(
            f"{spec.status_table} on {conn_id}",
            fetch,
            key_of=lambda row: row["table_name"],
            listener=lambda channel: shared_listener(target, channel),
        )

    return shared_batch(("table_load", target.key, statement), make)
