"""Many asset events for one asset in one go, with what Airflow's ``register_asset_change`` does for each.

The inbox receives events in batches of up to 1,000; creating them one by one through the asset manager
costs about ten statements each (the asset with its consumers, the event, alias links, name and URI
references, the consumer queue, listeners). For an event without a task instance, alias or partition key
all but the event row are the same for every event of one asset, so here they are done once per batch:

- one multi-row INSERT of the events (ids in batch order);
- the consumer queue (``asset_dag_run_queue``) once for the asset: Airflow inserts the same rows,
  ON CONFLICT DO NOTHING, for every event;
- the ``asset.updates`` metric incremented by the number of events.

Listeners are told about every event, as Airflow does. Where the equivalence does not hold, each event
goes through ``register_asset_change`` as before: multi-team deployments (consumer filtering per event)
and consumers with partitioned timetables (per-event partition runs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import insert, or_, select
from sqlalchemy.orm import Session


def _consumers(session: Session, asset: Any) -> set[Any]:
    """Unpaused DAGs that schedule on the asset: by reference, by name or by URI (as Airflow queues)."""
    from airflow.models.asset import (
        DagScheduleAssetNameReference,
        DagScheduleAssetReference,
        DagScheduleAssetUriReference,
    )
    from airflow.models.dag import DagModel

    by_asset = set(
        session.scalars(
            select(DagModel)
            .join(DagScheduleAssetReference, DagScheduleAssetReference.dag_id == DagModel.dag_id)
            .where(DagScheduleAssetReference.asset_id == asset.id, DagModel.is_paused.is_(False))
        )
    )
    by_ref = set(
        session.scalars(
            select(DagModel)
            .join(DagModel.schedule_asset_name_references, isouter=True)
            .join(DagModel.schedule_asset_uri_references, isouter=True)
            .where(
                or_(
                    DagScheduleAssetNameReference.name == asset.name,
                    DagScheduleAssetUriReference.uri == asset.uri,
                ),
                DagModel.is_paused.is_(False),
            )
        )
    )
    return by_asset | by_ref


def batchable(session: Session, consumers: set[Any]) -> bool:
    """Whether a batch is equivalent to one ``register_asset_change`` per event (module docstring)."""
    from airflow.configuration import conf

    if conf.getboolean("core", "multi_team", fallback=False):
        return False
    return not any(getattr(dag, "timetable_partitioned", False) for dag in consumers)


def create_events(session: Session, asset: Any, extras: Sequence[dict[str, Any]]) -> list[int]:
    """Asset events for ``asset`` (an active AssetModel), one per extra, in the caller's transaction;
    their ids in the same order."""
    from airflow.assets.manager import AssetManager, asset_manager
    from airflow.models.asset import AssetEvent

    if not extras:
        return []
    consumers = _consumers(session, asset)
    if not batchable(session, consumers):
        created = [
            asset_manager.register_asset_change(asset=asset.to_serialized(), extra=extra, session=session)
            for extra in extras
        ]
        return [event.id for event in created if event is not None]
    table = AssetEvent.__table__  # Core, not the ORM: nothing to load back but the ids
    ids = list(
        session.execute(
            insert(table).returning(table.c.id, sort_by_parameter_order=True),
            [{"asset_id": asset.id, "extra": dict(extra), "partition_key": None} for extra in extras],
        ).scalars()
    )
    _count_updates(len(ids))
    _notify_listeners(asset, extras)
    if consumers:
        # the rows register_asset_change inserts for each event (ON CONFLICT DO NOTHING), once
        AssetManager._queue_dagruns(
            asset_id=asset.id,
            dags_to_queue=consumers,
            partition_key=None,
            partition_date=None,
            event=None,  # type: ignore[arg-type]
            task_instance=None,
            session=session,
        )
    return ids


def _notify_listeners(asset: Any, extras: Sequence[dict[str, Any]]) -> None:
    """What register_asset_change tells listeners (on_asset_changed, on_asset_event_emitted), per event."""
    from airflow.assets.manager import AssetManager
    from airflow.listeners.listener import get_listener_manager
    from airflow.listeners.types import AssetEvent as ListenerAssetEvent

    if not get_listener_manager().has_listeners:
        return
    serialized = asset.to_serialized()
    for extra in extras:
        AssetManager.notify_asset_changed(asset=serialized)
        AssetManager.nofity_asset_event_emitted(
            asset_event=ListenerAssetEvent(
                asset=serialized,
                extra=dict(extra),
                source_dag_id=None,
                source_task_id=None,
                source_run_id=None,
                source_map_index=None,
                source_aliases=[],
                partition_key=None,
                partition_date=None,
            )
        )


def _count_updates(count: int) -> None:
    from airflow._shared.observability.metrics import stats

    stats.incr("asset.updates", count=count)
