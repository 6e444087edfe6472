"""The dataset bridge on the real stack: unchanged producer DAGs, crashes, two bridges, held-back events."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from devkit.devstack import AirflowStack, Component
from tests.helpers.waiting import db_now, queried_since, rows, scheduler_looped_since, wait_for

pytestmark = pytest.mark.e2e

PRODUCER = """
import pendulum
from airflow.sdk import DAG, task

# An unchanged producer: no outlets declared anywhere.
with DAG(dag_id="etl_orders", schedule=None, start_date=pendulum.datetime(2024, 1, 1), catchup=False):
    @task
    def load_orders():
        return "loaded"

    load_orders()
"""

CONSUMERS = """
import pendulum
from airflow.providers.standard.operators.empty import EmptyOperator
from airflow.sdk import DAG, Asset

with DAG(dag_id="orders_report", schedule=[Asset("warehouse://dds/orders")],
         start_date=pendulum.datetime(2024, 1, 1), catchup=False):
    EmptyOperator(task_id="report")

with DAG(dag_id="race_consumer", schedule=[Asset(name="race", uri="warehouse://dds/race")],
         start_date=pendulum.datetime(2024, 1, 1), catchup=False):
    EmptyOperator(task_id="consume")
"""

REPO = Path(__file__).parents[2]


def _count(dsn: str, query: str, *params: object) -> int:
    return int(rows(dsn, query, *params)[0][0])


def _orders_events(dsn: str) -> int:
    return _count(
        dsn,
        "SELECT count(*) FROM asset_event e JOIN asset a ON a.id = e.asset_id "
        "WHERE a.uri = 'warehouse://dds/orders'",
    )


def _runs(dsn: str, dag_id: str) -> int:
    return _count(dsn, "SELECT count(*) FROM dag_run WHERE dag_id = %s", dag_id)


def _bridges_passed_since(dsn: str, bridges: list[Component], since: object) -> None:
    """Each bridge ran statements after ``since`` twice, a pass (--interval 1 s) apart."""
    for bridge in bridges:
        pids = [p.pid for p in bridge.tree()]
        # the defaults bind this loop's values; mypy cannot infer a lambda with a default
        wait_for(lambda p=pids: queried_since(dsn, p, since), bool, 30, f"{bridge.name} to pass")  # type: ignore[misc]
        again = db_now(dsn)
        wait_for(lambda p=pids, a=again: queried_since(dsn, p, a), bool, 30, f"{bridge.name}'s next pass")  # type: ignore[misc]


def _bridge_args(mapping: Path) -> list[str]:
    return ["--mapping", str(mapping), "--interval", "1", "--grace", "3"]


def test_task_success_becomes_exactly_one_event_through_crashes_and_races(
    airflow_stack: AirflowStack, tmp_path: Path
) -> None:
    config = airflow_stack.config
    dsn = config.database_dsn
    (config.dags_folder / "etl_orders.py").write_text(textwrap.dedent(PRODUCER))
    (config.dags_folder / "consumers.py").write_text(textwrap.dedent(CONSUMERS))
    mapping = tmp_path / "bridge.yaml"
    mapping.write_text("etl_orders.load_orders:\n  - warehouse://dds/orders\n")
    airflow_stack.start_smart(["etl_orders", "orders_report", "race_consumer"])
    # two bridges at once: the ledger keeps each success single
    bridges = [airflow_stack.start_bridge_ready(f"bridge-{i}", _bridge_args(mapping)) for i in (1, 2)]

    run_1 = airflow_stack.trigger("etl_orders")
    assert airflow_stack.wait_for_run("etl_orders", run_1, timeout=120) == "success"
    wait_for(lambda: _runs(dsn, "orders_report"), lambda n: n == 1, 60, "the consumer to run")
    _bridges_passed_since(dsn, bridges, db_now(dsn))
    assert _orders_events(dsn) == 1
    assert _runs(dsn, "orders_report") == 1
    ((key, source_dag),) = rows(
        dsn, "SELECT CAST(extra AS jsonb) ->> 'idempotency_key', source_dag_id FROM asset_event"
    )
    assert key == f"task/etl_orders/load_orders/{run_1}/-1/1" and source_dag == "etl_orders"

    # the bridge dies after creating the event, before committing it
    for bridge in bridges:
        airflow_stack.retire(bridge)
    later = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=1)
    run_2 = airflow_stack.trigger("etl_orders", logical_date=later)
    assert airflow_stack.wait_for_run("etl_orders", run_2, timeout=120) == "success"
    crashed = subprocess.run(
        [sys.executable, "-m", "tests.helpers.crashing_bridge", str(mapping)],
        env=config.env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert crashed.returncode == 9, crashed.stdout + crashed.stderr
    assert "crashing before commit" in crashed.stdout
    assert _orders_events(dsn) == 1  # the crashed transaction left nothing behind
    bridge_3 = airflow_stack.start_bridge("bridge-3", _bridge_args(mapping))
    wait_for(lambda: _orders_events(dsn), lambda n: n == 2, 60, "the lost event to be made again")
    wait_for(lambda: _runs(dsn, "orders_report"), lambda n: n == 2, 60, "the second consumer run")
    _bridges_passed_since(dsn, [bridge_3], db_now(dsn))
    scheduler_looped_since(dsn, db_now(dsn))
    assert _orders_events(dsn) == 2 and _runs(dsn, "orders_report") == 2

    # two events 20 ms apart (apache/airflow#54659): both are consumed by some consumer run
    with airflow_stack.client() as client:
        asset_id = client.get("/assets", params={"name_pattern": "race"}).json()["assets"][0]["id"]
        for n in (1, 2):
            body = {"asset_id": asset_id, "extra": {"idempotency_key": f"race/{n}"}}
            client.post("/assets/events", json=body).raise_for_status()
            time.sleep(0.02)
    race_events = [r[0] for r in rows(dsn, "SELECT id FROM asset_event WHERE asset_id = %s", asset_id)]
    assert len(race_events) == 2

    def consumed() -> set[int]:
        query = (
            "SELECT c.event_id FROM dagrun_asset_event c JOIN dag_run d ON d.id = c.dag_run_id "
            "WHERE d.dag_id = 'race_consumer'"
        )
        return {r[0] for r in rows(dsn, query)}

    wait_for(consumed, lambda found: found == set(race_events), 90, "both events to be consumed")
    requeued = _count(dsn, "SELECT count(*) FROM dataset_bridge.reconciled")
    print(f"race consumer runs: {_runs(dsn, 'race_consumer')}, held-back events re-queued: {requeued}")

    status = subprocess.run(
        [
            str(Path(sys.executable).with_name("dataset-bridge")),
            "status",
            "--json",
            "--mapping",
            str(mapping),
        ],
        env=config.env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    report = json.loads(status.stdout.strip().splitlines()[-1])
    assert report["emitted"] == {"task_success": 2}
    assert report["backlog"] == 0 and report["held_back"] == 0
