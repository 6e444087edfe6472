"""Pruning against a real (migrated) Airflow metadata database with the bridge's and the smart triggerer's
ledgers: old rows go in small batches, young ones and dead letters stay, and the sweeper does not bring
back events whose delivered outbox rows were pruned."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import text

from dataset_bridge import inbox, outbox, retention, task_success
from dataset_bridge.retention import Retention
from tests.helpers.airflow_orm import use_airflow_db

OLD, YOUNG = "now() - interval '40 days'", "now() - interval '1 day'"


def _session() -> Any:
    from airflow.utils.session import create_session

    return create_session()


def _schemas(pg: str) -> None:
    from smart_triggerer.db.store import Store

    use_airflow_db(pg)
    with _session() as session:
        task_success.ensure_schema(session)
        outbox.ensure_schema(session)
        inbox._ensure_schema(session)
        Store(session).migrate(16)


def _fill(session: Any, age: str, start: int, count: int) -> None:
    for n in range(start, start + count):
        session.execute(
            text(
                "INSERT INTO dataset_bridge.emitted (asset_id, idempotency_key, source, "
                f"created_at) VALUES (1, :k, 'task_success', {age})"
            ),
            {"k": f"k{n}"},
        )
        session.execute(
            text(
                f"INSERT INTO dataset_bridge.reconciled (asset_event_id, dag_id, queued_at) "
                f"VALUES (:n, 'd', {age})"
            ),
            {"n": n},
        )
        session.execute(
            text(
                f"INSERT INTO dataset_bridge.inbox (source, source_event_id, received_at) "
                f"VALUES ('a', :n, {age})"
            ),
            {"n": n},
        )
        session.execute(
            text(
                "INSERT INTO smart_triggerer.asset_event_key (asset_id, idempotency_key, "
                f"created_at) VALUES (1, :k, {age})"
            ),
            {"k": f"k{n}"},
        )
        session.execute(
            text(
                "INSERT INTO dataset_bridge.outbox (target, asset_event_id, asset_uri, asset_name, "
                f"event_timestamp, status, delivered_at) VALUES ('b', :n, 'x', 'x', {age}, :s, {age})"
            ),
            {"n": n, "s": "dead" if n % 5 == 0 else "delivered"},
        )


def _count(table: str) -> int:
    with _session() as session:
        return int(session.execute(text(f"SELECT count(*) FROM {table}")).scalar() or 0)


def test_old_ledger_rows_are_pruned_in_batches_and_young_ones_kept(airflow_db: str) -> None:
    _schemas(airflow_db)
    with _session() as session:
        _fill(session, OLD, 1, 7)
        _fill(session, YOUNG, 100, 3)
    tables = [
        "dataset_bridge.emitted",
        "dataset_bridge.reconciled",
        "dataset_bridge.inbox",
        "smart_triggerer.asset_event_key",
        "dataset_bridge.outbox",
    ]
    deleted = retention.prune(_session, tables, Retention(days=30, batch=2))
    # the dead letter (event 5) stays; every batch deleted at most 2 rows, all batches together all 7
    assert deleted == {**dict.fromkeys(tables[:4], 7), "dataset_bridge.outbox": 6}
    assert [_count(t) for t in tables] == [3, 3, 3, 3, 4]


def test_the_sweeper_reads_only_what_is_new_and_never_resurrects_pruned_rows(
    airflow_db: str, tmp_path: Path
) -> None:
    from airflow.assets.manager import AssetManager
    from airflow.models.asset import AssetActive, AssetModel

    from dataset_bridge.routes import Routes

    use_airflow_db(airflow_db)
    with _session() as session:
        outbox.ensure_schema(session)
        session.add_all(
            [AssetModel(name="u", uri="warehouse://u"), AssetActive(name="u", uri="warehouse://u")]
        )
    routes = Routes.parse(
        {
            "source": "a",
            "targets": {
                "b": {"url": "http://127.0.0.1:1/inbox", "secret_env": "X", "assets": ["warehouse://u"]}
            },
        }
    )
    with _session() as session:
        outbox.sweep(session, routes)
    with _session() as session:
        # made while the relay was down for weeks: the next sweep finds it, however old its timestamp
        asset = session.query(AssetModel).filter_by(uri="warehouse://u").one().to_serialized()
        old = AssetManager.register_asset_change(asset=asset, extra={}, session=session)
        assert old is not None
        session.flush()
        session.execute(
            text("UPDATE asset_event SET timestamp = now() - interval '40 days' WHERE id = :i"), {"i": old.id}
        )
    with _session() as session:
        assert outbox.sweep(session, routes) == 1  # the old event, after the target's cursor
        session.execute(
            text(
                "UPDATE dataset_bridge.outbox SET status = 'delivered', "
                "delivered_at = now() - interval '40 days'"
            )
        )
    assert retention.prune(_session, ["dataset_bridge.outbox"], Retention(days=30)) == {
        "dataset_bridge.outbox": 1
    }
    with _session() as session:
        new = AssetManager.register_asset_change(asset=asset, extra={}, session=session)
        assert new is not None
    with _session() as session:
        assert outbox.sweep(session, routes) == 1  # the new one only: the cursor moved past the old
        ids = [r[0] for r in session.execute(text("SELECT asset_event_id FROM dataset_bridge.outbox"))]
    assert ids == [new.id]  # the pruned, delivered event was not added (and sent) again
