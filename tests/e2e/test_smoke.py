"""The harness itself: a stock deferrable sensor succeeds on a real stack with the stock triggerer."""

from __future__ import annotations

import textwrap

import pytest

from devkit.devstack import AirflowStack, group_alive

# also against the lowest supported Airflow (dev.py test --airflow): it exercises Airflow's internals
pytestmark = [pytest.mark.e2e, pytest.mark.lowest_airflow]

SMOKE_DAG = """
import pendulum
from airflow.sdk import DAG
from airflow.providers.standard.sensors.date_time import DateTimeSensorAsync

# Rendered on the worker, so the trigger always has a few seconds left to wait (a TimeDeltaSensor counts
# from the logical date and is often already past by the time a worker starts). 8 s, not 2 s: Airflow
# 3.3.2 fails tasks whose trigger fires within ~5 s of deferral (apache/airflow#71580 family).
with DAG(dag_id="smoke_deferral", schedule=None, start_date=pendulum.datetime(2024, 1, 1), catchup=False):
    DateTimeSensorAsync(
        task_id="wait", target_time="{{ macros.datetime.utcnow() + macros.timedelta(seconds=8) }}"
    )
"""


def test_stock_deferrable_sensor_succeeds_and_stack_leaves_nothing(airflow_stack: AirflowStack) -> None:
    (airflow_stack.config.dags_folder / "smoke.py").write_text(textwrap.dedent(SMOKE_DAG))
    airflow_stack.start_core()
    airflow_stack.start_stock_triggerer()
    airflow_stack.wait_healthy(["triggerer"])
    airflow_stack.wait_for_dags(["smoke_deferral"])
    airflow_stack.unpause("smoke_deferral")

    run_id = airflow_stack.trigger("smoke_deferral")

    assert airflow_stack.wait_for_run("smoke_deferral", run_id, timeout=120) == "success"
    assert airflow_stack.task_states("smoke_deferral", run_id) == {"wait": "success"}
    # The sensor really deferred: the triggerer wrote the trigger's log for this task instance.
    trigger_logs = list((airflow_stack.config.home / "logs").rglob("*.trigger.*.log"))
    assert len(trigger_logs) == 1, trigger_logs
    assert "Trigger fired event" in trigger_logs[0].read_text()

    groups = [c.pid for c in airflow_stack.components]
    airflow_stack.stop()
    assert [pgid for pgid in groups if group_alive(pgid)] == []
