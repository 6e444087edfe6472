"""Producer success -> exactly one asset event -> consumer DAG runs.

- ``TableStatusTrigger`` (status_table.py): an asset watcher over an ETL load-status table.
- ``task_success`` : unchanged producer DAGs, mapped task successes become asset events.
- ``reconcile``: asset events a consumer never consumed (apache/airflow#54659) are queued again.
"""

from dataset_bridge.status_table import TableStatusTrigger

__all__ = ["TableStatusTrigger"]
