"""TableLoadSensor on the real stack under the smart triggerer: NOTIFY resumes a 300 s poller at once."""

from __future__ import annotations

import asyncio
import textwrap
import time

import asyncpg
import pytest

from devkit.devstack import AirflowStack
from tests.helpers.waiting import rows, wait_for

# also against the lowest supported Airflow (dev.py test --airflow): it exercises Airflow's internals
pytestmark = [pytest.mark.e2e, pytest.mark.lowest_airflow]

DAG = """
import pendulum
from airflow.sdk import DAG
from deferrables import TableLoadSensor

with DAG(dag_id="model_user", schedule=None, start_date=pendulum.datetime(2024, 1, 1), catchup=False):
    TableLoadSensor(task_id="wait_tables", conn_id="warehouse", required_tables=["dds.h_user", "dds.s_user"],
                    notify_channel="table_loads", poke_interval=300, timeout=600)
"""

STATUS_DDL = """
CREATE SCHEMA meta;
CREATE TABLE meta.detail_process_table_status (
    id bigserial PRIMARY KEY, table_name text, status text, created_dttm timestamptz NOT NULL DEFAULT now()
);
"""


def _checked_since(dsn: str, since: object) -> bool:
    """A check of the status table finished after ``since`` (database clock): each check returns its
    pooled connection, which asyncpg resets, so the reset is that connection's last query."""
    return bool(
        rows(
            dsn,
            "SELECT count(*) FROM pg_stat_activity WHERE state = 'idle' "
            "AND query ILIKE '%%RESET ALL%%' AND query_start > %s",
            since,
        )[0][0]
    )


def _now(dsn: str) -> object:
    return rows(dsn, "SELECT clock_timestamp()")[0][0]


async def _execute(dsn: str, *statements: str) -> None:
    conn = await asyncpg.connect(dsn)
    for statement in statements:
        await conn.execute(statement)
    await conn.close()


@pytest.mark.alone  # asserts a time bound: runs with no other test beside it (dev.py)
def test_notify_resumes_the_waiting_sensor_within_seconds(airflow_stack: AirflowStack, pg_db: str) -> None:
    asyncio.run(
        _execute(
            pg_db,
            STATUS_DDL,
            "INSERT INTO meta.detail_process_table_status "
            "(table_name, status) VALUES ('dds.h_user', 'START')",
        )
    )
    airflow_stack.config.extra["AIRFLOW_CONN_WAREHOUSE"] = pg_db
    (airflow_stack.config.dags_folder / "model_user.py").write_text(textwrap.dedent(DAG))
    airflow_stack.start_smart(["model_user"], env={"AIRFLOW__SMART_TRIGGERER__SHARDS": "16"})
    run_id = airflow_stack.trigger("model_user")
    airflow_dsn = airflow_stack.config.database_dsn

    def state() -> str | None:
        found = rows(airflow_dsn, "SELECT state FROM task_instance WHERE dag_id = 'model_user'")
        return found[0][0] if found else None

    wait_for(state, lambda s: s == "deferred", 120, "the sensor to defer")
    # past the resume hold (identities are stored after the deferral, on the database clock) ...
    wait_for(
        lambda: rows(
            airflow_dsn,
            "SELECT bool_and(clock_timestamp() - i.created_at > interval '7 s') "
            "FROM smart_triggerer.trigger_identity i JOIN task_instance ti "
            "ON ti.trigger_id = i.trigger_id WHERE ti.dag_id = 'model_user'",
        ),
        lambda r: r[0][0] is True,
        60,
        "the sensor's wait to be older than the resume hold",
    )
    # ... and listening, with a check after its LISTEN: from here on only a NOTIFY wakes it within 300 s
    listening = wait_for(
        lambda: rows(
            pg_db, "SELECT max(query_start) FROM pg_stat_activity WHERE query ILIKE 'LISTEN %%table_loads%%'"
        ),
        lambda r: r[0][0] is not None,
        60,
        "the trigger's LISTEN",
    )[0][0]
    wait_for(lambda: _checked_since(pg_db, listening), bool, 60, "a check after the LISTEN")
    notified = _now(pg_db)
    asyncio.run(
        _execute(
            pg_db,
            "INSERT INTO meta.detail_process_table_status (table_name, status) "
            "VALUES ('dds.h_user', 'SUCCESS'); NOTIFY table_loads",
        )
    )
    wait_for(lambda: _checked_since(pg_db, notified), bool, 30, "the check the NOTIFY woke")
    assert state() == "deferred"  # it looked, after the notification: one table is not enough
    started = time.monotonic()
    asyncio.run(
        _execute(
            pg_db,
            "INSERT INTO meta.detail_process_table_status (table_name, status) "
            "VALUES ('dds.s_user', 'SUCCESS'); NOTIFY table_loads",
        )
    )
    wait_for(state, lambda s: s != "deferred", 10, "NOTIFY to resume the sensor", interval=0.1)
    took = time.monotonic() - started
    assert airflow_stack.wait_for_run("model_user", run_id, timeout=120) == "success"
    print(f"NOTIFY to resume: {took:.2f}s")


START_DAG = """
import pendulum
from airflow.sdk import DAG
from deferrables import TableLoadSensor

with DAG(dag_id="model_profile", schedule=None, start_date=pendulum.datetime(2024, 1, 1), catchup=False):
    TableLoadSensor(task_id="wait_tables", conn_id="warehouse", required_tables=["dds.s_user_profile"],
                    since="{{ logical_date }}", start_from_trigger=True, poke_interval=1, timeout=600)
"""


def test_start_from_trigger_waits_without_a_worker(airflow_stack: AirflowStack, pg_db: str) -> None:
    asyncio.run(
        _execute(
            pg_db,
            STATUS_DDL,
            "INSERT INTO meta.detail_process_table_status "
            "(table_name, status, created_dttm) VALUES "
            "('dds.s_user_profile', 'SUCCESS', now() - interval '1 day')",
        )
    )
    airflow_stack.config.extra["AIRFLOW_CONN_WAREHOUSE"] = pg_db
    (airflow_stack.config.dags_folder / "model_profile.py").write_text(textwrap.dedent(START_DAG))
    airflow_stack.start_smart(["model_profile"], env={"AIRFLOW__SMART_TRIGGERER__SHARDS": "16"})
    run_id = airflow_stack.trigger("model_profile")
    dsn = airflow_stack.config.database_dsn
    query = "SELECT state, hostname FROM task_instance WHERE dag_id = 'model_profile'"
    deferred_at = _now(pg_db)
    found = wait_for(lambda: rows(dsn, query), lambda r: bool(r) and r[0][0] == "deferred", 120, "deferral")
    assert not found[0][1], "a worker ran the task before it deferred"
    wait_for(lambda: _checked_since(pg_db, deferred_at), bool, 60, "the trigger's first check")
    assert rows(dsn, query)[0][0] == "deferred"  # it looked: yesterday's load is older than the since
    asyncio.run(
        _execute(
            pg_db,
            "INSERT INTO meta.detail_process_table_status (table_name, status) "
            "VALUES ('dds.s_user_profile', 'SUCCESS')",
        )
    )
    assert airflow_stack.wait_for_run("model_profile", run_id, timeout=120) == "success"
