"""External producers: one asset event per SUCCESS row of an ETL load-status table.

``TableStatusTrigger`` is an asset-watcher trigger (``BaseEventTrigger``). Every asset that watches the same
status table shares one poll loop through Airflow 3.3's shared streams: one producer per status table and
process reads new rows, and each watcher keeps the rows of its own ``table_name``.

Exactly once, through restarts: the stream runs in *ack mode*. A row's position is written to a durable
watermark (``dataset_bridge.status_watermark`` in the watched database, or in ``watermark_conn_id``'s) only
after Airflow confirmed the asset event derived from it was stored in the metadata database. A triggerer
that dies before that re-reads the row after restart (nothing lost); the window between "stored" and
"watermark written" is closed by the row's ``idempotency_key`` in the event payload, which the smart
triggerer records in the same transaction as the asset event and never emits twice (the stock triggerer
would repeat such an event once).

Each table keeps its own watermark, read when its first watcher subscribes in a process, so watchers of
one status table may run on different triggerers without one advancing past rows the other has not
emitted. A table seen for the first time starts after its newest row (``start_from="latest"``) or from
the beginning (``"earliest"``).

Rows are read in ``id_column`` order, which must follow commit order (true for a single ETL writer; with
concurrent writers a row committed late with a lower id would be skipped). Malformed rows (no table name,
an unknown status) are skipped with a warning and never block later rows.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections import defaultdict
from collections.abc import AsyncIterator, Hashable, Sequence
from importlib import resources
from typing import Any

import asyncpg
import structlog
from airflow.triggers.base import BaseEventTrigger, TriggerEvent
from airflow.triggers.shared_stream import AdvanceItem, SharedStreamProducer

from triggers.connections import CONNECTION_PATIENCE
from triggers.identity import DeclaresIdentity
from triggers.pg import backoff_seconds, is_permanent, shared_pool, target_for
from triggers.polling import listening
from triggers.table_load import FAILED, START, SUCCESS, quote_identifier

log = structlog.get_logger(__name__)

CLASSPATH = "dataset_bridge.status_table.TableStatusTrigger"
# created when missing in the database watched (it is not the bridge's: no migrations there)
WATERMARK_DDL = resources.files("dataset_bridge").joinpath("sql/status_watermark.sql").read_text()
KNOWN_STATUSES = {SUCCESS, START, FAILED}
BATCH = 1000


class StatusSource:
    """Where rows are read: the status table and its columns, validated at construction (parse time)."""

    def __init__(
        self, status_table: str, table_column: str, status_column: str, time_column: str, id_column: str
    ) -> None:
        self.status_table = status_table
        self.table = quote_identifier(status_table, argument="status_table", qualified=True)
        self.columns = {
            "table_name": quote_identifier(table_column, argument="table_column"),
            "status": quote_identifier(status_column, argument="status_column"),
            "at": quote_identifier(time_column, argument="time_column"),
            "id": quote_identifier(id_column, argument="id_column"),
        }

    def rows_after(self) -> str:
        c = self.columns
        return (
            f"SELECT {c['id']} AS id, {c['table_name']} AS table_name, "
            f"upper({c['status']}::text) AS status, {c['at']} AS at "
            f"FROM {self.table} WHERE {c['id']} > $1 ORDER BY {c['id']} LIMIT {BATCH}"
        )

    def newest_id(self) -> str:
        c = self.columns
        return f"SELECT coalesce(max({c['id']}), 0) FROM {self.table} WHERE {c['table_name']} = $1"


class Watermarks:
    """Durable per-table positions: the last row id whose asset event Airflow has stored."""

    def __init__(self, pool: asyncpg.Pool, source: StatusSource) -> None:
        self.pool, self.source = pool, source

    async def ensure_schema(self) -> None:
        # concurrent CREATE ... IF NOT EXISTS can still collide on the catalog; serialise them
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock(7212400101)")
            await conn.execute(WATERMARK_DDL)

    async def position(self, table_name: str, start_from: str, data_pool: asyncpg.Pool) -> int:
        """The stored position, or a new one (after the newest row, or 0) stored at once."""
        key = (self.source.status_table, table_name)
        found = await self.pool.fetchval(
            "SELECT last_id FROM dataset_bridge.status_watermark WHERE status_table = $1 AND table_name = $2",
            *key,
        )
        if found is not None:
            return int(found)
        start = (
            0
            if start_from == "earliest"
            else int(await data_pool.fetchval(self.source.newest_id(), table_name))
        )
        await self.pool.execute(
            "INSERT INTO dataset_bridge.status_watermark (status_table, table_name, last_id) "
            "VALUES ($1, $2, $3) ON CONFLICT DO NOTHING",
            *key,
            start,
        )
        return int(
            await self.pool.fetchval(
                "SELECT last_id FROM dataset_bridge.status_watermark "
                "WHERE status_table = $1 AND table_name = $2",
                *key,
            )
        )

    async def advance(self, table_name: str, last_id: int) -> None:
        await self.pool.execute(
            "UPDATE dataset_bridge.status_watermark SET last_id = greatest(last_id, $3), updated_at = now() "
            "WHERE status_table = $1 AND table_name = $2",
            self.source.status_table,
            table_name,
            last_id,
        )


class _Subscribers:
    """Which tables have a watcher in this process, per stream; a new one wakes its producer."""

    def __init__(self) -> None:
        self.tables: dict[Hashable, dict[str, int]] = defaultdict(dict)
        self.wake: dict[Hashable, asyncio.Event] = defaultdict(asyncio.Event)
        self.emitted: set[tuple[Hashable, str, int]] = set()

    def mark_emitted(self, key: Hashable, table_name: str, row_id: int) -> None:
        self.emitted.add((key, table_name, row_id))

    def take_emitted(self, key: Hashable, broker_payload: tuple[str, int]) -> bool:
        entry = (key, *broker_payload)
        found = entry in self.emitted
        self.emitted.discard(entry)
        return found

    def add(self, key: Hashable, table_name: str) -> None:
        self.tables[key][table_name] = self.tables[key].get(table_name, 0) + 1
        self.wake[key].set()

    def remove(self, key: Hashable, table_name: str) -> None:
        count = self.tables[key].get(table_name, 0) - 1
        if count > 0:
            self.tables[key][table_name] = count
        else:
            self.tables[key].pop(table_name, None)

    def names(self, key: Hashable) -> set[str]:
        return set(self.tables.get(key, {}))


subscribers = _Subscribers()


class StatusRowProducer(SharedStreamProducer):
    """Reads new SUCCESS rows for the subscribed tables; advances each table's watermark once stored."""

    def __init__(self, kwargs: dict[str, Any]) -> None:
        self.trigger = TableStatusTrigger(**kwargs)
        self.key = self.trigger.shared_stream_key()
        self.watermarks: Watermarks | None = None
        self.positions: dict[str, int] = {}
        self.cursor: int | None = None
        self.warned: set[int] = set()
        # table -> the first row whose event was not confirmed stored; the watermark waits for it
        self.blocked: dict[str, int] = {}
        # tables to read again from their durable watermark (their blocked row is re-emitted)
        self.rewind: set[str] = set()

    def get_advance_lane(self, broker_payload: Any) -> Hashable:
        return str(broker_payload[0])  # one lane per table: a slow watcher never holds back another table

    async def advance(self, batch: Sequence[AdvanceItem]) -> None:
        table_name = batch[0].broker_payload[0]
        if self.watermarks is None:
            return
        stored: list[int] = []
        for item in batch:
            row_id = item.broker_payload[1]
            # A watcher that left (shard handover, shutdown) without emitting counts as "acked" upstream;
            # only rows a watcher really turned into an event, stored, move the watermark. The mark is
            # taken whatever the outcome: a stale one must never vouch for a later emission that failed.
            marked = subscribers.take_emitted(self.key, item.broker_payload)
            emitted = marked and not item.outcome.failed
            held = self.blocked.get(table_name)
            if held is not None and row_id != held:
                continue  # nothing moves past a row not yet stored (the rows after it are read again)
            if not emitted:
                self._read_again(table_name, row_id)  # its first emission, or its re-emission, failed
                continue
            if held is not None:
                del self.blocked[table_name]  # its re-emission was stored
            stored.append(row_id)
        if stored:
            await self._store(table_name, max(stored))

    def _read_again(self, table_name: str, row_id: int) -> None:
        """Read this table again from its watermark, now, while it is watched: the row is emitted again
        (at least once into Airflow; its idempotency key keeps the asset event single)."""
        self.blocked[table_name] = row_id
        self.rewind.add(table_name)
        subscribers.wake[self.key].set()
        log.warning(
            "status row not confirmed stored; reading it again",
            row_id=row_id,
            status_table=self.trigger.source.status_table,
            table_name=table_name,
        )

    async def _store(self, table_name: str, last_id: int) -> None:
        assert self.watermarks is not None
        try:
            await self.watermarks.advance(table_name, last_id)
        except Exception as err:
            if is_permanent(err):
                raise
            # the next stored row writes a later position over this one; a restart meanwhile re-reads
            # rows whose asset events exist, and their idempotency keys keep them single
            log.warning(
                "watermark not written; the next stored row catches up",
                table_name=table_name,
                error=type(err).__name__,
            )

    async def open_stream(self) -> AsyncIterator[tuple[Any, Any]]:
        trigger = self.trigger
        source = await target_for(trigger.conn_id, patience=CONNECTION_PATIENCE)
        data = await shared_pool(source)
        marks = (
            await target_for(trigger.watermark_conn_id, patience=CONNECTION_PATIENCE)
            if trigger.watermark_conn_id
            else source
        )
        self.watermarks = Watermarks(await shared_pool(marks), trigger.source)
        await self._ensure_schema()
        wake = subscribers.wake[self.key]
        async with listening(source, trigger.notify_channel) as hint:
            failures = 0
            while True:
                await hint.arm()
                wake.clear()
                try:
                    rows = await self._read(data)
                except Exception as err:
                    failures += 1
                    await self._back_off(err, failures, "status table unreachable; backing off")
                    continue
                failures = 0
                for row in rows:
                    yield row, (row["table_name"], row["id"])
                if len(rows) < BATCH:
                    await _wait_any(hint.event, wake, trigger.poll_interval)

    async def _ensure_schema(self) -> None:
        """The watermark table, created if missing: a database away at the stream's start is waited for
        as in the loop below, not the failure of every watcher of this status table."""
        assert self.watermarks is not None
        failures = 0
        while True:
            try:
                await self.watermarks.ensure_schema()
                return
            except Exception as err:
                failures += 1
                await self._back_off(err, failures, "watermark table unreachable; backing off")

    async def _back_off(self, err: Exception, failures: int, message: str) -> None:
        """After the ``failures``-th error in a row: the check's own fault ends the stream (raised), any
        other is logged and waited out with jittered backoff capped at the poll interval."""
        if is_permanent(err):
            raise err
        log.warning(message, error=type(err).__name__, attempt=failures)
        await asyncio.sleep(backoff_seconds(failures, cap=self.trigger.poll_interval))

    async def _read(self, data: asyncpg.Pool) -> list[dict[str, Any]]:
        assert self.watermarks is not None
        watched = subscribers.names(self.key)
        for table_name in set(self.positions) - watched:
            # no watcher left here: forget the position, a later watcher starts from the durable watermark
            self.positions.pop(table_name)
            self.blocked.pop(table_name, None)
            self.rewind.discard(table_name)
        for table_name in self.rewind & watched:
            self.positions.pop(table_name, None)  # re-read below from the durable watermark
        self.rewind.clear()
        for table_name in watched - set(self.positions):
            start = await self.watermarks.position(table_name, self.trigger.start_from, data)
            self.positions[table_name] = start
            self.cursor = start if self.cursor is None else min(self.cursor, start)
        if self.cursor is None:
            return []
        fetched = await data.fetch(self.trigger.source.rows_after(), self.cursor)
        wanted: list[dict[str, Any]] = []
        for row in fetched:
            self.cursor = max(self.cursor, row["id"])
            if self._usable(row):
                self.positions[row["table_name"]] = row["id"]
                wanted.append(dict(row))
        return wanted

    def _usable(self, row: asyncpg.Record) -> bool:
        table_name, status = row["table_name"], row["status"]
        if table_name is None or status not in KNOWN_STATUSES:
            if row["id"] not in self.warned:
                self.warned.add(row["id"])
                log.warning(
                    "malformed status row skipped",
                    status_table=self.trigger.source.status_table,
                    row_id=row["id"],
                    has_table_name=table_name is not None,
                    status=status,
                )
            return False
        position = self.positions.get(table_name)
        return status == SUCCESS and position is not None and row["id"] > position


async def _wait_any(hint: asyncio.Event | None, wake: asyncio.Event, seconds: float) -> None:
    """Sleep until the poll interval ends, a NOTIFY arrives, or a new table subscribes."""
    waits = [asyncio.ensure_future(wake.wait())]
    if hint is not None:
        waits.append(asyncio.ensure_future(hint.wait()))
    try:
        await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waits:
            waiter.cancel()


class TableStatusTrigger(DeclaresIdentity, BaseEventTrigger):
    """Fires one asset event per SUCCESS row of ``table_name`` in an ETL load-status table.

    Use in an asset watcher::

        Asset("warehouse://dds/h_user", watchers=[AssetWatcher(
            name="h_user_loaded",
            trigger=TableStatusTrigger(conn_id="warehouse", table_name="dds.h_user",
                                       status_table="meta.detail_process_table_status"))])

    The event's payload (``extra["payload"]`` of the asset event) holds ``row_id``, ``table_name``,
    ``loaded_at`` and ``idempotency_key``. Column arguments match ``TableLoadSensor``; ``id_column`` is the
    row id that orders the table.
    """

    calls_sync_sdk = False  # connections are asked with await: no greenback portal needed
    # what shared_stream_key() is made of: the triggerer places watchers of one stream on one shard
    shared_stream_kwargs = (
        "conn_id",
        "status_table",
        "table_column",
        "status_column",
        "time_column",
        "id_column",
        "watermark_conn_id",
        "notify_channel",
    )
    wait_description = "new rows of {status_table} on {conn_id}"

    def __init__(
        self,
        conn_id: str,
        table_name: str,
        *,
        status_table: str = "meta.detail_process_table_status",
        table_column: str = "table_name",
        status_column: str = "status",
        time_column: str = "created_dttm",
        id_column: str = "id",
        start_from: str = "latest",
        poll_interval: float = 30.0,
        notify_channel: str | None = None,
        watermark_conn_id: str | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(conn_id, str) or not conn_id:
            raise ValueError(f"conn_id must be a non-empty connection id, got {conn_id!r}")
        if not isinstance(table_name, str) or not table_name:
            raise ValueError(f"table_name must be a non-empty table name, got {table_name!r}")
        if start_from not in ("latest", "earliest"):
            raise ValueError(f"start_from must be 'latest' or 'earliest', got {start_from!r}")
        if float(poll_interval) <= 0:
            raise ValueError(f"poll_interval must be positive, got {poll_interval!r}")
        if notify_channel is not None and not notify_channel.replace("_", "").isalnum():
            raise ValueError(f"notify_channel={notify_channel!r} is not a plain channel name")
        self.conn_id, self.table_name = conn_id, table_name
        self.source = StatusSource(status_table, table_column, status_column, time_column, id_column)
        self.columns = {
            "table_column": table_column,
            "status_column": status_column,
            "time_column": time_column,
            "id_column": id_column,
        }
        self.start_from = start_from
        self.poll_interval = float(poll_interval)
        self.notify_channel = notify_channel
        self.watermark_conn_id = watermark_conn_id

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return CLASSPATH, {
            "conn_id": self.conn_id,
            "table_name": self.table_name,
            "status_table": self.source.status_table,
            **self.columns,
            "start_from": self.start_from,
            "poll_interval": self.poll_interval,
            "notify_channel": self.notify_channel,
            "watermark_conn_id": self.watermark_conn_id,
        }

    def shared_stream_key(self) -> Hashable:
        # what is read and where positions are kept; not the table a watcher keeps
        return (
            CLASSPATH,
            self.conn_id,
            self.source.status_table,
            *sorted(self.columns.items()),
            self.watermark_conn_id,
            self.notify_channel,
        )

    @classmethod
    def create_shared_stream_producer(cls, kwargs: dict[str, Any]) -> SharedStreamProducer:
        return StatusRowProducer(kwargs)

    async def filter_shared_stream(self, shared_stream: AsyncIterator[Any]) -> AsyncIterator[TriggerEvent]:
        key = self.shared_stream_key()
        subscribers.add(key, self.table_name)
        try:
            async for row in shared_stream:
                if row["table_name"] == self.table_name:
                    yield TriggerEvent(self.payload(row))
                    # Resumed: Airflow's runner has taken the event and bound it to the row's persist
                    # confirmation. A watcher cancelled before that (a handover) never gets here, so the
                    # watermark cannot move past a row whose event was never handed over.
                    subscribers.mark_emitted(key, self.table_name, row["id"])
        finally:
            subscribers.remove(key, self.table_name)

    def payload(self, row: dict[str, Any]) -> dict[str, Any]:
        at = row["at"]
        return {
            "row_id": row["id"],
            "table_name": row["table_name"],
            "status": row["status"],
            "loaded_at": at.isoformat() if isinstance(at, dt.datetime) else str(at),
            "idempotency_key": f"{self.conn_id}/{self.source.status_table}/{row['id']}",
        }

    async def run(self) -> AsyncIterator[TriggerEvent]:
        """Only when a triggerer runs it outside a shared stream (``shared_stream_key()`` failed): the same
        reads for one watcher. Nothing confirms that an event was stored on this path, so the durable
        watermark is not moved: after a restart the rows since the watermark are emitted again (at least
        once; the smart triggerer keeps each asset event single by its idempotency key)."""
        producer = StatusRowProducer(self.serialize()[1])
        key = producer.key
        subscribers.add(key, self.table_name)
        try:
            async for row, (table_name, _row_id) in producer.open_stream():
                if table_name == self.table_name:
                    yield TriggerEvent(self.payload(row))
        finally:
            subscribers.remove(key, self.table_name)
