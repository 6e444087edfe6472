"""Task triggers' workloads read with one statement per batch, not through Airflow's ORM.

Airflow's ``build_trigger_workloads`` loads each trigger and its task instance as ORM objects, reads each
task's DAG run with a query of its own, and builds the task's ``TaskInstanceDTO`` from the ORM object
(``model_validate(from_attributes=True)``). At a takeover that is where the supervisor's CPU goes, much of
it to SQLAlchemy's instance state (docs/design.md, Measurements behind the code). Here one statement
reads the columns a workload carries (trigger, task instance, the run's DAG version) for a whole batch,
and the DTO is validated from a plain dict.

The result is the workload Airflow would build: same fields, same log file name, same DAG version
resolution (``DBDagBag.get_serialized_dag_model_for_run``, else the task instance's own version) to read
the task's ``start_from_trigger``. What this path does not cover goes through Airflow's own builder: triggers
without a task instance (asset watchers, callbacks), tasks that start from the trigger (their workload
carries the DAG and the run), rows this statement did not return, and every row when the log file name
template reads more than a ``TaskInstanceDTO`` has (``log_renderer``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import structlog
from airflow.configuration import conf
from airflow.executors.workloads.task import TaskInstanceDTO
from airflow.executors.workloads.trigger import RunTrigger
from airflow.models.dag_version import DagVersion
from airflow.models.dagrun import DagRun
from airflow.models.serialized_dag import SerializedDagModel
from airflow.models.taskinstance import TaskInstance
from airflow.models.trigger import Trigger
from airflow.utils.helpers import log_filename_template_renderer
from pydantic import ValidationError
from sqlalchemy import Select, bindparam, select, true
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from smart_triggerer.supervisor.dagbag import DagCache

log = structlog.get_logger(logger_name=__name__)

DTO_FIELDS = (
    "id",
    "task_id",
    "dag_id",
    "run_id",
    "try_number",
    "dag_version_id",
    "map_index",
    "hostname",
    "context_carrier",
    "queue",
    "pool_slots",
    "priority_weight",
)


@dataclass(frozen=True, slots=True)
class TaskRow:
    """What one task trigger's workload is built from."""

    trigger_id: int
    classpath: str
    encrypted_kwargs: str
    ti: dict[str, Any]  # the TaskInstanceDTO's fields
    trigger_timeout: Any
    bundle_version: str | None
    created_dag_version_id: Any

    @property
    def run_version_known(self) -> bool:
        """Airflow resolves a run with a bundle version and a version of its own to that version; any
        other run to its DAG's latest version (``DBDagBag._version_from_dag_run``)."""
        return bool(self.bundle_version and self.created_dag_version_id)


# Airflow's default ``[logging] log_filename_template`` (3.x) and the same name made in Python: rendering it
# with Jinja for every workload was a large part of building one (measured: docs/design.md)
AIRFLOW_DEFAULT_LOG_TEMPLATE = (
    "dag_id={{ ti.dag_id }}/run_id={{ ti.run_id }}/task_id={{ ti.task_id }}/"
    "{% if ti.map_index >= 0 %}map_index={{ ti.map_index }}/{% endif %}"
    "attempt={{ try_number|default(ti.try_number) }}.log"
)
_UNSET: Any = object()


def default_log_filename(*, ti: Any, try_number: Any = _UNSET) -> str:
    """``AIRFLOW_DEFAULT_LOG_TEMPLATE`` rendered, without Jinja (autoescape off there too: plain ``str``)."""
    attempt = ti.try_number if try_number is _UNSET else try_number
    mapped = f"map_index={ti.map_index}/" if ti.map_index >= 0 else ""
    return f"dag_id={ti.dag_id}/run_id={ti.run_id}/task_id={ti.task_id}/{mapped}attempt={attempt}.log"


@functools.cache
def log_renderer() -> Callable[..., str] | None:
    """Airflow's log file name renderer when the template reads only what a ``TaskInstanceDTO`` carries
    (Airflow's default does: dag_id, run_id, task_id, map_index, try_number); else None, and workloads
    are built Airflow's way. Jinja renders a missing attribute as an empty string, so a template reading,
    say, ``ti.logical_date`` would silently give another file name."""
    return renderer_for(conf.get("logging", "log_filename_template"))


def renderer_for(template: str) -> Callable[..., str] | None:
    """``log_renderer`` for this template (the configured one)."""
    if template == AIRFLOW_DEFAULT_LOG_TEMPLATE:
        return default_log_filename
    if "{{" not in template:
        return None  # Airflow's str.format templates read ti.logical_date
    if not _reads_only(template, set(DTO_FIELDS)):  # the DTO's executor-only fields are not read here
        return None
    return log_filename_template_renderer()


def _reads_only(template: str, fields: set[str]) -> bool:
    import jinja2
    from jinja2 import meta, nodes

    try:
        tree = jinja2.Environment().parse(template)  # noqa: S701 (parsed to be read, never rendered here)
    except jinja2.TemplateSyntaxError:
        return False
    if not meta.find_undeclared_variables(tree) <= {"ti", "try_number"}:
        return False
    uses = [n for n in tree.find_all(nodes.Name) if n.name == "ti"]
    reads = [
        n
        for n in tree.find_all(nodes.Getattr)
        if isinstance(n.node, nodes.Name) and n.node.name == "ti" and n.attr in fields
    ]
    return len(uses) == len(reads)  # ``ti`` only ever as ``ti.<a DTO field>``


def task_rows(session: Session, trigger_ids: Iterable[int]) -> dict[int, TaskRow]:
    """The task triggers among these ids, with their task instance and the run's DAG version.

    Read from each trigger id through the indexes: its task instance by ``ti_trigger_id``, that task's
    run by its key. Each step is a lateral subquery with ``OFFSET 0``, which PostgreSQL never merges into
    the join, so the order is not the planner's to choose: with statistics lagging a burst of deferrals
    (tens of thousands of task instances in one run) a plain join read every task instance of the run
    for each batch.

    The statement is built once and run on the session's connection (plain rows, the columns' types
    applied as through the ORM): this read is a large part of a takeover's supervisor CPU, and building
    the statement for each batch and reading it through the ORM's result machinery were much of it
    (docs/design.md, Measurements behind the code)."""
    found: dict[int, TaskRow] = {}
    for row in session.connection().execute(_task_rows_statement(), {"ids": list(trigger_ids)}):
        trigger_id, classpath, kwargs, *ti_values, timeout, bundle_version, created = row
        ti = dict(zip(DTO_FIELDS, ti_values, strict=True))
        found.setdefault(
            trigger_id, TaskRow(trigger_id, classpath, kwargs, ti, timeout, bundle_version, created)
        )
    return found


@functools.cache
def _task_rows_statement() -> Select[Any]:
    instance = (
        select(*[getattr(TaskInstance, name) for name in DTO_FIELDS], TaskInstance.trigger_timeout)
        .where(TaskInstance.trigger_id == Trigger.id)
        .offset(0)
        .lateral("ti")
    )
    run = (
        select(DagRun.bundle_version, DagRun.created_dag_version_id)
        .where(DagRun.dag_id == instance.c.dag_id, DagRun.run_id == instance.c.run_id)
        .offset(0)
        .lateral("run")
    )
    return (
        select(
            Trigger.id,
            Trigger.classpath,
            Trigger.encrypted_kwargs,
            *[instance.c[name] for name in DTO_FIELDS],
            instance.c.trigger_timeout,
            run.c.bundle_version,
            run.c.created_dag_version_id,
        )
        .select_from(Trigger)
        .join(instance, true())
        .join(run, true())
        .where(Trigger.id.in_(bindparam("ids", expanding=True)))
    )


class StartFromTrigger:
    """Which task rows' tasks start from the trigger, with Airflow's DAG version resolution: per batch
    one statement per DAG whose runs resolve to its latest version, one for the versions' hashes; a
    task's flag is read from its deserialized DAG once per (version, hash) for the whole start
    (``DagCache``)."""

    def __init__(self, session: Session, cache: DagCache, dag_bag: Any) -> None:
        self.session = session
        self.cache = cache
        self.dag_bag = dag_bag

    def of(self, rows: list[TaskRow]) -> dict[int, bool | Exception]:
        """trigger id -> the task starts from the trigger; an exception when its DAG cannot be read here."""
        latest = self._latest_versions({r.ti["dag_id"] for r in rows if not r.run_version_known})
        candidates = {r.trigger_id: self._candidates(r, latest) for r in rows}
        hashes = self._hashes({v for versions in candidates.values() for v in versions})
        flags: dict[int, bool | Exception] = {}
        for row in rows:
            version = next((v for v in candidates[row.trigger_id] if v in hashes), None)
            flags[row.trigger_id] = (
                False if version is None else self._flag(version, hashes[version], row.ti["task_id"])
            )
        return flags

    @staticmethod
    def _candidates(row: TaskRow, latest: dict[str, Any]) -> list[Any]:
        """The run's version, then the task instance's own (Airflow: ``model_for_run or model(ti's)``)."""
        run_version = (
            row.created_dag_version_id
            if row.run_version_known
            else latest.get(row.ti["dag_id"], row.created_dag_version_id)
        )
        return [v for v in (run_version, row.ti["dag_version_id"]) if v is not None]

    def _latest_versions(self, dag_ids: set[str]) -> dict[str, Any]:
        found = {}
        for dag_id in dag_ids:  # Airflow's own select (its ordering), one id read per DAG
            stmt = DagVersion._latest_version_select(dag_id).with_only_columns(DagVersion.id)
            if (version_id := self.session.scalar(stmt)) is not None:
                found[dag_id] = version_id
        return found

    def _hashes(self, versions: set[Any]) -> dict[Any, str]:
        if not versions:
            return {}
        stmt = select(SerializedDagModel.dag_version_id, SerializedDagModel.dag_hash).where(
            SerializedDagModel.dag_version_id.in_(versions)
        )
        return {version: dag_hash for version, dag_hash in self.session.execute(stmt)}

    def _flag(self, version: Any, dag_hash: str, task_id: str) -> bool | Exception:
        key = (version, dag_hash, task_id)
        if key in self.cache.flags:
            return self.cache.flags[key]
        flag = self._read_flag(version, task_id)
        if not isinstance(flag, Exception):  # a failure is tried again by the next build (it may pass)
            self.cache.flags[key] = flag
        return flag

    def _read_flag(self, version: Any, task_id: str) -> bool | Exception:
        from airflow.exceptions import TaskNotFound

        try:
            model = self.dag_bag.get_serialized_dag_model(version_id=version, session=self.session)
            if model is None:
                return False
            task = self.cache.dag_of(model).get_task(task_id)
        except TaskNotFound:
            log.warning("Task not found in resolved Dag version; building plain workload", task_id=task_id)
            return False
        except SQLAlchemyError:
            raise  # the database's, not the DAG's: the caller tells an outage from a refused batch
        except Exception as err:  # e.g. a timetable or module the DAG needs is not installed on this host
            return err
        return bool(task.start_from_trigger)


def plain_workload(
    row: TaskRow, render_log_fname: Callable[..., str], log_id: object
) -> tuple[RunTrigger, TaskInstanceDTO, str] | None:
    """The workload Airflow builds for a task that does not start from the trigger, its DTO and log path;
    None when the row's values do not make a DTO (Airflow's own path then builds it, or says why)."""
    try:
        ti = TaskInstanceDTO.model_validate(row.ti)
    except ValidationError:
        return None
    log_path = f"{render_log_fname(ti=ti)}.trigger.{log_id}.log"
    workload = RunTrigger(
        id=row.trigger_id,
        classpath=row.classpath,
        encrypted_kwargs=row.encrypted_kwargs,
        ti=ti,
        timeout_after=row.trigger_timeout,
    )
    return workload, ti, log_path
