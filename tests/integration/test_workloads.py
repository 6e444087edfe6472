"""Task triggers' workloads read in one statement per batch (``smart_triggerer/supervisor/workloads.py``): the
workloads and log files Airflow's own builder makes, for plain tasks, tasks that start from the trigger and
asset watchers alike, in a number of statements that does not grow with the batch."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from devkit.devstack import AirflowConfig
from tests.helpers.seeding import seed_deferred
from tests.integration.test_supervisor_faults import AT_TIME, add_watcher, load, make_supervisor


def at(hours: int) -> str:
    return (dt.datetime.now(dt.UTC) + dt.timedelta(hours=hours)).isoformat()


@contextmanager
def counting_statements() -> Iterator[list[str]]:
    """Statements Airflow's engine runs inside the block."""
    from airflow import settings
    from sqlalchemy import event

    seen: list[str] = []

    def note(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        seen.append(statement)

    event.listen(settings.engine, "before_cursor_execute", note)
    try:
        yield seen
    finally:
        event.remove(settings.engine, "before_cursor_execute", note)


@contextmanager
def loaded_task_instances() -> Iterator[list[str]]:
    """Ids of the task instances SQLAlchemy makes into ORM objects inside the block."""
    from airflow.models.taskinstance import TaskInstance
    from sqlalchemy import event

    seen: list[str] = []

    def note(target: Any, _context: Any) -> None:
        seen.append(str(target.id))

    event.listen(TaskInstance, "load", note)
    try:
        yield seen
    finally:
        event.remove(TaskInstance, "load", note)


def airflows_own(supervisor: Any, trigger_ids: set[int]) -> dict[int, tuple[Any, str]]:
    """trigger id -> (workload, its log file's path) as Airflow's ``_create_workload`` alone makes them."""
    from airflow.jobs.triggerer_job_runner import TriggerRunnerSupervisor
    from airflow.models.dagbag import DBDagBag
    from airflow.models.trigger import Trigger
    from airflow.utils.helpers import log_filename_template_renderer
    from airflow.utils.session import create_session

    made = {}
    with create_session() as session:
        bag, render = DBDagBag(), log_filename_template_renderer()
        for trigger in Trigger.bulk_fetch(trigger_ids, session=session).values():
            workload = TriggerRunnerSupervisor._create_workload(supervisor, trigger, bag, render, session)
            factory = supervisor.logger_cache.get(trigger.id)  # none for an asset watcher
            made[trigger.id] = (workload, factory.log_path if factory is not None else "")
    return made


def test_workloads_are_airflows_own_in_statements_that_do_not_grow_with_the_batch(env: AirflowConfig) -> None:
    supervisor = make_supervisor(dedup=False)  # each coroutine keeps its task's own timeout, as Airflow's
    plain = seed_deferred(
        env.database_dsn,
        env.dags_folder,
        count=40,
        classpath=AT_TIME,
        kwargs_for=lambda i: {"moment": at(10 + i)},
        trigger_timeout=dt.timedelta(hours=3),
    )
    starting = seed_deferred(
        env.database_dsn,
        env.dags_folder,
        count=3,
        classpath=AT_TIME,
        kwargs_for=lambda i: {"moment": at(60 + i)},
        start_from_trigger=True,
    )
    watcher = add_watcher("workloads_watched", moment=at(70))
    load(supervisor)
    with counting_statements() as statements, loaded_task_instances() as loaded:
        supervisor.starting.start_groups()
    ours = {w.id: w for w in supervisor.creating_triggers}
    everything = set(plain.trigger_ids) | set(starting.trigger_ids) | {watcher}
    assert set(ours) == everything
    paths = {i: supervisor.logger_cache[i].log_path for i in everything if i in supervisor.logger_cache}

    theirs = airflows_own(supervisor, everything)
    for trigger_id, (workload, log_path) in theirs.items():
        mine = ours[trigger_id]
        assert mine.model_dump() == workload.model_dump(), trigger_id
        if workload.ti is not None:
            assert paths[trigger_id] == log_path
    assert all(ours[i].dag_data for i in starting.trigger_ids)  # these go Airflow's way, DAG and all
    assert all(ours[i].ti is not None and ours[i].timeout_after for i in plain.trigger_ids)

    # no task instance made into an ORM object but those of the tasks that start from the trigger
    print(
        f"\nstatements for {len(everything)} workloads: {len(statements)}; task instances loaded as ORM "
        f"objects: {len(loaded)}"
    )
    assert loaded and set(loaded) <= set(starting.ti_ids)


def test_the_statements_of_a_build_do_not_depend_on_its_size(env: AirflowConfig) -> None:
    supervisor = make_supervisor()
    counts = []
    for hours, count in ((100, 5), (200, 60)):  # two DAGs of one version each, one build each
        seed_deferred(
            env.database_dsn,
            env.dags_folder,
            count=count,
            classpath=AT_TIME,
            kwargs_for=lambda i, h=hours: {"moment": at(h + i)},  # type: ignore[misc]  # no lambda with a default
        )
        load(supervisor)
        before = len(supervisor.creating_triggers)
        with counting_statements() as statements:
            supervisor.starting.start_groups()
        assert len(supervisor.creating_triggers) - before == count
        counts.append(len(statements))
        supervisor.dag_cache.clear()  # as at the end of a start
    print(f"\nstatements to build 5 and 60 workloads: {counts}")
    assert counts[0] == counts[1]
