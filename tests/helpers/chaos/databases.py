"""The warehouse the triggers watch, and the audit trail of ours in the metadata database."""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Sequence
from typing import Any

import psycopg2

from tests.helpers.chaos.constants import (
    ASSET_CHANNEL,
    CONSUME,
    FLAG,
    FLAG_CHANNEL,
    LOAD_CHANNEL,
    NUL_NOTE,
    POISON,
    STATUS_TABLE,
    TABLE,
)
from tests.helpers.chaos.plan import Identity
from tests.helpers.chaos.source import KeySource

WAREHOUSE_DDL = f"""
CREATE SCHEMA meta;
CREATE TABLE {STATUS_TABLE} (
    id bigserial PRIMARY KEY, table_name text, status text,
    created_dttm timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE SCHEMA chaos;
CREATE TABLE chaos.flags (
    name text PRIMARY KEY, value boolean NOT NULL DEFAULT false, flipped_at timestamptz
);
CREATE TABLE chaos.http_flip (key text PRIMARY KEY, at timestamptz NOT NULL);
-- the consume-once source: a message is queued once (the record of it, with its time, stays in
-- chaos.queued) and taken once (deleted from chaos.queue; who took it, when: chaos.queue_taken)
CREATE TABLE chaos.queued (key text PRIMARY KEY, message text NOT NULL, at timestamptz NOT NULL);
CREATE TABLE chaos.queue (key text PRIMARY KEY, message text NOT NULL);
CREATE TABLE chaos.queue_taken (key text NOT NULL, message text NOT NULL, taker text NOT NULL,
                                at timestamptz NOT NULL);
"""

# Every transition of a task instance into or out of DEFERRED, every rewrite of a resolved one's
# next_method/next_kwargs and every deletion, with the database clock and the writing transaction.
AUDIT_DDL = """
CREATE SCHEMA chaos;
CREATE TABLE chaos.ti_audit (
    seq bigserial PRIMARY KEY,
    ti_id uuid NOT NULL,
    at timestamptz NOT NULL,
    op text NOT NULL,
    old_state text, new_state text,
    old_trigger_id integer, new_trigger_id integer,
    next_method text, next_kwargs jsonb, trigger_timeout timestamptz,
    txid bigint NOT NULL,
    writer text,  -- the writing session's application name: the instance process (smart-3.13), or Airflow
    shard integer  -- the shard of the trigger it left, when the write is a resume (for a failure's analysis)
);
CREATE INDEX ti_audit_ti ON chaos.ti_audit (ti_id);
CREATE FUNCTION chaos.audit_ti() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    op text;
    shard_of integer;
BEGIN
    IF TG_OP = 'DELETE' THEN
        INSERT INTO chaos.ti_audit (ti_id, at, op, old_state, old_trigger_id, txid, writer)
        VALUES (OLD.id, clock_timestamp(), 'deleted', OLD.state, OLD.trigger_id, txid_current(),
                current_setting('application_name'));
        RETURN OLD;
    END IF;
    IF NEW.state = 'deferred' AND OLD.state IS DISTINCT FROM 'deferred' THEN
        op := 'deferred';
    ELSIF OLD.state = 'deferred' AND NEW.state IS DISTINCT FROM 'deferred' THEN
        op := 'resolved';
    ELSIF NEW.state IS DISTINCT FROM 'deferred' AND (OLD.next_method IS DISTINCT FROM NEW.next_method
            OR OLD.next_kwargs::text IS DISTINCT FROM NEW.next_kwargs::text) THEN
        op := 'rewritten';
    ELSE
        RETURN NEW;
    END IF;
    -- the smart triggerer's schema exists once an instance has started (the seeding comes before)
    IF OLD.trigger_id IS NOT NULL AND to_regclass('smart_triggerer.trigger_identity') IS NOT NULL THEN
        EXECUTE 'SELECT shard FROM smart_triggerer.trigger_identity WHERE trigger_id = $1'
            INTO shard_of USING OLD.trigger_id;
    END IF;
    INSERT INTO chaos.ti_audit (ti_id, at, op, old_state, new_state, old_trigger_id, new_trigger_id,
                                next_method, next_kwargs, trigger_timeout, txid, writer, shard)
    VALUES (NEW.id, clock_timestamp(), op, OLD.state, NEW.state, OLD.trigger_id, NEW.trigger_id,
            NEW.next_method, to_jsonb(NEW.next_kwargs), NEW.trigger_timeout, txid_current(),
            current_setting('application_name'), shard_of);
    RETURN NEW;
END $$;
CREATE TRIGGER chaos_ti_audit AFTER UPDATE OR DELETE ON task_instance
    FOR EACH ROW EXECUTE FUNCTION chaos.audit_ti();
CREATE TABLE chaos.asset_event_audit (event_id integer PRIMARY KEY, at timestamptz NOT NULL, txid bigint,
                                      app text);
CREATE FUNCTION chaos.audit_asset_event() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO chaos.asset_event_audit (event_id, at, txid, app)
    VALUES (NEW.id, clock_timestamp(), txid_current(), current_setting('application_name'));
    RETURN NEW;
END $$;
CREATE TRIGGER chaos_asset_event_audit AFTER INSERT ON asset_event
    FOR EACH ROW EXECUTE FUNCTION chaos.audit_asset_event();
"""

ASSET_DAG_FILE = '''
"""Chaos run: assets fed by status-table watchers; the consumer only makes them active (no scheduler)."""
import functools
import operator

import pendulum
from airflow.providers.standard.operators.empty import EmptyOperator
from airflow.sdk import DAG, Asset, AssetWatcher
from dataset_bridge import TableStatusTrigger
from tests.helpers.chaos_triggers import SourceWatchTrigger


def watched(k):
    trigger = TableStatusTrigger(conn_id="warehouse", table_name=f"asset.a{{k}}", status_table={status!r},
                                 start_from="earliest", poll_interval={poll!r},
                                 notify_channel={channel!r} if k % 2 == 0 else None)
    return Asset(f"chaos://status/a{{k}}", watchers=[AssetWatcher(name=f"a{{k}}_loaded", trigger=trigger)])


# one event whose extra jsonb cannot hold (the source answers it with a NUL in a string)
nul = Asset({nul_uri!r}, watchers=[AssetWatcher(
    name="nul_extra",
    trigger=SourceWatchTrigger(url={source_url!r}, key={nul_key!r}, poll_interval={poll!r}))])

with DAG(dag_id={dag_id!r},
         schedule=functools.reduce(operator.or_, [watched(k) for k in range({count})] + [nul]),
         start_date=pendulum.datetime(2024, 1, 1), catchup=False, is_paused_upon_creation=False):
    EmptyOperator(task_id="consume")
'''


def doubled_resumes(dsn: str) -> dict[str, int]:
    """Task instances that the audit trail (``AUDIT_DDL``, installed before the waits resumed) shows
    written more than once as they left DEFERRED (resolved, then rewritten or resolved again): ti id ->
    writes. A resume the fencing let through twice shows here, whatever any counter says."""
    found = execute(
        dsn,
        "SELECT ti_id::text, count(*) FROM chaos.ti_audit WHERE op IN ('resolved', "
        "'rewritten') GROUP BY ti_id HAVING count(*) > 1",
        fetch=True,
    )
    return {ti_id: int(writes) for ti_id, writes in found}


def execute(dsn: str, sql: str, params: Any = None, *, fetch: bool = False, retry_for: float = 30.0) -> Any:
    """One statement in its own transaction, retried while PostgreSQL is unreachable (bounded)."""
    deadline = time.monotonic() + retry_for
    while True:
        try:
            conn = psycopg2.connect(dsn, connect_timeout=5)
        except psycopg2.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
            continue
        try:
            with conn, conn.cursor() as cur:
                cur.execute(sql, params)
                return cur.fetchall() if fetch else None
        finally:
            conn.close()


def db_now(dsn: str) -> dt.datetime:
    value: dt.datetime = execute(dsn, "SELECT clock_timestamp()", fetch=True)[0][0]
    return value


class Warehouse:
    """The harness's writes to the watched database: each flip records its time with the DB clock.

    One writer, one statement at a time: status-row ids follow commit order, as TableStatusTrigger needs.
    Flips are idempotent, so a retry after a dropped connection never writes a second condition.
    """

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn

    def create(self, flags: Sequence[str]) -> None:
        execute(self.dsn, WAREHOUSE_DDL)
        if flags:
            execute(self.dsn, "INSERT INTO chaos.flags (name) SELECT unnest(%s::text[])", (list(flags),))

    def flip(self, ident: Identity, source: KeySource) -> None:
        if ident.kind == TABLE:
            execute(
                self.dsn,
                f"INSERT INTO {STATUS_TABLE} (table_name, status) SELECT %(t)s, 'SUCCESS' "
                f"WHERE NOT EXISTS (SELECT 1 FROM {STATUS_TABLE} WHERE table_name = %(t)s "
                f"AND status = 'SUCCESS'); NOTIFY {LOAD_CHANNEL}",
                {"t": ident.name},
            )
        elif ident.kind == FLAG:
            execute(
                self.dsn,
                "UPDATE chaos.flags SET value = true, flipped_at = clock_timestamp() "
                f"WHERE name = %s AND NOT value; NOTIFY {FLAG_CHANNEL}",
                (ident.name,),
            )
        elif ident.kind == CONSUME:
            execute(
                self.dsn,
                "WITH q AS (INSERT INTO chaos.queued (key, message, at) VALUES (%s, %s, "
                "clock_timestamp()) ON CONFLICT DO NOTHING RETURNING key, message) "
                "INSERT INTO chaos.queue (key, message) SELECT key, message FROM q",
                (ident.name, ident.message),
            )
        else:
            # recorded first, then served: the recorded time is never later than the real flip
            execute(
                self.dsn,
                "INSERT INTO chaos.http_flip (key, at) VALUES (%s, clock_timestamp()) ON CONFLICT DO NOTHING",
                (ident.name,),
            )
            if ident.kind == POISON:
                source.events[ident.name] = {"key": ident.name, "note": NUL_NOTE}
            source.ready.add(ident.name)

    def status_row(self, table_name: str, status: str) -> None:
        execute(
            self.dsn,
            f"INSERT INTO {STATUS_TABLE} (table_name, status) VALUES (%s, %s); NOTIFY {ASSET_CHANNEL}",
            (table_name, status),
        )

    def condition_times(self) -> dict[str, dt.datetime]:
        """When each table, flag and HTTP key flipped, by name."""
        found: dict[str, dt.datetime] = {}
        queries = (
            f"SELECT table_name, min(created_dttm) FROM {STATUS_TABLE} "
            "WHERE status = 'SUCCESS' AND table_name LIKE 'load.%' GROUP BY table_name",
            "SELECT name, flipped_at FROM chaos.flags WHERE value",
            "SELECT key, at FROM chaos.http_flip",
            "SELECT key, at FROM chaos.queued",
        )
        for query in queries:
            found.update({r[0]: r[1] for r in execute(self.dsn, query, fetch=True)})
        return found

    def takes(self) -> tuple[dict[str, list[tuple[str, str]]], list[str]]:
        """Each queued message's takes (message, taker), by key; and the keys still in the queue."""
        taken: dict[str, list[tuple[str, str]]] = {}
        for key, message, taker in execute(
            self.dsn, "SELECT key, message, taker FROM chaos.queue_taken ORDER BY at", fetch=True
        ):
            taken.setdefault(key, []).append((message, taker))
        left = [r[0] for r in execute(self.dsn, "SELECT key FROM chaos.queue ORDER BY key", fetch=True)]
        return taken, left

    def asset_rows(self) -> list[tuple[int, str, str, dt.datetime]]:
        return [
            (int(r[0]), r[1], r[2], r[3])
            for r in execute(
                self.dsn,
                f"SELECT id, table_name, status, created_dttm FROM {STATUS_TABLE} "
                "WHERE table_name LIKE 'asset.%' ORDER BY id",
                fetch=True,
            )
        ]
