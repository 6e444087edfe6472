"""ExternalDagSensor on the real stack: success, failed and skipped upstream tasks each end the wait."""

from __future__ import annotations

import datetime as dt
import textwrap
import time

import pytest

from devkit.devstack import AirflowStack
from devkit.pgserver import reader_dsn
from tests.helpers.waiting import rows, wait_for
from tests.integration.test_smart_triggerer import metrics

# also against the lowest supported Airflow (dev.py test --airflow): it exercises Airflow's internals
pytestmark = [pytest.mark.e2e, pytest.mark.lowest_airflow]

PRODUCER = """
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
"""

LATEST = """
import pendulum
from airflow.sdk import DAG
from deferrables import ExternalDagSensor

with DAG(dag_id="consumer_latest", schedule=None, start_date=pendulum.datetime(2024, 1, 1), catchup=False):
    ExternalDagSensor(task_id="wait_latest_ok", external_dag_id="producer", external_task_ids=["ok"],
                      latest_run=True, poke_interval=2, timeout=300)
"""

CONSUMER = """
import pendulum
from airflow.sdk import DAG
from deferrables import ExternalDagSensor

with DAG(dag_id="consumer", schedule=None, start_date=pendulum.datetime(2024, 1, 1), catchup=False):
    for name in ("ok", "broken", "skipped"):
        ExternalDagSensor(task_id=f"wait_{name}", external_dag_id="producer", external_task_ids=[name],
                          poke_interval=2, timeout=300, retries=0)
"""


def task_state_questions(url: str) -> int:
    return int(metrics(url)["smart_triggerer_task_state_requests_total"])


def assert_one_question_per_tick(url: str) -> None:
    """The three waits are on tasks of one DAG run: coalesced, they ask Airflow one GetTaskStates per
    tick (every 2 s), not one each (three per 2 s). Once all three run, five questions take four ticks
    (8 s; 6 s allows a late join's tick); one per wait would take about 3 s. A slow host only makes the
    ticks later."""
    wait_for(lambda: metrics(url)["smart_triggerer_coroutines"], lambda n: n == 3, 60, "three coroutines")
    first = wait_for(lambda: task_state_questions(url), lambda n: n > 0, 60, "a first question")
    start = time.monotonic()
    wait_for(lambda: task_state_questions(url), lambda n: n >= first + 5, 120, "five more questions")
    assert time.monotonic() - start >= 3 * 2.0, "more than one task-state question per tick"


def test_external_waits_end_on_success_failure_and_skip(airflow_stack: AirflowStack) -> None:
    folder = airflow_stack.config.dags_folder
    (folder / "producer.py").write_text(textwrap.dedent(PRODUCER))
    (folder / "consumer.py").write_text(textwrap.dedent(CONSUMER))
    (folder / "consumer_latest.py").write_text(textwrap.dedent(LATEST))
    airflow_stack.config.extra["AIRFLOW_CONN_AIRFLOW_DB"] = reader_dsn(airflow_stack.config.database_dsn)
    triggerer = airflow_stack.start_smart(
        ["producer", "consumer", "consumer_latest"], env={"AIRFLOW__SMART_TRIGGERER__SHARDS": "16"}
    )
    when = dt.datetime.now(dt.UTC).replace(microsecond=0)
    consumer_run = airflow_stack.trigger("consumer", logical_date=when)
    dsn = airflow_stack.config.database_dsn
    query = "SELECT count(*) FROM task_instance WHERE dag_id = 'consumer' AND state = 'deferred'"
    wait_for(lambda: rows(dsn, query)[0][0], lambda n: n == 3, 120, "the three sensors deferred")
    assert_one_question_per_tick(triggerer.health_url(30))

    airflow_stack.trigger("producer", logical_date=when)
    assert airflow_stack.wait_for_run("consumer", consumer_run, timeout=180) == "failed"
    assert airflow_stack.task_states("consumer", consumer_run) == {
        "wait_ok": "success",
        "wait_broken": "failed",
        "wait_skipped": "skipped",
    }

    latest = airflow_stack.trigger("consumer_latest")  # the producer's run above is the latest one
    assert airflow_stack.wait_for_run("consumer_latest", latest, timeout=120) == "success"
