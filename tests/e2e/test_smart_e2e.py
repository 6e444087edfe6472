"""The smart triggerer on a real Airflow stack: dag-processor, scheduler, api-server, LocalExecutor."""

from __future__ import annotations

import datetime as dt
import shutil
import textwrap
import time
from pathlib import Path

import pytest

from devkit.devstack import AirflowStack

# also against the lowest supported Airflow (dev.py test --airflow): it exercises Airflow's internals
pytestmark = [pytest.mark.e2e, pytest.mark.lowest_airflow]

ENV = {"AIRFLOW__SMART_TRIGGERER__SHARDS": "16", "AIRFLOW__SMART_TRIGGERER__LEASE_SECONDS": "6"}

SENSORS_DAG = """
import pendulum
from airflow.sdk import DAG
from airflow.providers.standard.sensors.date_time import DateTimeSensorAsync

TARGETS = {targets!r}

with DAG(dag_id={dag_id!r}, schedule=None, start_date=pendulum.datetime(2024, 1, 1), catchup=False):
    for j in range(10):
        DateTimeSensorAsync(task_id=f"wait_{{j}}", target_time=TARGETS[j % len(TARGETS)],
                            start_from_trigger={start_from_trigger})
"""


def write_dag(folder: Path, dag_id: str, targets: list[str], start_from_trigger: bool = False) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    body = SENSORS_DAG.format(dag_id=dag_id, targets=targets, start_from_trigger=start_from_trigger)
    (folder / f"{dag_id}.py").write_text(textwrap.dedent(body))


# the targets are written into the DAG files once the stack is up (so its start costs no margin), TARGET_IN
# seconds ahead: all 30 tasks must have deferred by then, 10 through a LocalExecutor worker each (the two
# other DAGs start theirs straight in the triggerer). Beside two other Airflow stacks on a slow 2-core
# host, task starts failed on the execution API (connection refused, twice in four runs): it runs alone.
# Alone here, all 30 had deferred 17 s after the DAG files were written.
TARGET_IN = 50


@pytest.mark.alone
def test_thirty_sensors_on_four_targets_share_four_groups(airflow_stack: AirflowStack) -> None:
    airflow_stack.start_core()
    airflow_stack.start_smart_triggerer("smart-1", env=ENV)
    airflow_stack.start_smart_triggerer("smart-2", env=ENV)
    base = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=TARGET_IN)
    targets = [(base + dt.timedelta(seconds=k)).isoformat() for k in range(4)]
    dag_ids = ["dup_a", "dup_b", "dup_c"]
    for dag_id in dag_ids:
        # Two DAGs start their sensors straight in the triggerer (the trigger's kwargs carry the rendered
        # target_time, a worker's carry moment): no worker slot until they resume.
        write_dag(airflow_stack.config.dags_folder, dag_id, targets, start_from_trigger=dag_id != "dup_a")
    airflow_stack.wait_for_dags(dag_ids)
    runs = {}
    for dag_id in dag_ids:
        airflow_stack.unpause(dag_id)
        runs[dag_id] = airflow_stack.trigger(dag_id)

    seen: list[dict[str, int]] = []
    while dt.datetime.now(dt.UTC) < base - dt.timedelta(seconds=1):
        totals = airflow_stack.smart_status()["totals"]
        seen.append({"waiters": totals["waiters"], "groups": totals["groups"]})
        if totals["waiters"] == 30:
            break
        time.sleep(1)
    print(f"every sensor deferred {(base - dt.datetime.now(dt.UTC)).total_seconds():.1f} s before its target")
    assert seen and seen[-1] == {"waiters": 30, "groups": 4}, seen
    status = airflow_stack.smart_status()
    assert status["dedup_ratio"] == 7.5
    assert sum(i["healthy"] for i in status["instances"]) == 2

    for dag_id, run_id in runs.items():
        assert airflow_stack.wait_for_run(dag_id, run_id, timeout=180) == "success", (
            airflow_stack.task_states(dag_id, run_id)
        )
    totals = airflow_stack.smart_status()["totals"]
    assert totals["events_total"] == 4 and totals["resumed_total"] == 30 and totals["failures_total"] == 0


def test_bundled_example_and_triggers_that_fire_at_once(airflow_stack: AirflowStack) -> None:
    """Airflow's own deferrable example, and sensors whose trigger fires as soon as it runs (one stack).

    Airflow 3.3.2 fails a task resumed within ~5 s of its deferral (apache/airflow#71580 family). Every
    ``fire_at_once`` sensor waits on a moment already past, so its trigger fires at once; the smart
    triggerer holds each event until the deferral is old enough, and every task succeeds.
    """
    import airflow.example_dags

    source = Path(airflow.example_dags.__file__).parent / "example_time_delta_sensor_async.py"
    airflow_stack.config.dags_folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(source, airflow_stack.config.dags_folder)
    past = (dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)).isoformat()
    write_dag(airflow_stack.config.dags_folder, "fire_at_once", [past])
    airflow_stack.start_core()
    airflow_stack.start_smart_triggerer(env={**ENV, "AIRFLOW__WORKERS__MIN_HEARTBEAT_INTERVAL": "5"})
    example = "example_time_delta_sensor_async"
    airflow_stack.wait_for_dags([example, "fire_at_once"])
    runs = {}
    for dag_id in (example, "fire_at_once"):
        airflow_stack.unpause(dag_id)
        runs[dag_id] = airflow_stack.trigger(dag_id)
    for dag_id, run_id in runs.items():
        assert airflow_stack.wait_for_run(dag_id, run_id, timeout=180) == "success", (
            airflow_stack.task_states(dag_id, run_id)
        )
    assert airflow_stack.task_states(example, runs[example]) == {"wait": "success", "finish": "success"}
    assert set(airflow_stack.task_states("fire_at_once", runs["fire_at_once"]).values()) == {"success"}
    # the example's sensor defers only when its worker starts it within its 30 s (a busy host may not)
    example_deferred = deferred(airflow_stack, example, "wait")
    assert airflow_stack.smart_status()["totals"]["resumed_total"] == int(example_deferred) + 10


def deferred(stack: AirflowStack, dag_id: str, task_id: str) -> bool:
    """The task's own log (complete once its run finished) says it deferred."""
    logs = [
        path
        for path in (stack.config.home / "logs").rglob("*.log")
        if f"dag_id={dag_id}" in str(path)
        and f"task_id={task_id}" in str(path)
        and ".trigger." not in path.name
    ]
    assert logs, f"no task log for {dag_id}.{task_id}"
    return any("Pausing task as DEFERRED" in path.read_text(errors="replace") for path in logs)
