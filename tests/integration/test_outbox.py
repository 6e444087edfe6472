"""The outbox against a real (migrated) Airflow metadata database: rows with the event, and the sweeper."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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


def routed_deployment(
    airflow_db: str, tmp_path: Path, uris: tuple[str, ...], schema: bool = True
) -> tuple[Any, Path]:
    """Airflow's ORM on this database, the routes file, an outbox asset manager and these assets (active);
    ``schema``: the outbox schema made up front (else the manager or the sweep makes it)."""
    from airflow.models.asset import AssetActive, AssetModel
    from airflow.utils.session import create_session

    from dataset_bridge import outbox
    from dataset_bridge.asset_manager import OutboxAssetManager

    use_airflow_db(airflow_db)
    routes_file = tmp_path / "routes.yaml"
    routes_file.write_text(ROUTES)
    with create_session() as session:
        if schema:
            outbox.ensure_schema(session)
        for uri in uris:
            session.add_all([AssetModel(name=uri, uri=uri), AssetActive(name=uri, uri=uri)])
    return OutboxAssetManager(routes=str(routes_file)), routes_file


def test_routed_events_get_an_outbox_row_in_their_transaction_and_the_sweeper_adds_missed_ones(
    airflow_db: str, tmp_path: Path
) -> None:
    from airflow.assets.manager import AssetManager
    from airflow.models.asset import AssetModel
    from airflow.utils.session import create_session

    from dataset_bridge import outbox
    from dataset_bridge.routes import Routes

    manager, routes_file = routed_deployment(
        airflow_db, tmp_path, ("warehouse://dds/h_user", "warehouse://dds/other")
    )
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
        assert missed is not None
    with create_session() as session:
        assert outbox.sweep(session, routes) == 1
        assert outbox.sweep(session, routes) == 0
        query = "SELECT asset_event_id FROM dataset_bridge.outbox ORDER BY id"
        ids = [r[0] for r in session.execute(text(query))]
    assert ids == [event.id, missed.id]


def test_events_before_the_relays_first_start_keep_their_place_in_the_outbox(
    airflow_db: str, tmp_path: Path
) -> None:
    """Routing configured, the relay never started yet: an event made through the asset manager gets its
    outbox row (the manager creates the schema), and a watcher event made after it (no manager) is swept
    when the relay finally starts: the window opens when routing was first seen, not at the first sweep."""
    from airflow.assets.manager import AssetManager
    from airflow.models.asset import AssetModel
    from airflow.utils.session import create_session

    from dataset_bridge import outbox
    from dataset_bridge.routes import Routes

    uri = "warehouse://dds/h_user"
    manager, routes_file = routed_deployment(airflow_db, tmp_path, (uri,), schema=False)
    with create_session() as session:
        assert session.execute(text("SELECT to_regclass('dataset_bridge.outbox')")).scalar() is None
        routed = session.query(AssetModel).filter_by(uri=uri).one().to_serialized()
        by_manager = manager.register_asset_change(asset=routed, extra={}, session=session)
    with create_session() as session:
        by_watcher = AssetManager.register_asset_change(
            asset=routed, extra={"watcher": True}, session=session
        )
        assert by_watcher is not None
    # the relay starts only now
    with create_session() as session:
        assert outbox.sweep(session, Routes.load(routes_file)) == 1
    with create_session() as session:
        query = "SELECT asset_event_id FROM dataset_bridge.outbox ORDER BY id"
        ids = [r[0] for r in session.execute(text(query))]
    assert ids == [by_manager.id, by_watcher.id]


def test_an_extra_jsonb_cannot_hold_never_fails_its_producer_and_is_dead_lettered_alone(
    airflow_db: str, tmp_path: Path
) -> None:
    """Airflow stores ``extra`` as json, which takes a NUL character or an unpaired surrogate; jsonb, the
    outbox's type, refuses both. The producer's transaction still commits, the event is dead-lettered
    alone with the reason (by the sweep, for events made through the manager and without it alike) and
    every other event gets its row."""
    from airflow.assets.manager import AssetManager
    from airflow.models.asset import AssetModel
    from airflow.utils.session import create_session

    from dataset_bridge import outbox
    from dataset_bridge.routes import Routes

    uri = "warehouse://dds/h_user"
    manager, routes_file = routed_deployment(airflow_db, tmp_path, (uri,))
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
        assert surrogate is not None and watcher_nul is not None and watcher_ok is not None
    with create_session() as session:
        outbox.sweep(session, Routes.load(routes_file))
    with create_session() as session:
        rows = {
            r[0]: r[1:]
            for r in session.execute(
                text("SELECT asset_event_id, status, extra, last_error FROM dataset_bridge.outbox")
            )
        }
    assert {i: rows[i][:2] for i in (first.id, last.id, watcher_ok.id)} == {
        first.id: ("pending", {"n": 1}),
        last.id: ("pending", {"n": 2}),
        watcher_ok.id: ("pending", {"ok": True}),
    }
    for bad in (nul, nul_key, watcher_nul):
        status, extra, error = rows[bad.id]
        assert (status, extra) == ("dead", None)
        assert "cannot store its extra as jsonb" in error and "\\u0000" in error, error
    assert rows[surrogate.id][:2] == ("dead", None)
    assert "surrogate" in rows[surrogate.id][2]


def _routed(airflow_db: str, tmp_path: Path) -> tuple[Any, Any]:
    """The routes file's target registered (first sweep) and the routed asset, serialized."""
    from airflow.models.asset import AssetActive, AssetModel
    from airflow.utils.session import create_session

    from dataset_bridge import outbox
    from dataset_bridge.routes import Routes

    use_airflow_db(airflow_db)
    routes_file = tmp_path / "routes.yaml"
    routes_file.write_text(ROUTES)
    routes = Routes.load(routes_file)
    uri = "warehouse://dds/h_user"
    with create_session() as session:
        outbox.ensure_schema(session)
        session.add_all([AssetModel(name=uri, uri=uri), AssetActive(name=uri, uri=uri)])
    with create_session() as session:
        assert outbox.sweep(session, routes) == 0  # registers the target: events from now on are swept
        return routes, session.query(AssetModel).filter_by(uri=uri).one().to_serialized()


def _swept() -> list[int]:
    from airflow.utils.session import create_session

    with create_session() as session:
        query = "SELECT asset_event_id FROM dataset_bridge.outbox ORDER BY asset_event_id"
        return [r[0] for r in session.execute(text(query))]


def test_the_sweeper_does_not_read_the_clock_of_the_host_that_made_the_event(
    airflow_db: str, tmp_path: Path
) -> None:
    """Airflow stamps an event with its host's clock: a watcher's event from a triggerer host 6 minutes
    behind the database is swept all the same."""
    from airflow.assets.manager import AssetManager
    from airflow.utils.session import create_session

    from dataset_bridge import outbox

    routes, asset = _routed(airflow_db, tmp_path)
    with create_session() as session:
        event = AssetManager.register_asset_change(asset=asset, extra={}, session=session)
        assert event is not None
        # what a host whose clock is 6 minutes behind writes
        session.execute(
            text("UPDATE asset_event SET timestamp = now() - interval '6 minutes' WHERE id = :i"),
            {"i": event.id},
        )
    with create_session() as session:
        assert outbox.sweep(session, routes) == 1
    assert _swept() == [event.id]


def test_the_sweeper_never_skips_an_event_whose_transaction_commits_late(
    airflow_db: str, tmp_path: Path
) -> None:
    """A lower event id committed after a higher one was swept (a second writer's transaction still
    open): the sweep that follows its commit adds it."""
    from airflow import settings
    from airflow.assets.manager import AssetManager
    from airflow.utils.session import create_session

    from dataset_bridge import outbox

    routes, asset = _routed(airflow_db, tmp_path)
    assert settings.NonScopedSession is not None
    held = settings.NonScopedSession()  # a connection of its own, its transaction left open
    try:
        late = AssetManager.register_asset_change(asset=asset, extra={"late": True}, session=held)
        held.flush()
        with create_session() as session:
            later = AssetManager.register_asset_change(asset=asset, extra={}, session=session)
        assert late is not None and later is not None
        assert late.id < later.id
        with create_session() as session:
            assert outbox.sweep(session, routes) == 1
        assert _swept() == [later.id]
        held.commit()
    finally:
        held.close()
    with create_session() as session:
        assert outbox.sweep(session, routes) == 1
    assert _swept() == [late.id, later.id]


def test_a_target_registered_by_an_earlier_version_is_swept_from_an_hour_before_its_last_sweep(
    airflow_db: str, tmp_path: Path
) -> None:
    """An earlier version kept no cursor (only when it last swept, by the clock): the first sweep after the
    upgrade starts an hour before that, so nothing its clock-based window missed lately is lost."""
    from airflow.assets.manager import AssetManager
    from airflow.utils.session import create_session

    from dataset_bridge import outbox

    routes, asset = _routed(airflow_db, tmp_path)
    made = []
    with create_session() as session:
        for age in ("3 hours", "20 minutes", "0 minutes"):
            event = AssetManager.register_asset_change(asset=asset, extra={}, session=session)
            assert event is not None
            session.execute(
                text("UPDATE asset_event SET timestamp = now() - CAST(:age AS interval) WHERE id = :i"),
                {"age": age, "i": event.id},
            )
            made.append(event.id)
        session.execute(
            text(
                "UPDATE dataset_bridge.relay_target SET swept_id = NULL, "
                "since = now() - interval '1 day', swept_until = now() - interval '10 minutes'"
            )
        )
    with create_session() as session:
        assert outbox.sweep(session, routes) == 2
    assert _swept() == made[1:]


def test_the_first_routed_event_with_an_extra_jsonb_cannot_hold_is_still_dead_lettered(
    airflow_db: str, tmp_path: Path
) -> None:
    """The manager's first event creates the outbox and registers the target in the producer's
    transaction; when jsonb cannot hold that very event's extra, the sweep still finds it (the target's
    cursor starts before its registering transaction's own events)."""
    from airflow.models.asset import AssetActive, AssetModel
    from airflow.utils.session import create_session

    from dataset_bridge import outbox
    from dataset_bridge.asset_manager import OutboxAssetManager
    from dataset_bridge.routes import Routes

    use_airflow_db(airflow_db)
    routes_file = tmp_path / "routes.yaml"
    routes_file.write_text(ROUTES)
    uri = "warehouse://dds/h_user"
    with create_session() as session:
        session.add_all([AssetModel(name=uri, uri=uri), AssetActive(name=uri, uri=uri)])
    with create_session() as session:
        routed = session.query(AssetModel).filter_by(uri=uri).one().to_serialized()
        event = OutboxAssetManager(routes=str(routes_file)).register_asset_change(
            asset=routed, extra={"note": "\x00"}, session=session
        )
    with create_session() as session:
        assert outbox.sweep(session, Routes.load(routes_file)) == 1
        found = session.execute(text("SELECT asset_event_id, status FROM dataset_bridge.outbox")).all()
    assert [tuple(r) for r in found] == [(event.id, "dead")]
