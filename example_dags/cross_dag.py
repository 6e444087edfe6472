"""(d) A cross-DAG wait: ``reporting`` waits for the ``etl_daily`` run of the same logical date.

ExternalDagSensor replaces ExternalTaskSensor: it checks once, then defers; every DAG waiting on the same
run shares one poll in the smart triggerer.
"""

from __future__ import annotations

import pendulum
from airflow.providers.standard.operators.empty import EmptyOperator
from airflow.sdk import DAG, task

from deferrables import ExternalDagSensor

with DAG(
    dag_id="etl_daily",
    schedule=None,
    start_date=pendulum.datetime(2024, 1, 1),
    catchup=False,
    tags=["smart-triggerer-demo"],
):

    @task
    def load_facts() -> str:
        return "loaded"

    load_facts()

with DAG(
    dag_id="reporting",
    schedule=None,
    start_date=pendulum.datetime(2024, 1, 1),
    catchup=False,
    tags=["smart-triggerer-demo"],
):
    wait = ExternalDagSensor(
        task_id="wait_etl_daily", external_dag_id="etl_daily", poke_interval=3, timeout=3600
    )
    wait >> EmptyOperator(task_id="publish_report")
