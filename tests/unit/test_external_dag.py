from __future__ import annotations

from typing import Any

import pytest

from deferrables import ExternalDagSensor
from triggers.external_dag import ExternalTarget

TARGET = ExternalTarget("producer", ("a", "b"), logical_date="2026-11-22T00:00:00+00:00")


def test_all_allowed_is_success() -> None:
    assert TARGET.judge({"a": "success", "b": "success"})["status"] == "success"  # type: ignore[index]


def test_waiting_while_any_task_is_not_final() -> None:
    assert TARGET.judge({"a": "success", "b": "running"}) is None
    assert TARGET.judge({}) is None


def test_failed_and_skipped_end_the_wait() -> None:
    """apache/airflow#47298: a deferrable external wait that ignores these hangs until its timeout."""
    failed = TARGET.judge({"a": "upstream_failed", "b": "skipped"})
    assert failed is not None and failed["status"] == "failed" and "a of producer" in failed["message"]
    skipped = TARGET.judge({"a": "success", "b": "skipped"})
    assert skipped is not None and skipped["status"] == "skipped"


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [({"external_dag_id": ""}, "external_dag_id"), ({"external_task_ids": "a"}, "external_task_ids"),
     ({"on_skipped": "ignore"}, "on_skipped"), ({"allowed_states": ["success", "failed"]}, "allowed_states"),
     ({"latest_run": True, "run_id": "r1"}, "latest_run")],
)
def test_bad_arguments_fail_at_parse_time(kwargs: dict[str, Any], argument: str) -> None:
    with pytest.raises(ValueError, match=argument):
        ExternalDagSensor(**{"task_id": "wait", "external_dag_id": "producer", **kwargs})


def test_start_from_trigger_keeps_the_logical_date_template_for_the_triggerer() -> None:
    from triggers import ExternalDagTrigger

    sensor = ExternalDagSensor(task_id="wait", external_dag_id="producer", external_task_ids=["load"],
                               start_from_trigger=True)
    args = sensor.start_trigger_args
    assert sensor.start_from_trigger and args is not None
    assert args.trigger_kwargs["logical_date"] == "{{ logical_date }}"
    assert "logical_date" in ExternalDagTrigger.template_fields
