"""The Smart Triggerer page's queries on a real PostgreSQL: groups as the supervisor forms them,
counted over the DAGs a user may read; the last hour's chart from the instances' samples; the bridge
panel, with or without the bridge's tables. The e2e test covers the same through the api-server."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from importlib import resources
from typing import Any

import pytest
from airflow.utils.net import get_hostname

from devkit.devstack import AirflowConfig
from smart_triggerer.web import page
from tests.helpers.airflow_orm import use_airflow_db
from tests.helpers.seeding import seed_deferred
from tests.helpers.waiting import rows, wait_for
from tests.integration.test_supervisor_faults import AT_TIME, load, make_supervisor, unhashed


@pytest.fixture
def env(airflow_config: AirflowConfig) -> Iterator[AirflowConfig]:
    use_airflow_db(airflow_config.database_dsn)
    page.GROUP_ORDERS.clear()  # kept per set of DAGs: each test has a database of its own
    yield airflow_config
    page.GROUP_ORDERS.clear()


def viewer(dag_ids: set[str]) -> page.Viewer:
    """A user who may read these DAGs and view triggers."""
    return page.Viewer(frozenset(dag_ids), views_triggers=bool(dag_ids))


def seed(env: AirflowConfig, dag_id: str, days: list[int]) -> list[int]:
    return seed_deferred(
        env.database_dsn,
        env.dags_folder,
        count=len(days),
        classpath=AT_TIME,
        dag_id=dag_id,
        kwargs_for=lambda i: {"moment": f"2099-01-0{days[i]}T00:00:00+00:00"},
    ).trigger_ids


def test_groups_are_the_supervisors_counted_over_readable_dags_biggest_first(env: AirflowConfig) -> None:
    supervisor = make_supervisor()
    seed(env, "dag_a", [1, 1, 1, 2])
    seed(env, "dag_b", [1, 3, 3])
    load(supervisor)
    everything = page.groups_page(viewer({"dag_a", "dag_b"}), limit=10, offset=0)
    assert everything["total"] == len(supervisor.groups.by_hash) == 3
    assert [(g["members"], g["dags"]) for g in everything["groups"]] == [(4, 2), (2, 1), (1, 1)]
    biggest = everything["groups"][0]
    assert biggest["waits_on"] == "the time 2099-01-01T00:00:00+00:00"
    assert biggest["trigger_class"] == AT_TIME
    assert biggest["serving_instance"] == {"job_id": supervisor.job_id, "host": get_hostname()}
    member = biggest["first_members"][0]
    assert member["url"].startswith("dags/dag_a/runs/") and "/tasks/" in member["url"]

    only_a = page.groups_page(viewer({"dag_a"}), limit=10, offset=0)
    assert [g["members"] for g in only_a["groups"]] == [3, 1]
    second_page = page.groups_page(viewer({"dag_a", "dag_b"}), limit=2, offset=2)
    assert second_page["total"] == 3 and [g["members"] for g in second_page["groups"]] == [1]
    nothing = {"total": 0, "limit": 10, "offset": 0, "groups": []}
    assert page.groups_page(viewer(set()), limit=10, offset=0) == nothing


def test_the_chart_sums_the_instances_latest_sample_of_each_minute(env: AirflowConfig) -> None:
    from airflow.utils.session import create_session

    from smart_triggerer.db.store import Store

    make_supervisor()  # the schema
    dsn = env.database_dsn
    rows(
        dsn,
        """
        WITH m AS (SELECT date_trunc('minute', now() - interval '5 minutes') AS m)
        INSERT INTO smart_triggerer.sample (job_id, at, waiters, groups, polls_saved_per_minute)
        SELECT job_id, m.m + make_interval(secs => s), w, g, p FROM m, (VALUES
            (1, 10, 10, 4, 72.0), (1, 20, 12, 4, 96.0), (2, 30, 5, 5, 0.0),  -- one minute, two instances
            (1, -300, 7, 7, 0.0),                                              -- five minutes earlier
            (1, -10800, 99, 1, 1.0)) AS v(job_id, s, w, g, p)                -- older than the hour
        RETURNING 1""",
    )
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
    rows(
        dsn,
        "CREATE SCHEMA dataset_bridge; CREATE TABLE dataset_bridge.status_watermark ("
        "status_table text, table_name text, last_id bigint, updated_at timestamptz DEFAULT now()); "
        "INSERT INTO dataset_bridge.status_watermark VALUES ('etl.load_status', 'dds.h_user', 42) "
        "RETURNING 1",
    )
    bridge = page.overview(may_read_assets=True)["bridge"]
    assert [(w["table_name"], w["last_id"]) for w in bridge["watermarks"]] == [("dds.h_user", 42)]
    assert bridge["targets"] == [] and bridge["requeued"] is None
    assert page.overview(may_read_assets=False)["bridge"] is None


def test_an_instance_sampling_late_in_a_minute_does_not_make_the_chart_dip(env: AirflowConfig) -> None:
    make_supervisor()
    rows(
        env.database_dsn,
        """
        WITH m AS (SELECT date_trunc('minute', now() - interval '10 minutes') AS m)
        INSERT INTO smart_triggerer.sample (job_id, at, waiters, groups, polls_saved_per_minute)
        SELECT job_id, m.m + make_interval(secs => s), w, 1, 0 FROM m, (VALUES
            (1, 50, 10), (2, 70, 5), (1, 110, 10), (1, 170, 10), (2, 190, 5)) AS v(job_id, s, w)
        RETURNING 1""",
    )
    points = [p["waiters"] for p in page.overview(may_read_assets=False)["chart"]]
    # job 2 first sampled in the second minute, then skipped the third: carried, never a dip
    assert points == [10, 15, 15, 15]


def test_one_identity_on_two_queue_sets_is_two_groups(env: AirflowConfig) -> None:
    """Each queue set runs its own coroutine for an identity, so the page shows two groups."""
    supervisor = make_supervisor()
    ids = seed(env, "dag_q", [1, 1, 1])
    load(supervisor)  # identities stored; then one row stands for a waiter an instance of 'other' hashed
    rows(env.database_dsn, "UPDATE trigger SET queue = 'other' WHERE id = %s RETURNING 1", ids[0])
    found = page.groups_page(viewer({"dag_q"}), limit=10, offset=0)
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
        page.groups_page(viewer({"x"}), limit=10, offset=0)


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
    tables made by the bridge's own migrations (and the status trigger's watermark table, here in the
    metadata database)."""
    from airflow.utils.session import create_session
    from sqlalchemy import text

    from dataset_bridge import status_table, store

    make_supervisor()
    with create_session() as session:
        store.migrate(session)
        session.execute(text(status_table.WATERMARK_DDL))
    rows(
        env.database_dsn,
        """
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
        RETURNING 1""",
    )
    bridge = page.overview(may_read_assets=True)["bridge"]
    assert [(t["target"], t["backlog"], t["dead"], t["delivered"]) for t in bridge["targets"]] == [
        ("b", 2, 1, 0),
        ("c", 0, 0, 1),
    ]
    dead = [(d["target"], d["asset_name"], d["attempts"], d["last_error"]) for d in bridge["dead_letters"]]
    assert dead == [("b", "users", 8, "inbox said unknown_asset")]
    assert bridge["requeued"] == {"total": 2, "last_hour": 1}
    assert [(w["table_name"], w["last_id"]) for w in bridge["watermarks"]] == [("dds.h_user", 7)]


def test_a_stopped_instance_is_not_carried_into_its_successors_minutes(env: AirflowConfig) -> None:
    """A restart: job 1 stops, job 2 (its successor, a new job id) samples the same waiters. The chart must
    not count them twice while job 1's last sample is still fresh; nor may the hour's first minute dip."""
    make_supervisor()
    # the samples are placed by the minute of the insert, the chart by the minute of its read: both in one
    # minute (a minute turning between the two shifted the hour's first point)
    wait_for(
        lambda: float(rows(env.database_dsn, "SELECT extract(second FROM clock_timestamp())")[0][0]),
        lambda second: second < 45,
        20,
        "a minute with 15 s left",
        interval=0.5,
    )
    rows(
        env.database_dsn,
        """
        WITH m AS (SELECT date_trunc('minute', now() - interval '20 minutes') AS m)
        INSERT INTO smart_triggerer.instance (job_id, hostname, capacity, stopped_at)
        SELECT 901, 'old', 1, m.m + interval '70 seconds' FROM m;
        WITH m AS (SELECT date_trunc('minute', now() - interval '20 minutes') AS m)
        INSERT INTO smart_triggerer.sample (job_id, at, waiters, groups, polls_saved_per_minute)
        SELECT job_id, m.m + make_interval(secs => s), w, 1, 0 FROM m, (VALUES
            (901, 10, 10), (902, 80, 10), (902, 140, 10),
            (903, -2380, 4), (904, -2320, 4)) AS v(job_id, s, w)   -- before the hour, and its edge
        RETURNING 1""",
    )
    points = [p["waiters"] for p in page.overview(may_read_assets=False)["chart"]]
    assert points[-3:] == [10, 10, 10]  # job 901 until it stopped, then 902 alone: never 20
    assert points[0] == 8  # the hour's first minute carries job 903's sample from just before it


def test_a_page_past_the_last_still_counts_every_group(env: AirflowConfig) -> None:
    load(make_supervisor())
    seed(env, "dag_a", [1, 1, 2])
    seed(env, "dag_b", [3])
    load_all()
    past = page.groups_page(viewer({"dag_a", "dag_b"}), limit=2, offset=10)
    assert past["groups"] == [] and past["total"] == 3


SQL_CONDITION = "triggers.sql_condition.SqlConditionTrigger"
SECRET = "sk-live-0123456789"


def test_a_sql_conditions_text_is_neither_stored_nor_served(env: AirflowConfig) -> None:
    """The SQL may hold a rendered secret: the page describes the wait by its connection (and a fingerprint);
    descriptions stored in clear by the release before are forgotten when this one migrates."""
    supervisor = make_supervisor()
    seed_deferred(
        env.database_dsn,
        env.dags_folder,
        count=2,
        classpath=SQL_CONDITION,
        dag_id="dag_sql",
        kwargs_for=lambda i: {"conn_id": "dwh", "sql": f"SELECT api_key = '{SECRET}' FROM k"},
    )
    load(supervisor)
    stored = rows(env.database_dsn, "SELECT description FROM smart_triggerer.trigger_identity")
    assert stored and all(SECRET not in (d or "") for (d,) in stored)
    [group] = page.groups_page(viewer({"dag_sql"}), limit=10, offset=0)["groups"]
    assert group["members"] == 2 and group["waits_on"].startswith("a true answer from dwh")
    assert SECRET not in json.dumps(group) and "SELECT" not in json.dumps(group)

    # what the release before stored, then this release's migrations
    rows(
        env.database_dsn,
        "UPDATE smart_triggerer.trigger_identity SET description = %s RETURNING 1",
        f"a true answer from dwh: SELECT api_key = '{SECRET}' FROM k",
    )
    remigrate(env, PAGE_MIGRATION)
    assert SECRET not in json.dumps(page.groups_page(viewer({"dag_sql"}), limit=10, offset=0))
    assert all(
        SECRET not in (d or "")
        for (d,) in rows(env.database_dsn, "SELECT description FROM smart_triggerer.trigger_identity")
    )


def test_a_stored_loaded_since_dash_is_rewritten_without_the_dash(env: AirflowConfig) -> None:
    supervisor = make_supervisor()
    wait = {"conn_id": "dwh", "required_tables": ["dds.h_user"], "status_table": "meta.status"}  # no since
    seed_deferred(
        env.database_dsn,
        env.dags_folder,
        count=1,
        dag_id="dag_load",
        classpath="triggers.table_load.TableLoadTrigger",
        kwargs_for=lambda i: wait,
    )
    load(supervisor)
    [group] = page.groups_page(viewer({"dag_load"}), limit=10, offset=0)["groups"]
    assert group["waits_on"] == "dds.h_user loaded (meta.status on dwh)"
    rows(
        env.database_dsn,
        "UPDATE smart_triggerer.trigger_identity SET description = %s RETURNING 1",
        "dds.h_user loaded since - (meta.status on dwh)",
    )  # as the release before stored it
    remigrate(env, PAGE_MIGRATION)
    [group] = page.groups_page(viewer({"dag_load"}), limit=10, offset=0)["groups"]
    assert group["waits_on"] == "dds.h_user loaded (meta.status on dwh)"


def test_polls_saved_count_groups_of_airflows_own_polling_triggers(env: AirflowConfig) -> None:
    """FileTrigger is deduplicated by all its kwargs, its poke interval among them: its groups save polls."""
    supervisor = make_supervisor()
    seed_deferred(
        env.database_dsn,
        env.dags_folder,
        count=3,
        dag_id="dag_file",
        classpath="airflow.providers.standard.triggers.file.FileTrigger",
        kwargs_for=lambda i: {"filepath": "/data/ready.flag", "poke_interval": 5.0},
    )
    load(supervisor)
    supervisor.leases.heartbeat_counters()
    record_sample_now(supervisor)
    totals = page.overview(may_read_assets=False)["totals"]
    assert totals["groups"] == 1 and totals["waiters"] == 3
    assert totals["polls_saved_per_minute"] == 24.0  # 2 polls saved every 5 s


def test_polls_saved_follow_groups_that_formed_after_the_last_sample(
    env: AirflowConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An instance sampled before its waiters came (the first sample is 10 s after start): the card must
    not say 0 polls saved next to groups that wait until the next minute's sample."""
    import types

    supervisor = make_supervisor()
    load(supervisor)
    record_sample_now(supervisor)  # nothing waits yet
    seed(env, "dag_late", [1, 1, 1])
    load(supervisor)
    supervisor.leases.heartbeat_counters()
    later = types.SimpleNamespace(**{n: getattr(time, n) for n in dir(time) if not n.startswith("_")})
    later.monotonic = lambda: time.monotonic() + 15  # the supervisor's clock, 15 s on
    monkeypatch.setattr("smart_triggerer.supervisor.housekeeping.time", later)
    supervisor.housekeeping.run()
    totals = page.overview(may_read_assets=False)["totals"]
    assert totals["groups"] == 1 and totals["polls_saved_per_minute"] == 2 * 60 / 0.2


def record_sample_now(supervisor: Any) -> None:
    supervisor.housekeeping.last_sample = time.monotonic() - 3600
    supervisor.housekeeping.run()


def load_all() -> None:
    """Identities of every seeded waiter (a fresh instance reads every trigger row once)."""
    load(make_supervisor())


PAGE_MIGRATION = 9


def remigrate(env: AirflowConfig, version: int) -> None:
    """Run a migration again, as an upgrade from the release before it does."""
    from airflow.utils.session import create_session

    from smart_triggerer.db.store import Store

    rows(env.database_dsn, "DELETE FROM smart_triggerer.migration WHERE version = %s RETURNING 1", version)
    with create_session() as session:
        assert Store(session).migrate(shards=4) == [version]


def test_hosts_and_task_ids_need_the_triggers_view_or_task_instance_read(
    env: AirflowConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Counts for every DAG a user may read; the serving host and the tasks only with the Triggers view, or
    for the tasks of DAGs whose task instances the user may read."""
    from fastapi.testclient import TestClient

    supervisor = make_supervisor()
    seed(env, "dag_a", [1, 1])
    seed(env, "dag_b", [1])
    load(supervisor)
    monkeypatch.setattr(page, "_readable_dag_ids", lambda user: {"dag_a", "dag_b"})
    access = {"triggers": False, "task_dags": set()}
    monkeypatch.setattr(page, "_may_view_triggers", lambda user: access["triggers"])
    monkeypatch.setattr(
        page, "_task_instance_dag_ids", lambda user, dag_ids: access["task_dags"] & dag_ids, raising=False
    )
    page.app.dependency_overrides[page._user] = object
    try:
        client = TestClient(page.app)

        def biggest() -> dict[str, Any]:
            response = client.get("/api/groups")
            assert response.status_code == 200, response.text
            return dict(response.json()["groups"][0])

        counted = biggest()
        assert (counted["members"], counted["dags"]) == (3, 2)
        assert counted["first_members"] == []
        assert counted["serving_instance"] == {"job_id": None, "host": None}
        access["task_dags"] = {"dag_b"}
        only_b = biggest()
        assert [m["dag_id"] for m in only_b["first_members"]] == ["dag_b"]
        assert only_b["serving_instance"]["host"] == get_hostname()
        access.update(triggers=True, task_dags=set())
        everything = biggest()
        assert sorted(m["dag_id"] for m in everything["first_members"]) == ["dag_a", "dag_a", "dag_b"]
        assert everything["serving_instance"] == {"job_id": supervisor.job_id, "host": get_hostname()}
    finally:
        page.app.dependency_overrides.clear()


def test_a_failing_asset_watcher_is_shown_with_its_instance(env: AirflowConfig) -> None:
    """Issue 25.4: a watcher whose coroutine failed is started again with backoff, and the page says so."""
    from tests.integration.test_supervisor_faults import add_watcher, watcher_group

    supervisor = make_supervisor()
    watcher = add_watcher("flaky")
    load(supervisor)
    supervisor.starting.start_groups()
    runner = watcher_group(supervisor, watcher).runner_id
    supervisor.failed_triggers.append((runner, ConnectionRefusedError("warehouse is down")))
    supervisor.handle_failed_triggers()
    supervisor.leases.heartbeat_counters()
    found = page.overview(may_read_assets=False)
    instance = next(i for i in found["instances"] if i["job_id"] == supervisor.job_id)
    assert (instance["watchers_failing"], instance["watcher_restarts_total"]) == (1, 1)
    assert found["totals"]["watchers_failing"] == 1
    html = resources.files("smart_triggerer.web").joinpath("static/page.html").read_text()
    assert "<th>Failing watchers</th>" in html and "i.watchers_failing" in html


def _plan_rows(node: dict[str, Any], relation: str) -> int:
    """Rows a plan read from ``relation``: each scan's rows (and those its filter removed) times its loops."""
    own = 0
    if node.get("Relation Name") == relation:
        own = (
            node["Actual Rows"]
            + node.get("Rows Removed by Filter", 0)
            + node.get("Rows Removed by Index Recheck", 0)
        ) * node["Actual Loops"]
    return own + sum(_plan_rows(child, relation) for child in node.get("Plans", []))


def test_a_page_of_groups_reads_its_own_members_only_before_any_analyze(env: AirflowConfig) -> None:
    """Fresh rows have no statistics until autovacuum analyses them (minutes, at scale): the plan must not
    depend on them. 10,000 waiters in 400 groups of 25; one page of 50 groups reads, of its own groups'
    identities, triggers and tasks, only the members it shows; none of the tasks for a user who may list
    none; at most the first `scanned` members of a group whose members are in no DAG the user may list:
    on unanalysed tables, then analysed."""
    from airflow.utils.session import create_session

    from smart_triggerer.db.store import Store

    load(make_supervisor())
    dsn = env.database_dsn
    tables = ["public.trigger", "public.task_instance", "smart_triggerer.trigger_identity"]
    for table in tables:  # autovacuum must not analyse them while the test runs
        rows(dsn, f"ALTER TABLE {table} SET (autovacuum_enabled = false); SELECT 1")
    moments = [f"2099-01-01T00:{g // 60:02d}:{g % 60:02d}+00:00" for g in range(400)]
    seed_deferred(
        dsn,
        env.dags_folder,
        count=10_000,
        classpath=AT_TIME,
        dag_id="dag_big",
        kwargs_for=lambda i: {"moment": moments[i % 400]},
    )
    supervisor = make_supervisor()
    while unhashed(supervisor):  # a step hashes a few thousand
        load(supervisor)
    known = rows(
        dsn,
        "SELECT relname, reltuples FROM pg_class "  # what the planner believes they hold
        "WHERE relname IN ('trigger', 'task_instance', 'trigger_identity')",
    )
    assert len(known) == 3 and all(tuples < 10_000 for _, tuples in known), known

    with create_session() as session:
        order = Store(session).page_group_order(["dag_big"])
        assert len(order) == 400
        groups = [(o[0], o[1], o[2]) for o in order[:50]]
        shown = Store(session).page_groups(groups, ["dag_big"], page.MEMBERS_SHOWN, page.MEMBERS_SCANNED)
    # each group's first 20 members (of 25), in the order they deferred: map indexes g, g + 400, ...
    assert all(len(g["first_members"]) == page.MEMBERS_SHOWN for g in shown)
    for group in shown:
        indexes = [m["map_index"] for m in group["first_members"]]
        assert indexes == [indexes[0] + 400 * k for k in range(page.MEMBERS_SHOWN)], indexes
    # of the triggers and tasks, the members shown and the first again for its class; of the identities,
    # the same rows (not the page's groups whole: 25 each)
    shown_rows = {
        "task_instance": 50 * page.MEMBERS_SHOWN,
        "trigger": 50 * (page.MEMBERS_SHOWN + 1),
        "trigger_identity": 50 * (page.MEMBERS_SHOWN + 1),
    }
    # a user who may list no DAG's tasks: the first member for the class only, no task read
    none_listed = {"task_instance": 0, "trigger": 50, "trigger_identity": 50}
    # members in no DAG the user may list: a group is read up to its first `scanned` members, not whole
    scanned = 7
    unlisted = {
        "task_instance": 50 * scanned,
        "trigger": 50 * (scanned + 1),
        "trigger_identity": 50 * (scanned + 1),
    }
    for moment in ("unanalysed", "analysed"):
        if moment == "analysed":
            rows(dsn, f"ANALYZE {', '.join(tables)}; SELECT 1")
        cases: tuple[tuple[list[str], int, dict[str, int]], ...] = (
            (["dag_big"], page.MEMBERS_SCANNED, shown_rows),
            ([], page.MEMBERS_SCANNED, none_listed),
            (["another_dag"], scanned, unlisted),
        )
        for dag_ids, limit, bound in cases:
            plan = _explain_page(groups, dag_ids, limit)
            read = {table: _plan_rows(plan, table) for table in bound}
            assert all(read[t] <= bound[t] for t in bound), (
                f"{moment}, {dag_ids}: read {read}: {json.dumps(plan)[:3000]}"
            )


def _explain_page(groups: list[tuple[Any, ...]], dag_ids: list[str], scanned: int) -> dict[str, Any]:
    from airflow.utils.session import create_session
    from sqlalchemy import text

    from smart_triggerer.db.store import PAGE_GROUPS_PLANNER, queries

    params = {
        "hashes": [g[0] for g in groups],
        "alone": [g[1] for g in groups],
        "queues": [g[2] for g in groups],
        "dag_ids": dag_ids,
        "members": page.MEMBERS_SHOWN,
        "scanned": scanned,
        "multi_team": False,
    }
    with create_session() as session:
        session.execute(text(PAGE_GROUPS_PLANNER))  # as Store.page_groups runs it
        result = session.execute(text("EXPLAIN (ANALYZE, FORMAT JSON) " + queries()["page_groups"]), params)
        plan: dict[str, Any] = result.scalar_one()[0]["Plan"]
    return plan
