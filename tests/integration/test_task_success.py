"""The task-success bridge against a real (migrated) Airflow metadata database with real task instances:
every successful try gets one event per mapped asset, also for assets declared later and for tries that
were cleared or retried before the bridge looked."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from dataset_bridge import service, task_success
from dataset_bridge.task_success import TaskMapping
from tests.helpers.seeding import Seeded, seed_run


@pytest.fixture
def producer(airflow_db: str, tmp_path: Path) -> Seeded:
    """One run of a real mapped task (two map indexes) and the bridge's schema, horizons an hour back."""
    from airflow.utils.session import create_session

    seeded = seed_run(airflow_db, tmp_path / "dags", count=2)
    with create_session() as session:
        task_success.ensure_schema(session)
    return seeded


def _mapping(seeded: Seeded, *refs: str) -> TaskMapping:
    return TaskMapping({(seeded.dag_id, "wait"): refs})


def _prepare(mapping: TaskMapping) -> None:
    from airflow.utils.session import create_session

    service.prepare(mapping)
    with create_session() as session:  # successes in these tests are "now"; the horizon is before them
        session.execute(text("UPDATE dataset_bridge.task_horizon SET since = now() - interval '1 hour'"))


def _declare(name: str) -> None:
    from airflow.models.asset import AssetActive, AssetModel
    from airflow.utils.session import create_session

    with create_session() as session:
        asset = AssetModel(name=name, uri=f"warehouse://{name}")
        session.add(asset)
        session.add(AssetActive.for_asset(asset))


def _succeed(seeded: Seeded, map_index: int, try_number: int) -> None:
    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.session import create_session
    from airflow.utils.state import TaskInstanceState
    from sqlalchemy import select

    with create_session() as session:
        ti = session.scalars(
            select(TaskInstance).where(
                TaskInstance.dag_id == seeded.dag_id,
                TaskInstance.run_id == seeded.run_id,
                TaskInstance.map_index == map_index,
            )
        ).one()
        now = dt.datetime.now(dt.UTC)
        ti.try_number, ti.state, ti.start_date, ti.end_date = try_number, TaskInstanceState.SUCCESS, now, now


def _clear(seeded: Seeded, map_index: int) -> None:
    """What clearing a finished task does: the try goes to history, the task instance gets a new id."""
    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        ti = session.scalars(
            select(TaskInstance).where(
                TaskInstance.dag_id == seeded.dag_id,
                TaskInstance.run_id == seeded.run_id,
                TaskInstance.map_index == map_index,
            )
        ).one()
        ti.prepare_db_for_next_try(session)
        ti.state = None


def _events() -> list[tuple[str, str]]:
    """(asset name, idempotency key) of every asset event, in creation order."""
    from airflow.utils.session import create_session

    with create_session() as session:
        rows = session.execute(
            text(
                "SELECT a.name, CAST(e.extra AS jsonb) ->> 'idempotency_key' FROM asset_event e "
                "JOIN asset a ON a.id = e.asset_id ORDER BY e.id"
            )
        ).all()
    return [(str(name), str(key)) for name, key in rows]


def _key(seeded: Seeded, map_index: int, try_number: int) -> str:
    return task_success.success_key(seeded.dag_id, "wait", seeded.run_id, map_index, try_number)


def test_an_asset_declared_later_still_gets_the_event_of_an_earlier_try(producer: Seeded) -> None:
    mapping = _mapping(producer, "orders", "customers")
    _prepare(mapping)
    _declare("orders")
    _succeed(producer, 0, 1)
    assert service.emit_pending(mapping) == 1
    assert _events() == [("orders", _key(producer, 0, 1))]

    _declare("customers")  # a consumer DAG declares the second asset only now
    assert service.emit_pending(mapping) == 1
    assert service.emit_pending(mapping) == 0
    assert _events() == [("orders", _key(producer, 0, 1)), ("customers", _key(producer, 0, 1))]


def test_a_success_cleared_before_the_bridge_looked_is_emitted_from_history(producer: Seeded) -> None:
    mapping = _mapping(producer, "orders")
    _prepare(mapping)
    _declare("orders")
    _succeed(producer, 1, 1)
    _clear(producer, 1)  # cleared (say, to re-run it) before the bridge's next pass, or while it was down
    assert service.emit_pending(mapping) == 1
    _succeed(producer, 1, 2)  # the re-run succeeds too: its own event
    assert service.emit_pending(mapping) == 1
    assert service.emit_pending(mapping) == 0
    assert _events() == [("orders", _key(producer, 1, 1)), ("orders", _key(producer, 1, 2))]
    with_source = _source_of_events()
    assert {row[0] for row in with_source} == {producer.dag_id}
    assert {row[1] for row in with_source} == {1}


def _source_of_events() -> list[Any]:
    from airflow.utils.session import create_session

    with create_session() as session:
        return list(session.execute(text("SELECT source_dag_id, source_map_index FROM asset_event")).all())


def test_status_counts_pairs_waiting_for_an_undeclared_asset_as_no_backlog(producer: Seeded) -> None:
    from airflow.utils.session import create_session

    mapping = _mapping(producer, "orders", "not_declared_anywhere")
    _prepare(mapping)
    _declare("orders")
    _succeed(producer, 0, 1)
    with create_session() as session:
        assert len(task_success.pending(session, mapping)) == 1
        assert task_success.unresolved(session, mapping) == ["not_declared_anywhere"]
