"""The seeding helper writes deferrals exactly like Airflow's execution API, and they really run."""

from __future__ import annotations

import datetime as dt
import json
import time
from pathlib import Path

import psycopg2
import pytest

from devkit.devstack import AirflowConfig, AirflowStack
from tests.helpers.seeding import seed_deferred

DATETIME_TRIGGER = "airflow.providers.standard.triggers.temporal.DateTimeTrigger"


def _rows(dsn: str, query: str, *params: object) -> list[tuple[object, ...]]:
    with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
        cur.execute(query, params)
        result: list[tuple[object, ...]] = cur.fetchall()
        return result


def test_seeded_rows_match_an_api_deferral(airflow_config: AirflowConfig) -> None:
    seeded = seed_deferred(
        airflow_config.database_dsn,
        airflow_config.dags_folder,
        count=25,
        classpath=DATETIME_TRIGGER,
        kwargs_for=lambda i: {"moment": f"target-{i % 5}"},
        trigger_timeout=dt.timedelta(minutes=10),
    )

    rows = _rows(
        airflow_config.database_dsn,
        "SELECT ti.state, ti.map_index, ti.next_method, ti.trigger_timeout > now(), t.classpath, t.kwargs "
        "FROM task_instance ti JOIN trigger t ON t.id = ti.trigger_id "
        "WHERE ti.dag_id = %s ORDER BY ti.map_index",
        seeded.dag_id,
    )
    assert len(rows) == 25
    assert {r[0] for r in rows} == {"deferred"}
    assert [r[1] for r in rows] == list(range(25))
    assert {(r[2], r[3], r[4]) for r in rows} == {("execute_complete", True, DATETIME_TRIGGER)}
    # Stored as the API server stores a worker's deferral: serde JSON text, decrypted by Airflow's model.
    assert json.loads(str(rows[7][5])) == {"moment": "target-2"}
    assert len(set(seeded.trigger_ids)) == 25


@pytest.mark.e2e
def test_stock_triggerer_resumes_seeded_waiters(airflow_stack: AirflowStack, tmp_path: Path) -> None:
    config = airflow_stack.config
    moment = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)
    seeded = seed_deferred(
        config.database_dsn,
        config.dags_folder,
        count=10,
        classpath=DATETIME_TRIGGER,
        kwargs_for=lambda i: {"moment": moment, "end_from_trigger": False},
    )
    airflow_stack.start_stock_triggerer()

    deadline = time.monotonic() + 60
    states: list[tuple[object, ...]] = []
    while time.monotonic() < deadline:
        states = _rows(
            config.database_dsn,
            "SELECT state, next_kwargs::text FROM task_instance WHERE dag_id = %s",
            seeded.dag_id,
        )
        if all(s[0] == "scheduled" for s in states):
            break
        time.sleep(0.5)
    assert [s[0] for s in states] == ["scheduled"] * 10, airflow_stack.log_tails()
    assert all("event" in str(s[1]) for s in states)
