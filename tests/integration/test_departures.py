"""Departed waits leave without reading every waiter: the trigger rows of tasks we resume go
in the same transaction, tasks that left otherwise are found through a partial index that holds only them,
and Airflow's full clean_unused is a rare sweep. Driven step by step as in test_change_feed."""

from __future__ import annotations

import datetime as dt
import json
import time
from typing import Any

from devkit.devstack import AirflowConfig
from smart_triggerer.supervisor.housekeeping import SWEEP_SECONDS, build_left_index
from tests.helpers.waiting import rows, ti_states
from tests.integration.test_supervisor_faults import (
    LATER,
    add_watcher,
    event_entry,
    load,
    make_supervisor,
    runner_of,
    seed,
)


def trigger_rows(dsn: str, trigger_ids: list[int]) -> int:
    return int(rows(dsn, "SELECT count(*) FROM trigger WHERE id = ANY(%s)", trigger_ids)[0][0])


def left_index_plan(dsn: str) -> dict[str, Any]:
    """The plan of release_left_waits' read, on the current statistics."""
    found = rows(
        dsn,
        "EXPLAIN (FORMAT JSON) SELECT id, trigger_id FROM task_instance "
        "WHERE trigger_id IS NOT NULL AND state IS DISTINCT FROM 'deferred' ORDER BY id",
    )[0][0]
    plan: dict[str, Any] = (json.loads(found) if isinstance(found, str) else found)[0]["Plan"]
    return plan


def index_names(plan: dict[str, Any]) -> set[str]:
    names = {plan["Index Name"]} if "Index Name" in plan else set()
    for child in plan.get("Plans", []):
        names |= index_names(child)
    return names


def test_a_resume_deletes_its_trigger_rows_in_the_same_transaction(env: AirflowConfig) -> None:
    dsn = env.database_dsn
    supervisor = make_supervisor()
    seeded = seed(env, 5)  # one group of five
    load(supervisor)
    supervisor.events.append(event_entry(runner_of(supervisor, seeded), {"moment": LATER}))
    supervisor.handle_events()
    assert set(ti_states(dsn, seeded.dag_id).values()) == {"scheduled"}
    # no clean_unused ran: the resume itself removed the rows nothing refers to any more
    assert trigger_rows(dsn, seeded.trigger_ids) == 0


def test_a_timeout_deletes_the_trigger_rows_of_the_tasks_it_failed(env: AirflowConfig) -> None:
    dsn = env.database_dsn
    supervisor = make_supervisor()
    seeded = seed(env, 3, trigger_timeout=dt.timedelta(seconds=-1))
    load(supervisor)
    supervisor.deadlines.timeout_members()
    assert set(ti_states(dsn, seeded.dag_id).values()) == {"scheduled"}
    assert trigger_rows(dsn, seeded.trigger_ids) == 0 and not supervisor.member_info


def test_a_task_cleared_while_deferred_leaves_through_the_partial_index(env: AirflowConfig) -> None:
    """A cleared task keeps state NULL and its trigger_id (Airflow's clean_unused misses it): found within
    one cleanup through the index, its trigger row deleted, its member gone with the next feed read."""
    dsn = env.database_dsn
    supervisor = make_supervisor()
    seeded = seed(env, 2)
    other = seed(env, 1, moment=(dt.datetime.now(dt.UTC) + dt.timedelta(hours=3)).isoformat())  # stays
    build_left_index()
    supervisor.housekeeping.look_at_left_index(time.monotonic())
    assert supervisor.housekeeping.left_index == "valid"
    load(supervisor)
    supervisor.owned = set(supervisor.owned) | {0}
    cleared = seeded.trigger_ids[0]
    rows(dsn, "UPDATE task_instance SET state = NULL WHERE trigger_id = %s RETURNING 1", cleared)
    supervisor.housekeeping.last_sweep = time.monotonic()  # not a sweep: the targeted cleanup
    supervisor.housekeeping.clean_up(time.monotonic())
    assert trigger_rows(dsn, [cleared]) == 0
    assert rows(dsn, "SELECT count(*) FROM task_instance WHERE trigger_id = %s", cleared)[0][0] == 0
    load(supervisor)
    assert cleared not in supervisor.member_info
    assert {seeded.trigger_ids[1], *other.trigger_ids} <= set(supervisor.member_info)
    assert trigger_rows(dsn, [seeded.trigger_ids[1], *other.trigger_ids]) == 2


def test_the_cleanup_reads_the_partial_index_not_the_waiting_tasks(env: AirflowConfig) -> None:
    dsn = env.database_dsn
    seed(env, 3000)
    build_left_index()
    rows(dsn, "ANALYZE task_instance; SELECT 1")
    assert "smart_triggerer_ti_left" in index_names(left_index_plan(dsn))


def test_without_the_index_and_once_a_sweep_airflow_cleans_up(env: AirflowConfig, monkeypatch: Any) -> None:
    """Until the index is there, and once every SWEEP_SECONDS, Airflow's own clean_unused runs: it also
    catches what the targeted path cannot see (a task row deleted with its run)."""
    supervisor = make_supervisor()
    calls: list[float] = []
    monkeypatch.setattr(type(supervisor), "clean_unused", lambda self: calls.append(time.monotonic()))
    supervisor.owned = {0}
    monkeypatch.setattr("smart_triggerer.supervisor.housekeeping.build_left_index", lambda: None)
    supervisor.housekeeping.look_at_left_index(time.monotonic())
    assert supervisor.housekeeping.left_index == "missing"
    supervisor.housekeeping.clean_up(time.monotonic())
    assert len(calls) == 1  # no index: Airflow's
    build_left_index()
    supervisor.housekeeping.left_index_checked = -1e9
    supervisor.housekeeping.look_at_left_index(time.monotonic())
    assert supervisor.housekeeping.left_index == "valid"
    supervisor.housekeeping.clean_up(time.monotonic())
    assert len(calls) == 1  # the index: targeted
    supervisor.housekeeping.clean_up(time.monotonic() + SWEEP_SECONDS + 1)
    assert len(calls) == 2  # the sweep is due


def test_a_watcher_nothing_refers_to_any_more_leaves_within_a_cleanup(env: AirflowConfig) -> None:
    """An asset watcher removed from its DAG leaves its trigger row behind: deleted by the instance
    running it at its next cleanup (not at the 10-minute sweep), its coroutine stopped by the feed."""
    dsn = env.database_dsn
    supervisor = make_supervisor()
    removed, kept = add_watcher("removed"), add_watcher("kept")
    load(supervisor)
    assert {removed, kept} <= set(supervisor.member_info)
    rows(dsn, "DELETE FROM asset_watcher WHERE trigger_id = %s RETURNING 1", removed)
    supervisor.housekeeping.release_unwatched()
    assert trigger_rows(dsn, [removed, kept]) == 1
    load(supervisor)
    assert removed not in supervisor.member_info and kept in supervisor.member_info
