"""Fan-out: resume or fail many task instances in one transaction, with a few statements.

Stock Airflow resumes each task instance through the ORM and commits each event on its own (~115 tasks/s
here). Here every event of a loop is applied in one transaction: one row-locking SELECT, the new
``next_kwargs`` computed once per distinct (stored kwargs, event) pair, one UPDATE for all. Anything the
fast path cannot express (task-end events, undecodable kwargs) goes through Airflow's own
``handle_event_submit``, which also decides how such a task fails.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import cache, lru_cache
from traceback import format_exception
from typing import Any

import structlog
from airflow.models.taskinstance import TaskInstance
from airflow.models.trigger import TriggerFailureReason, handle_event_submit
from airflow.triggers.base import TriggerEvent
from sqlalchemy import select, text
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from smart_triggerer.db.errors import is_outage, storable
from smart_triggerer.db.store import RowScope, Store, queries, scope_params

log = structlog.get_logger(logger_name=__name__)

Batch = tuple[Sequence[int], TriggerEvent]


@cache
def _event_adapter() -> Any:
    from airflow.triggers.base import DiscrimatedTriggerEvent
    from pydantic import TypeAdapter

    return TypeAdapter(DiscrimatedTriggerEvent)


def event_text(event: TriggerEvent) -> str | None:
    """An event as the runner sends it (pydantic JSON), to be stored while held; None when it cannot be
    written as text (the caller then resumes at once rather than hold what it could not store)."""
    try:
        return str(_event_adapter().dump_json(event).decode())
    except Exception:
        return None


@lru_cache(maxsize=1024)  # a takeover reads one stored event for each of thousands of members
def event_from_text(stored: str) -> TriggerEvent:
    return _event_adapter().validate_json(stored)  # type: ignore[no-any-return]


def _resumed_kwargs(stored: Any, payload: Any) -> str | None:
    """``next_kwargs`` with the event added, as JSON text; None when Airflow's own path must decide."""
    from airflow.models.trigger import _decode_next_kwargs
    from airflow.sdk.serde import serialize

    try:
        next_kwargs = _decode_next_kwargs(stored or {})
        next_kwargs["event"] = payload
        return json.dumps(serialize(next_kwargs))
    except Exception:
        return None


def resume(session: Session, batches: Sequence[Batch]) -> int:
    """Resume every deferred task instance of each batch's triggers with that batch's event."""
    plain = {tid: event for ids, event in batches if type(event) is TriggerEvent for tid in ids}
    special = [(ids, event) for ids, event in batches if type(event) is not TriggerEvent]
    resumed = 0
    if plain:
        locked = session.execute(text(queries()["lock_deferred"]), {"trigger_ids": list(plain)}).all()
        cache: dict[tuple[str, int], str | None] = {}
        ids: list[str] = []
        values: list[str] = []
        slow: list[tuple[Any, TriggerEvent]] = []
        for ti_id, trigger_id, stored in locked:
            event = plain[trigger_id]
            key = (json.dumps(stored, sort_keys=True), id(event))
            if key not in cache:
                cache[key] = _resumed_kwargs(stored, event.payload)
            if cache[key] is None:
                slow.append((ti_id, event))
            else:
                ids.append(str(ti_id))
                values.append(cache[key])  # type: ignore[arg-type]
        if ids:
            session.execute(text(queries()["resume_task_instances"]), {"ids": ids, "next_kwargs": values})
        resumed += len(ids) + _resume_through_airflow(session, slow)
    for trigger_ids, event in special:
        tis = session.scalars(
            select(TaskInstance)
            .where(TaskInstance.trigger_id.in_(list(trigger_ids)), TaskInstance.state == "deferred")
            .order_by(TaskInstance.id)  # every writer of ours locks in id order: no deadlocks
            .with_for_update(of=TaskInstance)
        ).all()
        resumed += _resume_through_airflow(session, [(ti.id, event) for ti in tis])
    delete_unused(session, [tid for ids, _event in batches for tid in ids])
    return resumed


def delete_unused(session: Session, trigger_ids: Sequence[int]) -> None:
    """The trigger rows these tasks no longer need go in the same transaction (their deletion is how the
    change feed tells their owners that the waits left), so Airflow's clean_unused, which reads every
    trigger row, need not run every few seconds. In a savepoint: a lock it cannot get in time or any
    other error leaves those rows to the sweep, never fails or delays the resume itself."""
    if not trigger_ids:
        return
    try:
        with session.begin_nested():
            Store(session).delete_unused_triggers(trigger_ids)
    except SQLAlchemyError as err:
        if is_outage(err):
            # the connection is gone and the whole transaction with it: the caller must see the outage
            # (events kept, retried), not a PendingRollbackError at its commit that blames an event
            raise
        log.warning(
            "unused trigger rows left to the sweep",
            triggers=len(set(trigger_ids)),
            error=str(err).splitlines()[0],
        )


def _resume_through_airflow(session: Session, items: Sequence[tuple[Any, TriggerEvent]]) -> int:
    for ti_id, event in items:
        ti = session.get(TaskInstance, ti_id)
        if ti is not None:
            handle_event_submit(event, task_instance=ti, session=session)
    return len(items)


def fail(session: Session, trigger_ids: Sequence[int], exc: Any) -> int:
    """As ``Trigger.submit_failure``, for every deferred task instance of these triggers at once."""
    traceback = format_exception(type(exc), exc, exc.__traceback__) if isinstance(exc, BaseException) else exc
    if not trigger_ids:
        return 0
    # a traceback may quote a payload: next_kwargs is jsonb, which holds neither NUL nor lone surrogates
    traceback = [storable(str(line)) for line in traceback or ()]
    locked = session.execute(text(queries()["lock_deferred"]), {"trigger_ids": list(trigger_ids)}).all()
    if not locked:
        return 0
    next_kwargs = json.dumps({"error": TriggerFailureReason.TRIGGER_FAILURE.value, "traceback": traceback})
    session.execute(
        text(queries()["fail_task_instances"]),
        {"ids": [str(row[0]) for row in locked], "next_kwargs": next_kwargs},
    )
    delete_unused(session, trigger_ids)
    return len(locked)


def timeout(session: Session, shards: Sequence[int], queues: RowScope | Sequence[str] | None) -> list[int]:
    """Time out deferred members of these (fenced) shards whose own ``trigger_timeout`` passed; returns
    the ids of their triggers."""
    if not shards:
        return []
    next_kwargs = json.dumps({"error": TriggerFailureReason.TRIGGER_TIMEOUT.value})
    result = session.execute(
        text(queries()["timeout_members"]),
        {"shards": list(shards), **scope_params(queues), "next_kwargs": next_kwargs},
    )
    timed_out = [int(row[0]) for row in result]
    delete_unused(session, timed_out)
    return timed_out


def submit_watcher_event(session: Session, trigger_id: int, event: TriggerEvent) -> None:
    """As ``Trigger.submit_event`` for an asset watcher (or callback), with idempotency keys honoured.

    An event whose payload carries ``idempotency_key`` makes at most one asset event per asset and key:
    the key is claimed in ``smart_triggerer.asset_event_key`` in this same transaction. Events without a
    key behave exactly as in stock Airflow.
    """
    from airflow.assets.manager import asset_manager
    from airflow.models.asset import AssetWatcherModel
    from airflow.models.trigger import Trigger
    from sqlalchemy.orm import selectinload

    payload = event.payload
    key = payload.get("idempotency_key") if isinstance(payload, dict) else None
    if not isinstance(key, str) or not key:
        Trigger.submit_event(trigger_id=trigger_id, event=event, session=session)
        return
    trigger = session.scalars(
        select(Trigger)
        .where(Trigger.id == trigger_id)
        .options(selectinload(Trigger.asset_watchers).selectinload(AssetWatcherModel.asset))
    ).one_or_none()
    if trigger is None:
        return
    for asset in trigger.assets:
        claimed = session.execute(
            text(queries()["claim_asset_event_key"]),
            {"asset_id": asset.id, "key": key, "trigger_id": trigger_id},
        ).first()
        if claimed is None:
            continue  # this asset already has the event for this key
        asset_manager.register_asset_change(
            asset=asset.to_serialized(), extra={"from_trigger": True, "payload": payload}, session=session
        )
    if trigger.callback:
        trigger.callback.handle_event(event, session)
