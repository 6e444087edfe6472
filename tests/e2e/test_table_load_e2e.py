"""TableLoadSensor on the real stack under the smart triggerer: NOTIFY resumes a 300 s poller at once."""

from __future__ import annotations

import asyncio
import textwrap
import time

import asyncpg
import pytest

from tests.helpers.waiting import rows, wait_for
from triggerer.devstack import AirflowStack

pytestmark = pytest.mark.e2e

DAG = '''
import pendulum
from airflow.sdk import DAG
from deferrables import TableLoadSensor

with DAG(dag_id="model_user", schedule=None, start_date=pendulum.datetime(2024, 1, 1), catchup=False):
    TableLoadSensor(task_id="wait_tables", conn_id="warehouse", required_tables=["dds.h_user", "dds.s_user"],
                    notify_channel="table_loads", poke_interval=300, timeout=600)
'''

STATUS_DDL = """
CREATE SCHEMA meta;
CREATE TABLE meta.detail_process_table_status (
    id bigserial PRIMARY KEY, table_name text, status text, created_dttm timestamptz NOT NULL DEFAULT now()
);
"""


async def _execute(dsn: str, *statements: str) -> None:
    conn = await asyncpg.connect(dsn)
    for statement in statements:
        await conn.execute(statement)
    await conn.close()


def test_notify_resumes_the_waiting_sensor_within_seconds(airflow_stack: AirflowStack, pg_db: str) -> None:
    asyncio.run(_execute(pg_db, STATUS_DDL, "INSERT INTO meta.detail_process_table_status "
                                            "(table_name, status) VALUES ('dds.h_user', 'START')"))
    airflow_stack.config.extra["AIRFLOW_CONN_WAREHOUSE"] = pg_db
    (airflow_stack.config.dags_folder / "model_user.py").write_text(textwrap.dedent(DAG))
    airflow_stack.start_smart(["model_user"], env={"AIRFLOW__SMART_TRIGGERER__SHARDS": "16"})
    run_id = airflow_stack.trigger("model_user")
    airflow_dsn = airflow_stack.config.database_dsn

    def state() -> str | None:
        found = rows(airflow_dsn, "SELECT state FROM task_instance WHERE dag_id = 'model_user'")
        return found[0][0] if found else None

    wait_for(state, lambda s: s == "deferred", 120, "the sensor to defer")
    time.sleep(8)  # past the resume hold, and the trigger is polling (every 300 s) and listening
    asyncio.run(_execute(pg_db, "INSERT INTO meta.detail_process_table_status (table_name, status) "
                                "VALUES ('dds.h_user', 'SUCCESS')"))
    time.sleep(2)
    assert state() == "deferred"  # one table is not enough, and no notification was sent
    started = time.monotonic()
    asyncio.run(_execute(pg_db, "INSERT INTO meta.detail_process_table_status (table_name, status) "
                                "VALUES ('dds.s_user', 'SUCCESS'); NOTIFY table_loads"))
    wait_for(state, lambda s: s != "deferred", 10, "NOTIFY to resume the sensor", interval=0.1)
    took = time.monotonic() - started
    assert airflow_stack.wait_for_run("model_user", run_id, timeout=120) == "success"
    print(f"NOTIFY to resume: {took:.2f}s")


START_DAG = '''
import pendulum
from airflow.sdk import DAG
from deferrables import TableLoadSensor

with DAG(dag_id="model_profile", schedule=None, start_date=pendulum.datetime(2024, 1, 1), catchup=False):
    TableLoadSensor(task_id="wait_tables", conn_id="warehouse", required_tables=["dds.s_user_profile"],
                    since="{{ logical_date }}", start_from_trigger=True, poke_interval=1, timeout=600)
'''


def test_start_from_trigger_waits_without_a_worker(airflow_stack: AirflowStack, pg_db: str) -> None:
    asyncio.run(_execute(pg_db, STATUS_DDL, "INSERT INTO meta.detail_process_table_status "
                                            "(table_name, status, created_dttm) VALUES "
                                            "('dds.s_user_profile', 'SUCCESS', now() - interval '1 day')"))
    airflow_stack.config.extra["AIRFLOW_CONN_WAREHOUSE"] = pg_db
    (airflow_stack.config.dags_folder / "model_profile.py").write_text(textwrap.dedent(START_DAG))
    airflow_stack.start_smart(["model_profile"], env={"AIRFLOW__SMART_TRIGGERER__SHARDS": "16"})
    run_id = airflow_stack.trigger("model_profile")
    dsn = airflow_stack.config.database_dsn
    query = "SELECT state, hostname FROM task_instance WHERE dag_id = 'model_profile'"
    found = wait_for(lambda: rows(dsn, query), lambda r: bool(r) and r[0][0] == "deferred", 120, "deferral")
    assert not found[0][1], "a worker ran the task before it deferred"
    time.sleep(4)
    assert rows(dsn, query)[0][0] == "deferred"  # yesterday's load is older than the rendered since
    asyncio.run(_execute(pg_db, "INSERT INTO meta.detail_process_table_status (table_name, status) "
                                "VALUES ('dds.s_user_profile', 'SUCCESS')"))
    assert airflow_stack.wait_for_run("model_profile", run_id, timeout=120) == "success"
