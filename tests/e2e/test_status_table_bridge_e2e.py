"""TableStatusTrigger on the real stack: status rows -> one asset event each -> the AND consumer runs once.

The watcher runs under the smart triggerer and under the stock one; restarts lose nothing and repeat
nothing; malformed rows are skipped and never block later rows.
"""

from __future__ import annotations

import asyncio
import signal
import textwrap

import asyncpg
import pytest

from devkit.devstack import AirflowStack
from tests.helpers.waiting import db_now, rows, scheduler_looped_since, wait_for

pytestmark = pytest.mark.e2e

DAGS = """
import pendulum
from airflow.providers.standard.operators.empty import EmptyOperator
from airflow.sdk import DAG, Asset, AssetWatcher
from dataset_bridge import TableStatusTrigger


def loaded(table):
    trigger = TableStatusTrigger(conn_id="warehouse", table_name=table, poll_interval=1)
    return Asset(f"warehouse://{table.replace('.', '/')}",
                 watchers=[AssetWatcher(name=f"{table.replace('.', '_')}_loaded", trigger=trigger)])


with DAG(dag_id="user_mart", schedule=(loaded("dds.h_user") & loaded("dds.s_user")),
         start_date=pendulum.datetime(2024, 1, 1), catchup=False):
    EmptyOperator(task_id="build")
"""

STATUS_DDL = """
CREATE SCHEMA meta;
CREATE TABLE meta.detail_process_table_status (
    id bigserial PRIMARY KEY, table_name text, status text, created_dttm timestamptz NOT NULL DEFAULT now()
);
"""


def _sql(dsn: str, *statements: str) -> None:
    async def run() -> None:
        conn = await asyncpg.connect(dsn)
        try:
            for statement in statements:
                await conn.execute(statement)
        finally:
            await conn.close()

    asyncio.run(run())


def _status(dsn: str, table: str | None, status: str) -> None:
    value = "NULL" if table is None else f"'{table}'"
    _sql(
        dsn, f"INSERT INTO meta.detail_process_table_status (table_name, status) VALUES ({value}, '{status}')"
    )


def _events(airflow_dsn: str) -> list[tuple[str, str]]:
    return [
        (r[0], r[1])
        for r in rows(
            airflow_dsn,
            "SELECT a.uri, CAST(e.extra AS jsonb) -> 'payload' ->> 'idempotency_key' "
            "FROM asset_event e JOIN asset a ON a.id = e.asset_id ORDER BY e.id",
        )
    ]


def _runs(airflow_dsn: str) -> int:
    return int(rows(airflow_dsn, "SELECT count(*) FROM dag_run WHERE dag_id = 'user_mart'")[0][0])


def _last_rows(dsn: str) -> dict[str, int]:
    """Each watched table's last SUCCESS row: a watermark there has read everything."""
    return {
        r[0]: int(r[1])
        for r in rows(
            dsn,
            "SELECT table_name, max(id) FROM meta.detail_process_table_status "
            "WHERE status = 'SUCCESS' AND table_name IN ('dds.h_user', 'dds.s_user') GROUP BY table_name",
        )
    }


def _watermarks(dsn: str) -> dict[str, int]:
    found = rows(dsn, "SELECT to_regclass('dataset_bridge.status_watermark') IS NOT NULL")[0][0]
    if not found:
        return {}
    found_rows = rows(dsn, "SELECT table_name, last_id FROM dataset_bridge.status_watermark")
    return {r[0]: int(r[1]) for r in found_rows}


def _prepare(stack: AirflowStack, pg_db: str) -> None:
    _sql(pg_db, STATUS_DDL)
    _status(pg_db, "dds.h_user", "SUCCESS")  # history: before the watcher existed, never an event
    stack.config.extra["AIRFLOW_CONN_WAREHOUSE"] = pg_db
    (stack.config.dags_folder / "user_mart.py").write_text(textwrap.dedent(DAGS))


def _wait_watching(pg_db: str) -> None:
    wait_for(
        lambda: _watermarks(pg_db),
        lambda w: set(w) == {"dds.h_user", "dds.s_user"},
        120,
        "both watchers to start (their watermarks)",
    )


def test_status_rows_make_one_event_each_and_the_and_consumer_runs_once(
    airflow_stack: AirflowStack, pg_db: str
) -> None:
    _prepare(airflow_stack, pg_db)
    smart = airflow_stack.start_smart(["user_mart"], env={"AIRFLOW__SMART_TRIGGERER__SHARDS": "8"})
    airflow_dsn = airflow_stack.config.database_dsn
    _wait_watching(pg_db)

    # malformed rows first: they must not block the SUCCESS rows behind them
    _status(pg_db, None, "SUCCESS")
    _status(pg_db, "dds.h_user", "WEIRD")
    _status(pg_db, "dds.h_user", "START")
    _status(pg_db, "dds.h_user", "SUCCESS")
    wait_for(lambda: _events(airflow_dsn), lambda e: len(e) == 1, 60, "the h_user event")
    scheduler_looped_since(airflow_dsn, db_now(airflow_dsn))  # it had the chance to act on h_user alone
    assert _runs(airflow_dsn) == 0, "the consumer ran before both tables were loaded"

    _status(pg_db, "dds.s_user", "SUCCESS")
    wait_for(lambda: _runs(airflow_dsn), lambda n: n == 1, 60, "one consumer run")
    events = _events(airflow_dsn)
    assert [uri for uri, _key in events] == ["warehouse://dds/h_user", "warehouse://dds/s_user"]
    assert all(key and key.startswith("warehouse/meta.detail_process_table_status/") for _uri, key in events)
    assert "malformed status row skipped" in smart.log_tail(200_000)

    # A crash between "event stored" and "watermark written": the stored state is exactly this one.
    smart.signal(signal.SIGKILL)
    wait_for(smart.running, lambda alive: not alive, 30, "the smart triggerer to die")
    _sql(
        pg_db,
        "UPDATE dataset_bridge.status_watermark SET last_id = last_id - 1 WHERE table_name = 'dds.s_user'",
    )
    # and a load that happens while no triggerer runs
    _status(pg_db, "dds.h_user", "SUCCESS")
    airflow_stack.start_smart_triggerer("smart-triggerer-2", env={"AIRFLOW__SMART_TRIGGERER__SHARDS": "8"})
    wait_for(lambda: _events(airflow_dsn), lambda e: len(e) >= 3, 120, "the load made while down")
    wait_for(
        lambda: _watermarks(pg_db),
        lambda w: w == _last_rows(pg_db),
        60,
        "every row to be acknowledged (the re-read one again)",
    )
    scheduler_looped_since(airflow_dsn, db_now(airflow_dsn))  # and acted on since
    events = _events(airflow_dsn)
    assert len(events) == 3, f"expected no loss and no duplicate, got {events}"
    assert len({key for _uri, key in events}) == 3
    assert _runs(airflow_dsn) == 1  # s_user has no new load: the AND consumer waits


def test_the_watcher_runs_under_the_stock_triggerer(airflow_stack: AirflowStack, pg_db: str) -> None:
    _prepare(airflow_stack, pg_db)
    airflow_stack.start_core()
    airflow_stack.start_stock_triggerer()
    airflow_stack.wait_for_dags(["user_mart"])
    airflow_stack.unpause("user_mart")
    airflow_dsn = airflow_stack.config.database_dsn
    _wait_watching(pg_db)
    _status(pg_db, "dds.s_user", "SUCCESS")
    _status(pg_db, "dds.h_user", "SUCCESS")
    wait_for(lambda: _runs(airflow_dsn), lambda n: n == 1, 90, "one consumer run")
    assert sorted(uri for uri, _key in _events(airflow_dsn)) == [
        "warehouse://dds/h_user",
        "warehouse://dds/s_user",
    ]
    # rows 2 and 3; advanced only after Airflow confirmed the events stored (ack mode, stock runner)
    wait_for(
        lambda: _watermarks(pg_db),
        lambda w: w == {"dds.s_user": 2, "dds.h_user": 3},
        60,
        "watermarks to advance",
    )
