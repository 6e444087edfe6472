"""Seed deferred task instances for fast triggerer tests, without scheduler or workers.

Each waiter is one task instance (a map index of one mapped task) in state DEFERRED pointing at its own
``trigger`` row, written exactly as Airflow 3.3's execution API writes a deferral
(``_create_ti_state_update_query_and_update_state``): the worker's serde-serialised trigger kwargs are
stored as JSON text in ``trigger.kwargs``, ``next_kwargs`` is serde-serialised and ``trigger_timeout`` is
"now + timeout". The DAG itself is real: written to the dags folder, parsed and serialised by Airflow.
"""

from __future__ import annotations

import datetime as dt
import json
import textwrap
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.helpers.airflow_orm import use_airflow_db

_DAG_FILE = '''
"""Seeded waiters: resumed by triggers, never started by a worker before deferral."""
import pendulum
from airflow.sdk import DAG, BaseOperator


class Waiter(BaseOperator):
{starts}
    def __init__(self, *, target, **kwargs):
        super().__init__(**kwargs)
        self.target = target

    def execute(self, context):
        raise RuntimeError("a seeded waiter starts deferred; it is never executed from the start")

    def execute_complete(self, context, event=None):
        return event


with DAG(dag_id={dag_id!r}, schedule=None, start_date=pendulum.datetime(2024, 1, 1), catchup=False):
    Waiter.partial(task_id="wait").expand(target=list(range({count})))
'''

KwargsFor = Callable[[int], dict[str, Any]]


@dataclass
class Seeded:
    dag_id: str
    run_id: str
    ti_ids: list[str]
    trigger_ids: list[int]


# a Waiter whose deferral starts in the triggerer (its workload carries the DAG and the run)
_STARTS_FROM_TRIGGER = """
    from airflow.triggers.base import StartTriggerArgs

    start_trigger_args = StartTriggerArgs(trigger_cls="tests.helpers.triggers.AtTimeTrigger",
                                          trigger_kwargs={}, next_method="execute_complete",
                                          next_kwargs=None, timeout=None)
    start_from_trigger = True
"""


def write_seed_dag(dags_folder: Path, dag_id: str, count: int, *, start_from_trigger: bool = False) -> Path:
    dags_folder.mkdir(parents=True, exist_ok=True)
    path = dags_folder / f"{dag_id}.py"
    starts = textwrap.indent(textwrap.dedent(_STARTS_FROM_TRIGGER), "    ") if start_from_trigger else ""
    path.write_text(textwrap.dedent(_DAG_FILE).format(dag_id=dag_id, count=count, starts=starts))
    return path


def _sync_dag(path: Path, dags_folder: Path) -> None:
    from airflow.configuration import conf
    from airflow.dag_processing.bundles.manager import DagBundlesManager
    from airflow.dag_processing.dagbag import DagBag, sync_bag_to_db

    conf.set("core", "dags_folder", str(dags_folder))
    DagBundlesManager().sync_bundles_to_db()
    bag = DagBag(dag_folder=str(path), bundle_path=dags_folder, bundle_name="dags-folder")
    if bag.import_errors:
        raise RuntimeError(f"seed DAG failed to import: {bag.import_errors}")
    sync_bag_to_db(bag, "dags-folder", None)


def _create_run(dag_id: str, session: Any) -> tuple[str, list[str]]:
    from airflow.models.dagbag import DBDagBag
    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.state import DagRunState
    from airflow.utils.types import DagRunTriggeredByType, DagRunType
    from sqlalchemy import select

    dag = DBDagBag().get_latest_version_of_dag(dag_id, session=session)
    if dag is None:
        raise RuntimeError(f"seed DAG {dag_id} was not serialised")
    now = dt.datetime.now(dt.UTC)
    run = dag.create_dagrun(
        run_id=f"seed__{uuid.uuid4().hex[:12]}",
        logical_date=now,
        data_interval=(now, now),
        run_after=now,
        run_type=DagRunType.MANUAL,
        triggered_by=DagRunTriggeredByType.TEST,
        state=DagRunState.RUNNING,
        session=session,
    )
    session.flush()
    ti_ids = session.scalars(
        select(TaskInstance.id)
        .where(TaskInstance.dag_id == dag_id, TaskInstance.run_id == run.run_id)
        .order_by(TaskInstance.map_index)
    ).all()
    return run.run_id, [str(i) for i in ti_ids]


def _as_serialized(classpath: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """What a worker stores: ``trigger.serialize()`` of the trigger built from the kwargs (our triggers add
    their identity there); kwargs as given when the class cannot be imported or refuses them."""
    from airflow._shared.module_loading import import_string

    try:
        trigger_class = import_string(classpath)
    except ImportError:
        return lambda kwargs: kwargs

    def serialized(kwargs: dict[str, Any]) -> dict[str, Any]:
        try:
            result: dict[str, Any] = trigger_class(**kwargs).serialize()[1]
        except Exception:  # kwargs the class would refuse: stored as given (tests of bad input)
            return kwargs
        return result

    return serialized


def _defer(
    ti_ids: Sequence[str], classpath: str, kwargs_for: KwargsFor, timeout: dt.timedelta | None, session: Any
) -> list[int]:
    """Write the deferral of every task instance the way the execution API does."""
    from airflow.models.taskinstance import TaskInstance
    from airflow.models.trigger import Trigger
    from airflow.sdk.serde import serialize
    from airflow.utils.state import TaskInstanceState
    from sqlalchemy import update

    serialized = _as_serialized(classpath)
    rows = []
    for index in range(len(ti_ids)):
        row = Trigger(classpath=classpath, kwargs={})
        row.encrypted_kwargs = json.dumps(serialize(serialized(kwargs_for(index))))
        rows.append(row)
    session.add_all(rows)
    session.flush()
    deadline = dt.datetime.now(dt.UTC) + timeout if timeout is not None else None
    next_kwargs = serialize({})
    session.execute(
        update(TaskInstance),
        [
            {
                "id": ti_id,
                "state": TaskInstanceState.DEFERRED,
                "trigger_id": row.id,
                "next_method": "execute_complete",
                "next_kwargs": next_kwargs,
                "trigger_timeout": deadline,
            }
            for ti_id, row in zip(ti_ids, rows, strict=True)
        ],
    )
    return [row.id for row in rows]


def seed_run(dsn: str, dags_folder: Path, *, count: int, dag_id: str | None = None) -> Seeded:
    """A real DAG of one mapped task (``wait``, ``count`` map indexes) and one run of it, nothing deferred."""
    from airflow.utils.session import create_session

    use_airflow_db(dsn)
    dag_id = dag_id or f"seeded_{uuid.uuid4().hex[:8]}"
    _sync_dag(write_seed_dag(dags_folder, dag_id, count), dags_folder)
    with create_session() as session:
        run_id, ti_ids = _create_run(dag_id, session)
    return Seeded(dag_id, run_id, ti_ids, [])


def seed_deferred(
    dsn: str,
    dags_folder: Path,
    *,
    count: int,
    classpath: str,
    kwargs_for: KwargsFor,
    trigger_timeout: dt.timedelta | None = None,
    dag_id: str | None = None,
    start_from_trigger: bool = False,
) -> Seeded:
    """Create ``count`` deferred task instances, waiter ``i`` waiting on ``classpath(**kwargs_for(i))``."""
    from airflow.utils.session import create_session

    use_airflow_db(dsn)
    dag_id = dag_id or f"seeded_{uuid.uuid4().hex[:8]}"
    path = write_seed_dag(dags_folder, dag_id, count, start_from_trigger=start_from_trigger)
    _sync_dag(path, dags_folder)
    with create_session() as session:
        run_id, ti_ids = _create_run(dag_id, session)
        if len(ti_ids) != count:
            raise RuntimeError(f"expected {count} task instances, the run has {len(ti_ids)}")
        trigger_ids = _defer(ti_ids, classpath, kwargs_for, trigger_timeout, session)
    return Seeded(dag_id, run_id, ti_ids, trigger_ids)
