"""(e) An HTTP wait: proceed once a service reports itself healthy.

The demo points ``http_default``-style connection ``service_api`` at the local api-server's health
endpoint; ``json_path`` picks the field and ``expected_value`` is the value to wait for.
"""

from __future__ import annotations

import pendulum
from airflow.providers.standard.operators.empty import EmptyOperator
from airflow.sdk import DAG

from deferrables import HttpConditionSensor

with DAG(
    dag_id="wait_for_service",
    schedule=None,
    start_date=pendulum.datetime(2024, 1, 1),
    catchup=False,
    tags=["smart-triggerer-demo"],
):
    wait = HttpConditionSensor(
        task_id="wait_service_healthy",
        http_conn_id="service_api",
        endpoint="/api/v2/monitor/health",
        json_path="metadatabase.status",
        expected_value="healthy",
        poke_interval=3,
        timeout=3600,
    )
    wait >> EmptyOperator(task_id="call_service")
