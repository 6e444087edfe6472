"""Unchanged producer DAGs: every successful try of a mapped task becomes exactly one asset event.

A small mapping file (YAML or JSON) names the tasks and the assets they stand for::

    producer_dag.load_users:          # dag_id.task_id
      - warehouse://dds/h_user        # an asset URI ...
      - users_loaded                  # ... or an asset name

Why a watermark poller over ``task_instance`` (and not a listener or a custom asset manager):

- A listener's ``on_task_instance_success`` runs in the worker after the success is committed; a worker
  that dies in between loses the event for good, and Airflow 3 workers have no metadata-DB session to
  write one. A custom ``asset_manager_class`` is only called for tasks that declare outlets, which is
  exactly what unchanged producers do not do.
- The poller reads successes from the metadata database, the source of truth, and writes each asset event
  together with a ledger row keyed by (dag_id, task_id, run_id, map_index, try_number) in **one
  transaction**. A bridge that crashes mid-way rolls back both (the next pass redoes it: nothing lost); a
  second bridge running at once blocks on the ledger's unique key and then skips (nothing doubled).
- Each mapped task has a horizon: the time the bridge first saw it in the mapping. Successes before it are
  history and are not replayed; any success after it is, however long the bridge was down.

Map a task here only if it does not already declare the asset as an outlet (Airflow would emit it too).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import yaml
from sqlalchemy import text
from sqlalchemy.orm import Session

from dataset_bridge import ddl

log = structlog.get_logger(__name__)

SCHEMA_DDL = """
CREATE SCHEMA IF NOT EXISTS dataset_bridge;
CREATE TABLE IF NOT EXISTS dataset_bridge.emitted (
    asset_id integer NOT NULL,
    idempotency_key text NOT NULL,
    source text NOT NULL,
    asset_event_id integer,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (asset_id, idempotency_key)
);
CREATE INDEX IF NOT EXISTS emitted_key ON dataset_bridge.emitted (idempotency_key);
CREATE TABLE IF NOT EXISTS dataset_bridge.task_horizon (
    dag_id text NOT NULL,
    task_id text NOT NULL,
    since timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (dag_id, task_id)
);
CREATE TABLE IF NOT EXISTS dataset_bridge.reconciled (
    asset_event_id integer NOT NULL,
    dag_id text NOT NULL,
    queued_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (asset_event_id, dag_id)
);
"""

PENDING_SUCCESSES = """
SELECT ti.id, ti.dag_id, ti.task_id, ti.run_id, ti.map_index, ti.try_number
FROM task_instance ti
JOIN dataset_bridge.task_horizon h ON h.dag_id = ti.dag_id AND h.task_id = ti.task_id
WHERE ti.state = 'success' AND ti.end_date >= h.since
  AND (ti.dag_id || '.' || ti.task_id) = ANY(:mapped)
  AND NOT EXISTS (
      SELECT 1 FROM dataset_bridge.emitted e
      WHERE e.idempotency_key = concat_ws('/', 'task', ti.dag_id, ti.task_id, ti.run_id, ti.map_index,
                                          ti.try_number))
ORDER BY ti.end_date
LIMIT :limit
"""

CLAIM_KEY = """
INSERT INTO dataset_bridge.emitted (asset_id, idempotency_key, source)
VALUES (:asset_id, :key, :source)
ON CONFLICT DO NOTHING
RETURNING asset_id
"""


class MappingError(ValueError):
    """The mapping file cannot be used; the message names the file and the entry."""


@dataclass(frozen=True)
class TaskMapping:
    """``dag_id.task_id`` -> asset URIs or names."""

    entries: dict[tuple[str, str], tuple[str, ...]]

    @classmethod
    def load(cls, path: str | Path) -> TaskMapping:
        file = Path(path)
        try:
            raw = yaml.safe_load(file.read_text()) if file.suffix != ".json" else json.loads(file.read_text())
        except (OSError, yaml.YAMLError, json.JSONDecodeError) as err:
            raise MappingError(f"{file}: cannot read the task mapping: {err}") from err
        return cls.parse(raw, source=str(file))

    @classmethod
    def parse(cls, raw: Any, *, source: str = "mapping") -> TaskMapping:
        if not isinstance(raw, dict) or not raw:
            raise MappingError(f"{source}: expected a mapping of 'dag_id.task_id' to a list of assets")
        entries: dict[tuple[str, str], tuple[str, ...]] = {}
        for name, value in raw.items():
            dag_id, dot, task_id = str(name).partition(".")
            if not dot or not dag_id or not task_id:
                raise MappingError(f"{source}: {name!r} is not 'dag_id.task_id'")
            assets = [value] if isinstance(value, str) else value
            if not isinstance(assets, list) or not assets \
                    or not all(a and isinstance(a, str) for a in assets):
                raise MappingError(f"{source}: {name!r} must map to a non-empty list of asset URIs or names")
            entries[(dag_id, task_id)] = tuple(assets)
        return cls(entries)

    def names(self) -> list[str]:
        return [f"{dag_id}.{task_id}" for dag_id, task_id in self.entries]


def ensure_schema(session: Session) -> None:
    ddl.apply(session, SCHEMA_DDL)


def register_horizons(session: Session, mapping: TaskMapping) -> None:
    for dag_id, task_id in mapping.entries:
        session.execute(text("INSERT INTO dataset_bridge.task_horizon (dag_id, task_id) VALUES (:d, :t) "
                             "ON CONFLICT DO NOTHING"), {"d": dag_id, "t": task_id})


def success_key(dag_id: str, task_id: str, run_id: str, map_index: int, try_number: int) -> str:
    return "/".join(("task", dag_id, task_id, run_id, str(map_index), str(try_number)))


def resolve_asset(session: Session, ref: str) -> Any:
    """The active asset with this URI, else with this name; None (with a warning) when there is none."""
    from airflow.models.asset import AssetActive, AssetModel
    from sqlalchemy import or_, select

    candidates = session.scalars(
        select(AssetModel).join(AssetActive, (AssetActive.name == AssetModel.name)
                                & (AssetActive.uri == AssetModel.uri))
        .where(or_(AssetModel.uri == ref, AssetModel.name == ref))
    ).all()
    by_uri = [a for a in candidates if a.uri == ref]
    found = (by_uri or list(candidates))[0] if candidates else None
    if found is None:
        log.warning("mapped asset not found (no DAG declares it yet)", asset=ref)
    return found


def pending(session: Session, mapping: TaskMapping, limit: int = 200) -> list[Any]:
    return list(session.execute(text(PENDING_SUCCESSES), {"mapped": mapping.names(), "limit": limit}).all())


def emit_one(session: Session, mapping: TaskMapping, row: Any) -> int:
    """Asset events for one successful try, in the caller's transaction; returns how many were created."""
    from airflow.assets.manager import asset_manager
    from airflow.models.taskinstance import TaskInstance

    key = success_key(row.dag_id, row.task_id, row.run_id, row.map_index, row.try_number)
    ti = session.get(TaskInstance, row.id)
    created = 0
    for ref in mapping.entries[(row.dag_id, row.task_id)]:
        asset = resolve_asset(session, ref)
        if asset is None or ti is None:
            continue
        claimed = session.execute(text(CLAIM_KEY), {"asset_id": asset.id, "key": key,
                                                     "source": "task_success"}).first()
        if claimed is None:
            continue  # another bridge made it first
        event = asset_manager.register_asset_change(
            task_instance=ti, asset=asset.to_serialized(), session=session,
            extra={"idempotency_key": key, "bridge": "task_success", "try_number": row.try_number})
        if event is not None:
            session.execute(text("UPDATE dataset_bridge.emitted SET asset_event_id = :e "
                                 "WHERE asset_id = :a AND idempotency_key = :k"),
                            {"e": event.id, "a": asset.id, "k": key})
            created += 1
    # an asset no DAG declares yet emits nothing and is tried again next pass: nothing is lost
    return created
