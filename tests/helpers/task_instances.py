"""Airflow's ``TaskInstanceDTO`` (what a runner workload carries for a task), for tests and benches."""

from __future__ import annotations

from typing import Any

from airflow.executors.workloads.task import TaskInstanceDTO

DEFAULTS: dict[str, Any] = {
    "id": "0190b4a3-2c7e-7a4e-9d35-6c1f0e0a2b11",
    "dag_id": "d",
    "run_id": "r",
    "task_id": "t",
    "try_number": 1,
    "map_index": -1,
    "dag_version_id": "0190b4a3-2c7e-7a4e-9d35-6c1f0e0a2b12",
    "pool_slots": 1,
    "queue": "default",
    "priority_weight": 1,
}


def task_instance_dto(**fields: Any) -> TaskInstanceDTO:
    """A valid DTO: Airflow's required fields with plain values, ``fields`` in their place."""
    return TaskInstanceDTO.model_validate({**DEFAULTS, **fields})
