"""(c) A consumer scheduled on several tables' assets (AND): it runs once both are loaded.

Each asset is fed by a ``TableStatusTrigger`` watching the ETL load-status table: one asset event per
SUCCESS row, exactly once. No sensor, no polling task: the scheduler starts the DAG.
"""

from __future__ import annotations

import pendulum
from airflow.providers.standard.operators.empty import EmptyOperator
from airflow.sdk import DAG, Asset, AssetWatcher

from dataset_bridge import TableStatusTrigger


def loaded(table_name: str) -> Asset:
    trigger = TableStatusTrigger(conn_id="warehouse", table_name=table_name, poll_interval=2)
    return Asset(
        name=f"{table_name}_loaded",
        uri=f"warehouse://{table_name.replace('.', '/')}",
        watchers=[AssetWatcher(name=f"{table_name.replace('.', '_')}_watcher", trigger=trigger)],
    )


with DAG(
    dag_id="user_mart",
    schedule=(loaded("dds.h_user") & loaded("dds.s_user")),
    start_date=pendulum.datetime(2024, 1, 1),
    catchup=False,
    tags=["smart-triggerer-demo"],
):
    EmptyOperator(task_id="build_user_mart")
