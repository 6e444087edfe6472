"""The Smart Triggerer page's queries (issue 15) on a real PostgreSQL: groups as the supervisor forms them,
counted over the DAGs a user may read; the last hour's chart from the instances' samples; the bridge
panel, with or without the bridge's tables. The e2e test covers the same through the api-server."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from airflow.utils.net import get_hostname

from tests.helpers.airflow_orm import use_airflow_db
from tests.helpers.seeding import seed_deferred
from tests.helpers.waiting import rows
from tests.integration.test_supervisor_faults import AT_TIME, load, make_supervisor
from triggerer import page
from triggerer.devstack import AirflowConfig


@pytest.fixture
def env(airflow_config: AirflowConfig) -> Iterator[AirflowConfig]:
    use_airflow_db(airflow_config.database_dsn)
    yield airflow_config


def seed(env: AirflowConfig, dag_id: str, days: list[int]) -> list[int]:
    return seed_deferred(env.database_dsn, env.dags_folder, count=len(days), classpath=AT_TIME, dag_id=dag_id,
                         kwargs_for=lambda i: {"moment": f"2099-01-0{days[i]}T00:00:00+00:00"}).trigger_ids


def test_groups_are_the_supervisors_counted_over_readable_dags_biggest_first(env: AirflowConfig) -> None:
    supervisor = make_supervisor()
    seed(env, "dag_a", [1, 1, 1, 2])
    seed(env, "dag_b", [1, 3, 3])
    load(supervisor)
    everything = page.groups_page({"dag_a", "dag_b"}, limit=10, offset=0)
    assert everything["total"] == len(supervisor.groups.by_hash) == 3
    assert [(g["members"], g["dags"]) for g in everything["groups"]] == [(4, 2), (2, 1), (1, 1)]
    biggest = everything["groups"][0]
    assert biggest["waits_on"] == "the time 2099-01-01T00:00:00+00:00"
    assert biggest["trigger_class"] == AT_TIME
    assert biggest["serving_instance"] == {"job_id": supervisor.job_id, "host": get_hostname()}
    member = biggest["first_members"][0]
    assert member["url"].startswith("dags/dag_a/runs/") and "/tasks/" in member["url"]

    only_a = page.groups_page({"dag_a"}, limit=10, offset=0)
    assert [g["members"] for g in only_a["groups"]] == [3, 1]
    second_page = page.groups_page({"dag_a", "dag_b"}, limit=2, offset=2)
    assert second_page["total"] == 3 and [g["members"] for g in second_page["groups"]] == [1]
    assert page.groups_page(set(), limit=10, offset=0) == {"total": 0, "limit": 10, "offset": 0, "groups": []}


def test_the_chart_sums_the_instances_latest_sample_of_each_minute(env: AirflowConfig) -> None:
    from airflow.utils.session import create_session

    from triggerer.store import Store

    make_supervisor()  # the schema
    dsn = env.database_dsn
    rows(dsn, """
        WITH m AS (SELECT date_trunc('minute', now() - interval '5 minutes') AS m)
        INSERT INTO smart_triggerer.sample (job_id, at, waiters, groups, polls_saved_per_minute)
        SELECT job_id, m.m + make_interval(secs => s), w, g, p FROM m, (VALUES
            (1, 10, 10, 4, 72.0), (1, 20, 12, 4, 96.0), (2, 30, 5, 5, 0.0),  -- one minute, two instances
            (1, -300, 7, 7, 0.0),                                              -- five minutes earlier
            (1, -10800, 99, 1, 1.0)) AS v(job_id, s, w, g, p)                -- older than the hour
        RETURNING 1""")
    chart = page.overview(may_read_assets=False)["chart"]
    points = [(p["waiters"], p["groups"], p["polls_saved_per_minute"]) for p in chart]
    assert points == [(7, 7, 0), (17, 9, 96)]

    with create_session() as session:  # a new sample drops the instance's own samples past two hours
        Store(session).record_sample(1, waiters=1, groups=1, polls_saved=0.0, prune=True)
    assert rows(dsn, "SELECT 1 FROM smart_triggerer.sample WHERE at < now() - interval '2 hours'") == []
    assert len(page.overview(may_read_assets=False)["chart"]) == 3


def test_the_bridge_panel_shows_what_exists_and_only_with_asset_access(env: AirflowConfig) -> None:
    make_supervisor()
    assert page.overview(may_read_assets=True)["bridge"] is None  # no bridge tables in this deployment
    dsn = env.database_dsn
    rows(dsn, "CREATE SCHEMA dataset_bridge; CREATE TABLE dataset_bridge.status_watermark ("
              "status_table text, table_name text, last_id bigint, updated_at timestamptz DEFAULT now()); "
              "INSERT INTO dataset_bridge.status_watermark VALUES ('etl.load_status', 'dds.h_user', 42) "
              "RETURNING 1")
    bridge = page.overview(may_read_assets=True)["bridge"]
    assert [(w["table_name"], w["last_id"]) for w in bridge["watermarks"]] == [("dds.h_user", 42)]
    assert bridge["targets"] == [] and bridge["requeued"] is None
    assert page.overview(may_read_assets=False)["bridge"] is None


def test_an_instance_sampling_late_in_a_minute_does_not_make_the_chart_dip(env: AirflowConfig) -> None:
    make_supervisor()
    rows(env.database_dsn, """
        WITH m AS (SELECT date_trunc('minute', now() - interval '10 minutes') AS m)
        INSERT INTO smart_triggerer.sample (job_id, at, waiters, groups, polls_saved_per_minute)
        SELECT job_id, m.m + make_interval(secs => s), w, 1, 0 FROM m, (VALUES
            (1, 50, 10), (2, 70, 5), (1, 110, 10), (1, 170, 10), (2, 190, 5)) AS v(job_id, s, w)
        RETURNING 1""")
    points = [p["waiters"] for p in page.overview(may_read_assets=False)["chart"]]
    # job 2 first sampled in the second minute, then skipped the third: carried, never a dip
    assert points == [10, 15, 15, 15]


def test_one_identity_on_two_queue_sets_is_two_groups(env: AirflowConfig) -> None:
    """Each queue set runs its own coroutine for an identity, so the page shows two groups."""
    supervisor = make_supervisor()
    ids = seed(env, "dag_q", [1, 1, 1])
    load(supervisor)  # identities stored; then one row stands for a waiter an instance of 'other' hashed
    rows(env.database_dsn, "UPDATE trigger SET queue = 'other' WHERE id = %s RETURNING 1", ids[0])
    found = page.groups_page({"dag_q"}, limit=10, offset=0)
    assert sorted(g["members"] for g in found["groups"]) == [1, 2]
    served = {g["members"]: g["serving_instance"] for g in found["groups"]}
    assert served[2] == {"job_id": supervisor.job_id, "host": get_hostname()}
    assert served[1] is None  # no instance serves queue 'other'


def test_a_schema_older_than_the_page_is_a_clear_503(env: AirflowConfig) -> None:
    make_supervisor()
    rows(env.database_dsn, "DELETE FROM smart_triggerer.migration WHERE version >= 6 RETURNING 1")
    with pytest.raises(page.PageUnavailable, match=r"schema is at version 5 .* upgraded smart-triggerer"):
        page.overview(may_read_assets=False)
    with pytest.raises(page.PageUnavailable):
        page.groups_page({"x"}, limit=10, offset=0)


def test_an_unreachable_database_is_a_503_that_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """A real connection refused (nothing listens on the port), through the app's error handling."""
    import socket

    from fastapi.testclient import TestClient
    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session

    with socket.socket() as probe:  # a free port: nothing listens there once it is closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    engine = create_engine(f"postgresql+psycopg2://postgres@127.0.0.1:{port}/x", pool_pre_ping=False)
    monkeypatch.setattr(page, "_session", lambda: Session(engine))
    monkeypatch.setattr(page, "_may_view_triggers", lambda user: True)
    monkeypatch.setattr(page, "_may_read_assets", lambda user: True)
    monkeypatch.setattr(page, "_readable_dag_ids", lambda user: {"a"})
    page.app.dependency_overrides[page._user] = object  # any user: the user is not what is tested here
    try:
        client = TestClient(page.app)
        for path in ("/api/overview", "/api/groups"):
            response = client.get(path)
            assert response.status_code == 503, response.text
            assert "metadata database is unreachable" in response.json()["detail"]
    finally:
        page.app.dependency_overrides.clear()
        engine.dispose()


def test_the_bridge_panel_over_the_bridges_own_tables(env: AirflowConfig) -> None:
    """Relay backlog per target, dead letters with their last error, watermarks, re-queued events: read from
    tables made by the bridge's own DDL."""
    from airflow.utils.session import create_session

    from dataset_bridge import ddl, outbox, status_table, task_success

    make_supervisor()
    with create_session() as session:
        for schema in (outbox.SCHEMA_DDL, task_success.SCHEMA_DDL, status_table.WATERMARK_DDL):
            ddl.apply(session, schema)
    rows(env.database_dsn, """
        INSERT INTO dataset_bridge.outbox (target, asset_event_id, asset_uri, asset_name, event_timestamp,
                                           status, attempts, last_error)
        VALUES ('b', 1, 'u1', 'orders', now(), 'pending', 0, NULL),
               ('b', 2, 'u2', 'orders', now(), 'pending', 1, 'HTTP 502'),
               ('b', 3, 'u3', 'users', now(), 'dead', 8, 'inbox said unknown_asset'),
               ('c', 4, 'u4', 'users', now(), 'delivered', 1, NULL);
        INSERT INTO dataset_bridge.reconciled (asset_event_id, dag_id, outcome, queued_at)
        VALUES (1, 'consumer', 'requeued', now()), (2, 'consumer', 'requeued', now() - interval '2 hours'),
               (3, 'consumer', 'cleared', now());
        INSERT INTO dataset_bridge.status_watermark (status_table, table_name, last_id)
        VALUES ('etl.load_status', 'dds.h_user', 7)
        RETURNING 1""")
    bridge = page.overview(may_read_assets=True)["bridge"]
    assert [(t["target"], t["backlog"], t["dead"], t["delivered"]) for t in bridge["targets"]] == [
        ("b", 2, 1, 0), ("c", 0, 0, 1)]
    dead = [(d["target"], d["asset_name"], d["attempts"], d["last_error"]) for d in bridge["dead_letters"]]
    assert dead == [("b", "users", 8, "inbox said unknown_asset")]
    assert bridge["requeued"] == {"total": 2, "last_hour": 1}
    assert [(w["table_name"], w["last_id"]) for w in bridge["watermarks"]] == [("dds.h_user", 7)]


def test_a_stopped_instance_is_not_carried_into_its_successors_minutes(env: AirflowConfig) -> None:
    """A restart: job 1 stops, job 2 (its successor, a new job id) samples the same waiters. The chart must
    not count them twice while job 1's last sample is still fresh; nor may the hour's first minute dip."""
    make_supervisor()
    rows(env.database_dsn, """
        WITH m AS (SELECT date_trunc('minute', now() - interval '20 minutes') AS m)
        INSERT INTO smart_triggerer.instance (job_id, hostname, capacity, stopped_at)
        SELECT 901, 'old', 1, m.m + interval '70 seconds' FROM m;
        WITH m AS (SELECT date_trunc('minute', now() - interval '20 minutes') AS m)
        INSERT INTO smart_triggerer.sample (job_id, at, waiters, groups, polls_saved_per_minute)
        SELECT job_id, m.m + make_interval(secs => s), w, 1, 0 FROM m, (VALUES
            (901, 10, 10), (902, 80, 10), (902, 140, 10),
            (903, -2380, 4), (904, -2320, 4)) AS v(job_id, s, w)   -- before the hour, and its edge
        RETURNING 1""")
    points = [p["waiters"] for p in page.overview(may_read_assets=False)["chart"]]
    assert points[-3:] == [10, 10, 10]  # job 901 until it stopped, then 902 alone: never 20
    assert points[0] == 8  # the hour's first minute carries job 903's sample from just before it
