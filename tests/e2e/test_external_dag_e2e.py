"""ExternalDagSensor on the real stack: success, failed and skipped upstream tasks each end the wait."""

from __future__ import annotations

import datetime as dt
import textwrap

import pytest

from devkit.devstack import AirflowStack
from devkit.pgserver import reader_dsn
from tests.helpers.waiting import rows, wait_for

pytestmark = pytest.mark.e2e

PRODUCER = '''
import pendulum
from airflow.sdk import DAG, task
from airflow.sdk.exceptions import AirflowSkipException

with DAG(dag_id="producer", schedule=None, start_date=pendulum.datetime(2024, 1, 1), catchup=False):
    @task
    def ok():
        return 1

    @task(retries=0)
    def broken():
        raise RuntimeError("producer failed")

    @task
    def skipped():
        raise AirflowSkipException("nothing to do")

    ok(); broken(); skipped()
'''

LATEST = '''
import pendulum
from airflow.sdk import DAG
from deferrables import ExternalDagSensor

with DAG(dag_id="consumer_latest", schedule=None, start_date=pendulum.datetime(2024, 1, 1), catchup=False):
    ExternalDagSensor(task_id="wait_latest_ok", external_dag_id="producer", external_task_ids=["ok"],
                      latest_run=True, poke_interval=2, timeout=300)
'''

CONSUMER = '''
import pendulum
from airflow.sdk import DAG
from deferrables import ExternalDagSensor

with DAG(dag_id="consumer", schedule=None, start_date=pendulum.datetime(2024, 1, 1), catchup=False):
    for name in ("ok", "broken", "skipped"):
        ExternalDagSensor(task_id=f"wait_{name}", external_dag_id="producer", external_task_ids=[name],
                          poke_interval=2, timeout=300, retries=0)
'''


def test_external_waits_end_on_success_failure_and_skip(airflow_stack: AirflowStack) -> None:
    folder = airflow_stack.config.dags_folder
    (folder / "producer.py").write_text(textwrap.dedent(PRODUCER))
    (folder / "consumer.py").write_text(textwrap.dedent(CONSUMER))
    (folder / "consumer_latest.py").write_text(textwrap.dedent(LATEST))
    airflow_stack.config.extra["AIRFLOW_CONN_AIRFLOW_DB"] = reader_dsn(
        airflow_stack.config.database_dsn)
    airflow_stack.start_smart(["producer", "consumer", "consumer_latest"],
                              env={"AIRFLOW__SMART_TRIGGERER__SHARDS": "16"})
    when = dt.datetime.now(dt.UTC).replace(microsecond=0)
    consumer_run = airflow_stack.trigger("consumer", logical_date=when)
    dsn = airflow_stack.config.database_dsn
    query = "SELECT count(*) FROM task_instance WHERE dag_id = 'consumer' AND state = 'deferred'"
    wait_for(lambda: rows(dsn, query)[0][0], lambda n: n == 3, 120, "the three sensors deferred")

    airflow_stack.trigger("producer", logical_date=when)
    assert airflow_stack.wait_for_run("consumer", consumer_run, timeout=180) == "failed"
    assert airflow_stack.task_states("consumer", consumer_run) == {
        "wait_ok": "success", "wait_broken": "failed", "wait_skipped": "skipped"}

    latest = airflow_stack.trigger("consumer_latest")  # the producer's run above is the latest one
    assert airflow_stack.wait_for_run("consumer_latest", latest, timeout=120) == "success"
