"""AssetEventSensor on the real stack: a mid-DAG wait ends when the producer's asset event lands."""

from __future__ import annotations

import textwrap

import pytest

from devkit.devstack import AirflowStack
from devkit.pgserver import reader_dsn
from tests.helpers.waiting import rows, wait_for

# also against the lowest supported Airflow (dev.py test --airflow): it exercises Airflow's internals
pytestmark = [pytest.mark.e2e, pytest.mark.lowest_airflow]

PRODUCER = """
import pendulum
from airflow.sdk import DAG, Asset, task

with DAG(dag_id="publisher", schedule=None, start_date=pendulum.datetime(2024, 1, 1), catchup=False):
    @task(outlets=[Asset("warehouse://dds/h_user")])
    def publish():
        return "loaded"

    publish()
"""

CONSUMER = """
import pendulum
from airflow.sdk import DAG, task
from deferrables import AssetEventSensor

with DAG(dag_id="reporter", schedule=None, start_date=pendulum.datetime(2024, 1, 1), catchup=False):
    @task
    def prepare():
        return 1

    wait = AssetEventSensor(task_id="wait_fresh_users", asset="warehouse://dds/h_user", poke_interval=2,
                            timeout=300)

    @task
    def report():
        return 2

    prepare() >> wait >> report()
"""


def test_mid_dag_wait_ends_on_the_asset_event(airflow_stack: AirflowStack) -> None:
    config = airflow_stack.config
    config.extra["AIRFLOW_CONN_AIRFLOW_DB"] = reader_dsn(config.database_dsn)
    (config.dags_folder / "publisher.py").write_text(textwrap.dedent(PRODUCER))
    (config.dags_folder / "reporter.py").write_text(textwrap.dedent(CONSUMER))
    airflow_stack.start_smart(["publisher", "reporter"], env={"AIRFLOW__SMART_TRIGGERER__SHARDS": "16"})
    run_id = airflow_stack.trigger("reporter")
    query = "SELECT state FROM task_instance WHERE dag_id = 'reporter' AND task_id = 'wait_fresh_users'"
    wait_for(lambda: rows(config.database_dsn, query), lambda r: r == [("deferred",)], 120, "deferral")

    airflow_stack.trigger("publisher")
    assert airflow_stack.wait_for_run("reporter", run_id, timeout=120) == "success"
    assert airflow_stack.task_states("reporter", run_id) == {
        "prepare": "success",
        "wait_fresh_users": "success",
        "report": "success",
    }
