"""SqlConditionSensor and HttpConditionSensor on the real stack under the smart triggerer."""

from __future__ import annotations

import asyncio
import textwrap

import asyncpg
import pytest

from devkit.devstack import AirflowStack
from tests.helpers.http_server import ControlledServer
from tests.helpers.waiting import rows, wait_for

pytestmark = pytest.mark.e2e

DAG = """
import pendulum
from airflow.sdk import DAG
from deferrables import HttpConditionSensor, SqlConditionSensor

with DAG(dag_id="sql_and_http", schedule=None, start_date=pendulum.datetime(2024, 1, 1), catchup=False):
    SqlConditionSensor(task_id="wait_sql", conn_id="warehouse", poke_interval=2, timeout=300,
                       sql="SELECT bool_or(done) FROM loads WHERE name = $1", parameters=["orders"])
    HttpConditionSensor(task_id="wait_http", http_conn_id="jobs", endpoint="/api/job", poke_interval=2,
                        timeout=300, json_path="job.state", expected_value="done")
"""


async def _execute(dsn: str, sql: str) -> None:
    conn = await asyncpg.connect(dsn)
    await conn.execute(sql)
    await conn.close()


def test_sql_and_http_sensors_defer_and_resume(airflow_stack: AirflowStack, pg_db: str) -> None:
    asyncio.run(_execute(pg_db, "CREATE TABLE loads (name text, done boolean)"))
    with ControlledServer().running() as server:
        airflow_stack.config.extra.update({"AIRFLOW_CONN_WAREHOUSE": pg_db, "AIRFLOW_CONN_JOBS": server.url})
        (airflow_stack.config.dags_folder / "sql_and_http.py").write_text(textwrap.dedent(DAG))
        airflow_stack.start_smart(["sql_and_http"], env={"AIRFLOW__SMART_TRIGGERER__SHARDS": "16"})
        run_id = airflow_stack.trigger("sql_and_http")
        dsn = airflow_stack.config.database_dsn
        query = "SELECT task_id, state FROM task_instance WHERE dag_id = 'sql_and_http'"
        wait_for(
            lambda: dict(rows(dsn, query)),
            lambda s: s == {"wait_sql": "deferred", "wait_http": "deferred"},
            120,
            "both deferred",
        )
        asyncio.run(_execute(pg_db, "INSERT INTO loads VALUES ('orders', true)"))
        server.state = {"job": {"state": "done"}}
        assert airflow_stack.wait_for_run("sql_and_http", run_id, timeout=120) == "success"
        assert airflow_stack.task_states("sql_and_http", run_id) == {
            "wait_sql": "success",
            "wait_http": "success",
        }
        assert airflow_stack.smart_status()["totals"]["resumed_total"] == 2
