"""(a) The same wait in three teams' DAGs: the users hub and satellite loaded today.

Stock Airflow runs three coroutines and three polls; the smart triggerer runs one. These sensors use the
default path (check once in a worker, then defer), the path every existing deferrable sensor takes.
"""

from __future__ import annotations

import pendulum
from airflow.sdk import DAG

from deferrables import TableLoadSensor

for team in ("finance", "marketing", "operations"):
    with DAG(
        dag_id=f"{team}_users_report",
        schedule=None,
        start_date=pendulum.datetime(2024, 1, 1),
        catchup=False,
        tags=["smart-triggerer-demo"],
    ):
        TableLoadSensor(
            task_id="wait_users_loaded",
            conn_id="warehouse",
            required_tables=["dds.h_user", "dds.s_user"],
            poke_interval=3,
            timeout=3600,
        )
