"""The outbox against a real (migrated) Airflow metadata database: rows with the event, and the sweeper."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import text

from tests.helpers.airflow_orm import use_airflow_db

ROUTES = """
source: deployment_a
targets:
  deployment_b:
    url: http://127.0.0.1:1/dataset-bridge/inbox
    secret_env: BRIDGE_SECRET_B
    assets: [warehouse://dds/h_user]
"""


def test_routed_events_get_an_outbox_row_in_their_transaction_and_the_sweeper_adds_missed_ones(
        airflow_db: str, tmp_path: Path) -> None:
    from airflow.assets.manager import AssetManager
    from airflow.models.asset import AssetActive, AssetModel
    from airflow.utils.session import create_session

    from dataset_bridge import outbox
    from dataset_bridge.asset_manager import OutboxAssetManager
    from dataset_bridge.routes import Routes

    use_airflow_db(airflow_db)
    routes_file = tmp_path / "routes.yaml"
    routes_file.write_text(ROUTES)
    manager = OutboxAssetManager(routes=str(routes_file))
    with create_session() as session:
        outbox.ensure_schema(session)
        for uri in ("warehouse://dds/h_user", "warehouse://dds/other"):
            session.add_all([AssetModel(name=uri, uri=uri), AssetActive(name=uri, uri=uri)])
    with create_session() as session:
        routed = session.query(AssetModel).filter_by(uri="warehouse://dds/h_user").one().to_serialized()
        other = session.query(AssetModel).filter_by(uri="warehouse://dds/other").one().to_serialized()
        event = manager.register_asset_change(asset=routed, extra={"n": 1}, session=session)
        manager.register_asset_change(asset=other, extra={}, session=session)
    with create_session() as session:
        query = "SELECT target, asset_event_id, asset_uri, extra FROM dataset_bridge.outbox"
        found = session.execute(text(query)).all()
        assert found == [("deployment_b", event.id, "warehouse://dds/h_user", {"n": 1})]

    # a rolled-back event leaves no outbox row behind
    with create_session() as session:
        manager.register_asset_change(asset=routed, extra={"n": 2}, session=session)
        session.rollback()
    # an event made without the manager (an asset watcher under the stock triggerer): the sweeper adds it
    routes = Routes.load(routes_file)
    with create_session() as session:
        outbox.sweep(session, routes)  # registers the target: only events from now on are swept
    with create_session() as session:
        missed = AssetManager.register_asset_change(asset=routed, extra={"watcher": True}, session=session)
    with create_session() as session:
        assert outbox.sweep(session, routes) == 0  # too young: its transaction may still be settling
        assert outbox.sweep(session, routes, settle_seconds=0) == 1
        assert outbox.sweep(session, routes, settle_seconds=0) == 0
        query = "SELECT asset_event_id FROM dataset_bridge.outbox ORDER BY id"
        ids = [r[0] for r in session.execute(text(query))]
    assert ids == [event.id, missed.id]


def test_events_before_the_relays_first_start_keep_their_place_in_the_outbox(
        airflow_db: str, tmp_path: Path) -> None:
    """Routing configured, the relay never started yet: an event made through the asset manager gets its
    outbox row (the manager creates the schema), and a watcher event made after it (no manager) is swept
    when the relay finally starts: the window opens when routing was first seen, not at the first sweep."""
    from airflow.assets.manager import AssetManager
    from airflow.models.asset import AssetActive, AssetModel
    from airflow.utils.session import create_session

    from dataset_bridge import outbox
    from dataset_bridge.asset_manager import OutboxAssetManager
    from dataset_bridge.routes import Routes

    use_airflow_db(airflow_db)
    routes_file = tmp_path / "routes.yaml"
    routes_file.write_text(ROUTES)
    manager = OutboxAssetManager(routes=str(routes_file))
    uri = "warehouse://dds/h_user"
    with create_session() as session:
        session.add_all([AssetModel(name=uri, uri=uri), AssetActive(name=uri, uri=uri)])
    with create_session() as session:
        assert session.execute(text("SELECT to_regclass('dataset_bridge.outbox')")).scalar() is None
        routed = session.query(AssetModel).filter_by(uri=uri).one().to_serialized()
        by_manager = manager.register_asset_change(asset=routed, extra={}, session=session)
    with create_session() as session:
        by_watcher = AssetManager.register_asset_change(asset=routed, extra={"watcher": True},
                                                        session=session)
    # the relay starts only now
    with create_session() as session:
        assert outbox.sweep(session, Routes.load(routes_file), settle_seconds=0) == 1
    with create_session() as session:
        query = "SELECT asset_event_id FROM dataset_bridge.outbox ORDER BY id"
        ids = [r[0] for r in session.execute(text(query))]
    assert ids == [by_manager.id, by_watcher.id]


def test_an_extra_jsonb_cannot_hold_never_fails_its_producer_and_is_dead_lettered_alone(
        airflow_db: str, tmp_path: Path) -> None:
    """Airflow stores ``extra`` as json, which takes a NUL character or an unpaired surrogate; jsonb, the
    outbox's type, refuses both. The producer's transaction still commits, the event is dead-lettered
    alone with the reason (by the sweep, for events made through the manager and without it alike) and
    every other event gets its row."""
    from airflow.assets.manager import AssetManager
    from airflow.models.asset import AssetActive, AssetModel
    from airflow.utils.session import create_session

    from dataset_bridge import outbox
    from dataset_bridge.asset_manager import OutboxAssetManager
    from dataset_bridge.routes import Routes

    use_airflow_db(airflow_db)
    routes_file = tmp_path / "routes.yaml"
    routes_file.write_text(ROUTES)
    manager = OutboxAssetManager(routes=str(routes_file))
    uri = "warehouse://dds/h_user"
    with create_session() as session:
        outbox.ensure_schema(session)
        session.add_all([AssetModel(name=uri, uri=uri), AssetActive(name=uri, uri=uri)])
    with create_session() as session:
        routed = session.query(AssetModel).filter_by(uri=uri).one().to_serialized()
        first = manager.register_asset_change(asset=routed, extra={"n": 1}, session=session)
        nul = manager.register_asset_change(asset=routed, extra={"note": "a\x00b"}, session=session)
        nul_key = manager.register_asset_change(asset=routed, extra={"k\x00": {"deep": [1]}}, session=session)
        last = manager.register_asset_change(asset=routed, extra={"n": 2}, session=session)
    with create_session() as session:  # asset watchers' events (no manager)
        surrogate = AssetManager.register_asset_change(asset=routed, extra={"s": "\ud800"}, session=session)
        watcher_nul = AssetManager.register_asset_change(asset=routed, extra={"p": ["\x00"]}, session=session)
        watcher_ok = AssetManager.register_asset_change(asset=routed, extra={"ok": True}, session=session)
    with create_session() as session:
        outbox.sweep(session, Routes.load(routes_file), settle_seconds=0)
    with create_session() as session:
        rows = {r[0]: r[1:] for r in session.execute(text(
            "SELECT asset_event_id, status, extra, last_error FROM dataset_bridge.outbox"))}
    assert {i: rows[i][:2] for i in (first.id, last.id, watcher_ok.id)} == {
        first.id: ("pending", {"n": 1}), last.id: ("pending", {"n": 2}),
        watcher_ok.id: ("pending", {"ok": True})}
    for bad in (nul, nul_key, watcher_nul):
        status, extra, error = rows[bad.id]
        assert (status, extra) == ("dead", None)
        assert "cannot store its extra as jsonb" in error and "\\u0000" in error, error
    assert rows[surrogate.id][:2] == ("dead", None)
    assert "surrogate" in rows[surrogate.id][2]
