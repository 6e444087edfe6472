"""(b) The warehouse pattern: each model waits on its required tables with one TableLoadSensor.

The demo scenario: ``SMART_DEMO_DAGS`` DAGs (default 20) of ``SMART_DEMO_TASKS`` models each (default
10) wait on ``SMART_DEMO_CONDITIONS`` distinct sets of tables (default 30), so many sensors in different
DAGs wait for the very same thing and the smart triggerer runs one poll per distinct wait. Each sensor
starts straight in the triggerer and ends there on success: no worker slot at all.
"""

from __future__ import annotations

import os

import pendulum
from airflow.sdk import DAG

from deferrables import TableLoadSensor

DAGS = int(os.environ.get("SMART_DEMO_DAGS", "20"))
TASKS = int(os.environ.get("SMART_DEMO_TASKS", "10"))
CONDITIONS = int(os.environ.get("SMART_DEMO_CONDITIONS", "30"))
POLL_SECONDS = float(os.environ.get("SMART_DEMO_POLL_SECONDS", "3"))


def table(index: int) -> str:
    return f"dds.table_{index % CONDITIONS:02d}"


def required_tables(condition: int) -> list[str]:
    """Condition k waits for two tables; every table is part of two conditions."""
    return [table(condition), table(condition + 7)]


def condition_of(dag_index: int, task_index: int) -> int:
    return (dag_index * TASKS + task_index) % CONDITIONS


for dag_index in range(DAGS):
    with DAG(
        dag_id=f"model_{dag_index:02d}",
        schedule=None,
        start_date=pendulum.datetime(2024, 1, 1),
        catchup=False,
        tags=["smart-triggerer-demo"],
        max_active_tasks=TASKS,
    ):
        for task_index in range(TASKS):
            TableLoadSensor(
                task_id=f"wait_model_{task_index:02d}",
                conn_id="warehouse",
                required_tables=required_tables(condition_of(dag_index, task_index)),
                poke_interval=POLL_SECONDS,
                timeout=3600,
                start_from_trigger=True,
                end_from_trigger=True,
            )
