"""Producer success -> exactly one asset event -> consumer DAG runs.

- ``TableStatusTrigger`` (status_table.py): an asset watcher over an ETL load-status table.
- ``task_success`` : unchanged producer DAGs, mapped task successes become asset events.
- ``reconcile``: asset events a consumer never consumed (apache/airflow#54659) are queued again.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dataset_bridge.status_table import TableStatusTrigger

__all__ = ["TableStatusTrigger"]


def __getattr__(name: str) -> Any:
    # Lazily (PEP 562): importing the package for the `dataset-bridge` command must not import Airflow,
    # so that a setting Airflow cannot read at import is reported in one line by the command's guard.
    if name == "TableStatusTrigger":
        from dataset_bridge.status_table import TableStatusTrigger

        return TableStatusTrigger
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
