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
- The poller reads successes from the metadata database, the source of truth (``task_instance`` and, for
  tries cleared or retried since, ``task_instance_history``), and writes each asset event together with a
  ledger row keyed by (asset, dag_id, task_id, run_id, map_index, try_number) in **one transaction**. A
  bridge that crashes mid-way rolls back both (the next pass redoes it: nothing lost); a
  second bridge running at once blocks on the ledger's unique key and then skips (nothing doubled).
- Each (try, asset) pair is claimed on its own: an asset that no DAG declares yet gets its events for
  earlier tries once one does.
- Each mapped task has a horizon: the time the bridge first saw it in the mapping. Successes before it are
  history and are not replayed; any success after it is, however long the bridge was down, as long as it
  is younger than the retention (``--retention-days``, 30).

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

from dataset_bridge import store

log = structlog.get_logger(__name__)


# Mapped refs resolve to the active asset with that URI, else with that name (as the inbox does).
# Successful tries come from task_instance (the current try) and task_instance_history (tries that were
# cleared or retried since), so a success cleared before the bridge saw it is still emitted. Each
# (try, asset) is claimed on its own: an asset declared later still gets its event for earlier tries.
PENDING_SUCCESSES = """
WITH mapped AS (
    SELECT m.dag_id, m.task_id, m.ref
    FROM unnest(CAST(:dags AS text[]), CAST(:tasks AS text[]), CAST(:refs AS text[]))
         AS m(dag_id, task_id, ref)
), resolved AS (
    SELECT m.dag_id, m.task_id, a.id AS asset_id
    FROM mapped m
    CROSS JOIN LATERAL (
        SELECT a.id FROM asset a JOIN asset_active aa ON aa.name = a.name AND aa.uri = a.uri
        WHERE a.uri = m.ref OR a.name = m.ref
        ORDER BY (a.uri = m.ref) DESC, a.id LIMIT 1
    ) a
), tries AS (
    SELECT ti.dag_id, ti.task_id, ti.run_id, ti.map_index, ti.try_number, ti.end_date
    FROM task_instance ti
    WHERE ti.state = 'success' AND (ti.dag_id, ti.task_id) IN (SELECT dag_id, task_id FROM mapped)
    UNION
    SELECT h.dag_id, h.task_id, h.run_id, h.map_index, h.try_number, h.end_date
    FROM task_instance_history h
    WHERE h.state = 'success' AND (h.dag_id, h.task_id) IN (SELECT dag_id, task_id FROM mapped)
)
SELECT DISTINCT t.dag_id, t.task_id, t.run_id, t.map_index, t.try_number, t.end_date, r.asset_id
FROM tries t
JOIN dataset_bridge.task_horizon h ON h.dag_id = t.dag_id AND h.task_id = t.task_id
JOIN resolved r ON r.dag_id = t.dag_id AND r.task_id = t.task_id
WHERE t.end_date >= h.since
  AND t.end_date >= now() - make_interval(secs => :retention)  -- older ledger rows may be pruned
  AND NOT EXISTS (
      SELECT 1 FROM dataset_bridge.emitted e
      WHERE e.asset_id = r.asset_id
        AND e.idempotency_key = concat_ws('/', 'task', t.dag_id, t.task_id, t.run_id, t.map_index,
                                          t.try_number))
ORDER BY t.end_date, t.dag_id, t.task_id, t.run_id, t.map_index, t.try_number, r.asset_id
LIMIT :limit
"""

UNRESOLVED = """
SELECT m.ref
FROM unnest(CAST(:refs AS text[])) AS m(ref)
WHERE NOT EXISTS (SELECT 1 FROM asset a JOIN asset_active aa ON aa.name = a.name AND aa.uri = a.uri
                  WHERE a.uri = m.ref OR a.name = m.ref)
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
            if not isinstance(value, list) or not value or not all(a and isinstance(a, str) for a in value):
                got = "" if isinstance(value, list) else f", got {type(value).__name__} {value!r}"
                hint = f" (write [{value!r}])" if isinstance(value, str) else ""
                raise MappingError(
                    f"{source}: {name!r} must map to a non-empty list of asset URIs or names{got}{hint}"
                )
            entries[(dag_id, task_id)] = tuple(value)
        return cls(entries)

    def names(self) -> list[str]:
        return [f"{dag_id}.{task_id}" for dag_id, task_id in self.entries]


def ensure_schema(session: Session) -> None:
    store.migrate(session)


def register_horizons(session: Session, mapping: TaskMapping) -> None:
    for dag_id, task_id in mapping.entries:
        session.execute(
            text(
                "INSERT INTO dataset_bridge.task_horizon (dag_id, task_id) VALUES (:d, :t) "
                "ON CONFLICT DO NOTHING"
            ),
            {"d": dag_id, "t": task_id},
        )


def success_key(dag_id: str, task_id: str, run_id: str, map_index: int, try_number: int) -> str:
    return "/".join(("task", dag_id, task_id, run_id, str(map_index), str(try_number)))


def _mapped_params(mapping: TaskMapping) -> dict[str, list[str]]:
    pairs = [(dag_id, task_id, ref) for (dag_id, task_id), refs in mapping.entries.items() for ref in refs]
    return {"dags": [p[0] for p in pairs], "tasks": [p[1] for p in pairs], "refs": [p[2] for p in pairs]}


def pending(
    session: Session, mapping: TaskMapping, limit: int = 200, retention_seconds: float = 30 * 86400.0
) -> list[Any]:
    """(successful try, resolved asset) pairs with no event yet, oldest success first; tries that ended
    longer ago than the ledger's retention are history (their ledger rows may be pruned)."""
    params = {**_mapped_params(mapping), "limit": limit, "retention": retention_seconds}
    return list(session.execute(text(PENDING_SUCCESSES), params).all())


def unresolved(session: Session, mapping: TaskMapping) -> list[str]:
    """Mapped refs no active asset has (yet): their tries wait, and get their events once one does."""
    refs = sorted({ref for refs in mapping.entries.values() for ref in refs})
    return [str(r) for r in session.execute(text(UNRESOLVED), {"refs": refs}).scalars()]


def emit_one(session: Session, row: Any) -> int:
    """The asset event for one (successful try, asset) pair, in the caller's transaction: 1 or 0."""
    from airflow.assets.manager import asset_manager
    from airflow.models.asset import AssetModel
    from airflow.models.taskinstance import TaskInstance
    from sqlalchemy import select

    key = success_key(row.dag_id, row.task_id, row.run_id, row.map_index, row.try_number)
    # the current task instance of this (dag, task, run, map index): a cleared try's own id is gone
    ti = session.scalars(
        select(TaskInstance).where(
            TaskInstance.dag_id == row.dag_id,
            TaskInstance.task_id == row.task_id,
            TaskInstance.run_id == row.run_id,
            TaskInstance.map_index == row.map_index,
        )
    ).first()
    asset = session.get(AssetModel, row.asset_id)
    if ti is None or asset is None:
        return 0  # the run was deleted meanwhile: nothing to attribute the event to
    claimed = session.execute(
        text(CLAIM_KEY), {"asset_id": asset.id, "key": key, "source": "task_success"}
    ).first()
    if claimed is None:
        return 0  # another bridge made it first
    event = asset_manager.register_asset_change(
        task_instance=ti,
        asset=asset.to_serialized(),
        session=session,
        extra={"idempotency_key": key, "bridge": "task_success", "try_number": row.try_number},
    )
    if event is None:
        return 0
    session.execute(
        text(
            "UPDATE dataset_bridge.emitted SET asset_event_id = :e "
            "WHERE asset_id = :a AND idempotency_key = :k"
        ),
        {"e": event.id, "a": asset.id, "k": key},
    )
    return 1
