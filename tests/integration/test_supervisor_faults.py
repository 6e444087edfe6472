"""The supervisor's fault paths, driven step by step in this process against a real PostgreSQL.

No runner subprocess: the test plays the runner's part (events, failures) and calls the supervisor's
loop steps itself, so each fault happens at an exact point. What is asserted is what the database holds.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import socket
import threading
import time
from typing import Any

import psycopg2
import pytest
import structlog
import structlog.testing

from devkit.devstack import AirflowConfig
from smart_triggerer.config import Settings
from smart_triggerer.web.health import is_healthy
from tests.helpers.seeding import Seeded, seed_deferred
from tests.helpers.waiting import rows, ti_states, wait_for

AT_TIME = "tests.helpers.triggers.AtTimeTrigger"
LATER = (dt.datetime.now(dt.UTC) + dt.timedelta(hours=2)).isoformat()


def _job_id() -> int:
    from airflow.jobs.job import Job
    from airflow.utils.session import create_session

    with create_session() as session:
        job = Job(job_type="TriggererJob")
        session.add(job)
        session.flush()
        return int(job.id)


def make_supervisor(**settings: Any) -> Any:
    from airflow.jobs.job import Job
    from airflow.utils.session import create_session

    from smart_triggerer.supervisor import SmartTriggerRunnerSupervisor

    class InProcess(SmartTriggerRunnerSupervisor):
        runner_end: socket.socket  # the runner's end of the socket pair (set below)

        def is_alive(self) -> bool:
            return True  # the test plays the runner

        def _service_subprocess(
            self, max_wait_time: float, raise_on_timeout: bool = False, expect_signal: int | None = None
        ) -> None:
            return None  # no runner process to read from: the test plays it

    job_id = _job_id()
    with create_session() as session:
        job = session.get(Job, job_id)
        session.expunge(job)
    left, _right = socket.socketpair()
    supervisor = InProcess(  # Airflow's fields for a runner process, played by the test
        id=job_id,  # type: ignore[arg-type]  # the job's id (Airflow types it a UUID)
        pid=0,
        stdin=left,
        process=None,  # type: ignore[arg-type]  # no process
        process_log=structlog.get_logger(),
        job=job,
        capacity=100,
        settings=Settings(**{"shards": 4, "lease_seconds": 6.0, "resume_hold_seconds": 0, **settings}),
    )
    supervisor.runner_end = _right  # the runner's end of the socket, open while the supervisor answers
    supervisor.register()
    return supervisor


def load(supervisor: Any) -> None:
    """One load step without starting coroutines (the test plays the runner)."""
    supervisor.loops += 1
    supervisor.read_changes()
    # A transaction open anywhere in the cluster (xids are cluster-wide) holds the snapshot xmin back: the
    # start-up sweep then leaves rows created after it to the change feed, which the next read hashes.
    if unhashed(supervisor):
        supervisor.read_changes()


def unhashed(supervisor: Any) -> int:
    """Trigger rows without an identity (read on a connection of its own: tests count the supervisor's
    statements)."""
    from airflow import settings

    assert settings.engine is not None
    dsn = settings.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    return int(
        rows(
            dsn,
            "SELECT count(*) FROM trigger t LEFT JOIN smart_triggerer.trigger_identity i "
            "ON i.trigger_id = t.id WHERE i.trigger_id IS NULL",
        )[0][0]
    )


def event_entry(trigger_id: int, payload: dict[str, Any], seq: int | None = None) -> Any:
    from airflow.jobs.triggerer_job_runner import TriggerEventEntry
    from airflow.triggers.base import TriggerEvent

    return TriggerEventEntry(trigger_id=trigger_id, event=TriggerEvent(payload), persist_seq=seq)


def next_kwargs(dsn: str, dag_id: str) -> dict[int, Any]:
    return {
        r[0]: json.loads(r[1]) if isinstance(r[1], str) else r[1]
        for r in rows(dsn, "SELECT map_index, next_kwargs FROM task_instance WHERE dag_id = %s", dag_id)
    }


def seed(config: AirflowConfig, count: int, moment: str = LATER, **kw: Any) -> Seeded:
    return seed_deferred(
        config.database_dsn,
        config.dags_folder,
        count=count,
        classpath=AT_TIME,
        kwargs_for=lambda i: {"moment": moment},
        **kw,
    )


def add_watcher(name: str, moment: str = LATER) -> int:
    """An asset watched by an AtTimeTrigger (as the dag-processor stores one); returns the trigger id."""
    from airflow.models.asset import AssetModel, AssetWatcherModel
    from airflow.models.trigger import Trigger
    from airflow.utils.session import create_session

    from tests.helpers.triggers import AtTimeTrigger

    with create_session() as session:
        asset = AssetModel(name=name, uri=f"test://{name}", group="asset")
        session.add(asset)
        row = Trigger.from_object(AtTimeTrigger(moment=moment))
        session.add(row)
        session.flush()
        session.add(AssetWatcherModel(name="w", asset_id=asset.id, trigger_id=row.id))
        return int(row.id)


def runner_of(supervisor: Any, seeded: Seeded) -> int:
    group = supervisor.groups.by_hash[supervisor.groups.hash_of_member[seeded.trigger_ids[0]]]
    supervisor.groups.start(group)
    assert group.runner_id is not None
    return int(group.runner_id)


def started_then_dropped(env: AirflowConfig, running: bool) -> tuple[Any, Seeded, int]:
    """A supervisor whose group of two seeded waiters started (``running``: the runner said so), then
    every shard dropped: (supervisor, seeded, the group's runner id)."""
    supervisor = make_supervisor()
    seeded = seed(env, 2)
    load(supervisor)
    runner = runner_of(supervisor, seeded)
    if running:
        supervisor.running_triggers.add(runner)
    supervisor.leases.drop(set(supervisor.owned))
    return supervisor, seeded, runner


def test_an_event_of_a_group_no_longer_run_is_neither_stored_nor_acknowledged(env: AirflowConfig) -> None:
    """Issue 11.3: acknowledging it would let a status-table watermark pass a row with no asset event."""
    supervisor, seeded, runner = started_then_dropped(env, running=False)  # handed over with the event
    supervisor.events.append(event_entry(runner, {"moment": LATER}, seq=7))
    supervisor.handle_events()
    assert list(supervisor.persisted_event_seqs) == []
    assert not supervisor.events
    assert set(ti_states(env.database_dsn, seeded.dag_id).values()) == {"deferred"}


def test_an_event_fired_while_its_shards_were_dropped_is_stored_when_back(env: AirflowConfig) -> None:
    """The guard drops every shard during a database blip; the coroutine keeps running, the next load
    re-claims the shards. Its event (a status-table row, say) must be stored then, not thrown away while
    the stream moves on (the chaos run lost asset events this way)."""
    supervisor, seeded, runner = started_then_dropped(env, running=True)
    supervisor.owned = set()
    supervisor.events.append(event_entry(runner, {"moment": LATER}, seq=11))
    supervisor.handle_events()
    assert list(supervisor.persisted_event_seqs) == [] and len(supervisor.orphans) == 1
    load(supervisor)
    supervisor.starting.start_groups()
    supervisor.handle_events()
    assert list(supervisor.persisted_event_seqs) == [11] and supervisor.orphans == []
    assert set(ti_states(env.database_dsn, seeded.dag_id).values()) == {"scheduled"}


def test_an_event_of_a_coroutine_being_cancelled_is_dropped(env: AirflowConfig) -> None:
    supervisor, seeded, runner = started_then_dropped(env, running=True)
    supervisor.events.append(event_entry(runner, {"moment": LATER}, seq=12))
    supervisor.handle_events()
    supervisor.cancelling_triggers.add(runner)  # its shard went to another instance
    supervisor.handle_events()
    assert supervisor.orphans == [] and list(supervisor.persisted_event_seqs) == []
    assert set(ti_states(env.database_dsn, seeded.dag_id).values()) == {"deferred"}


def test_a_process_past_its_lease_writes_nothing(env: AirflowConfig) -> None:
    """Issue 11.7, 25.10: another instance took the shards while this one was paused (it ran no loop past
    its lease); woken, its event and its due timeouts must not land."""
    dsn = env.database_dsn
    paused = make_supervisor(lease_seconds=3.0)
    seeded = seed(env, 3, trigger_timeout=dt.timedelta(seconds=2))
    load(paused)
    runner = runner_of(paused, seeded)
    wait_for(
        lambda: rows(
            dsn, "SELECT count(*) FROM smart_triggerer.shard_lease WHERE expires_at > clock_timestamp()"
        ),
        lambda r: r == [(0,)],
        10,
        "the paused instance's leases to lapse",
        interval=0.05,
    )
    taker = make_supervisor(lease_seconds=3.0)
    load(taker)
    assert taker.owned == {0, 1, 2, 3}
    paused.events.append(event_entry(runner, {"moment": LATER}))
    paused._db_step("events", paused.handle_events)
    paused._db_step("load", paused.deadlines.timeout_members)  # their trigger_timeout passed meanwhile
    assert set(ti_states(dsn, seeded.dag_id).values()) == {"deferred"}
    assert paused.resumed_total == 0 and paused.failures_total == 0 and not paused.owned


def test_timeouts_never_wait_on_rows_another_transaction_holds(env: AirflowConfig) -> None:
    """Issue 11.10: timeout_members used to lock rows in no order (deadlocks with the scheduler); now it
    locks in id order and leaves rows someone else holds to the next loop."""
    dsn = env.database_dsn
    supervisor = make_supervisor()
    seeded = seed(env, 4, trigger_timeout=dt.timedelta(seconds=-1))
    load(supervisor)
    held = max(seeded.ti_ids)
    other = psycopg2.connect(dsn)
    try:
        other.cursor().execute("SELECT id FROM task_instance WHERE id = %s FOR UPDATE", (held,))
        started = time.monotonic()
        supervisor.deadlines.timeout_members()
        assert time.monotonic() - started < 5
        states = dict(rows(dsn, "SELECT id::text, state FROM task_instance WHERE dag_id = %s", seeded.dag_id))
        assert states.pop(held) == "deferred" and set(states.values()) == {"scheduled"}
    finally:
        other.close()
    supervisor.deadlines.timeout_members()  # the held row is looked at again a loop later, not at once
    assert rows(dsn, "SELECT state FROM task_instance WHERE id = %s", held) == [("deferred",)]
    time.sleep(supervisor.settings.loop_seconds)
    supervisor.deadlines.timeout_members()
    assert set(ti_states(dsn, seeded.dag_id).values()) == {"scheduled"}
    assert all(v == {"error": "Trigger timeout"} for v in next_kwargs(dsn, seeded.dag_id).values())


def test_an_expired_lease_of_its_own_is_no_licence_either(env: AirflowConfig) -> None:
    dsn = env.database_dsn
    supervisor = make_supervisor()
    seeded = seed(env, 2)
    load(supervisor)
    runner = runner_of(supervisor, seeded)
    # the database clock past the lease while this instance's own clock says it renewed a moment ago (a
    # stepped clock): a real pause would renew first (handle_events guards the leases), so the row is set
    rows(dsn, "UPDATE smart_triggerer.shard_lease SET expires_at = now() - interval '1 second' RETURNING 1")
    supervisor.events.append(event_entry(runner, {"moment": LATER}))
    supervisor.handle_events()
    assert set(ti_states(dsn, seeded.dag_id).values()) == {"deferred"}


def test_a_poison_event_fails_its_own_members_and_the_others_resume(env: AirflowConfig) -> None:
    """Issue 11.5: a payload PostgreSQL refuses (\\u0000 in jsonb) must not stall the instance."""
    dsn = env.database_dsn
    supervisor = make_supervisor(max_resumes_per_transaction=3)
    other = (dt.datetime.now(dt.UTC) + dt.timedelta(hours=3)).isoformat()
    poisoned = seed(env, 2)
    healthy = seed(env, 7, moment=other)
    load(supervisor)
    bad_runner, good_runner = runner_of(supervisor, poisoned), runner_of(supervisor, healthy)
    supervisor.events.append(event_entry(bad_runner, {"moment": "\u0000"}))
    supervisor.events.append(event_entry(good_runner, {"moment": other}))
    supervisor.handle_events()
    assert not supervisor.events
    assert set(ti_states(dsn, healthy.dag_id).values()) == {"scheduled"}
    assert all(v["event"]["moment"] == other for v in next_kwargs(dsn, healthy.dag_id).values())
    assert set(ti_states(dsn, poisoned.dag_id).values()) == {"scheduled"}
    for value in next_kwargs(dsn, poisoned.dag_id).values():
        assert value["error"] == "Trigger failure"
        assert "could not be stored" in "".join(value["traceback"])
    assert supervisor.failures_total == 2 and supervisor.resumed_total == 7


def test_events_stuck_behind_an_outage_make_health_fail(env: AirflowConfig) -> None:
    dsn = env.database_dsn
    supervisor = make_supervisor(lease_seconds=3.0)
    seeded = seed(env, 1)
    load(supervisor)
    runner = runner_of(supervisor, seeded)
    supervisor.events.append(event_entry(runner, {"moment": LATER}))
    dbname = dsn.rsplit("/", 1)[1]
    admin = dsn.rsplit("/", 1)[0] + "/postgres"
    rows(admin, f'ALTER DATABASE "{dbname}" ALLOW_CONNECTIONS false; SELECT 1')
    rows(admin, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", dbname)
    # the leases were renewed by load() just now: a slow host that let 0.6 of the lease pass meanwhile
    # would renew first, fail against the closed database and drop every shard with its event
    supervisor.leases.last_renewal = time.monotonic()
    try:
        supervisor._db_step("events", supervisor.handle_events)
        supervisor._track_pending()
        assert len(supervisor.events) == 1
        time.sleep(3.2)
        supervisor.leases.last_renewal = (
            time.monotonic()
        )  # leases aside: the stuck event alone must fail health
        assert not is_healthy(supervisor.snapshot(), 3.0)
    finally:
        rows(admin, f'ALTER DATABASE "{dbname}" ALLOW_CONNECTIONS true; SELECT 1')
    load(supervisor)
    supervisor._db_step("events", supervisor.handle_events)
    supervisor._track_pending()
    assert is_healthy(supervisor.snapshot(), 3.0)
    assert set(ti_states(dsn, seeded.dag_id).values()) == {"scheduled"}


def test_a_leader_that_cannot_start_hands_the_group_to_another_member(env: AirflowConfig) -> None:
    """Issue 11.4: the leader's task was cleared between load and start."""
    dsn = env.database_dsn
    supervisor = make_supervisor()
    seeded = seed(env, 3)
    load(supervisor)
    leader = min(seeded.trigger_ids)
    rows(
        dsn,
        "UPDATE task_instance SET state = NULL, trigger_id = NULL WHERE trigger_id = %s RETURNING 1",
        leader,
    )
    supervisor.starting.start_groups()
    group = supervisor.groups.by_hash[supervisor.groups.hash_of_member[seeded.trigger_ids[1]]]
    assert group.runner_id == sorted(seeded.trigger_ids)[1]
    assert [w.id for w in supervisor.creating_triggers] == [group.runner_id]


def test_a_late_commit_with_a_lower_id_is_not_skipped(env: AirflowConfig) -> None:
    """Issue 11.10: incremental loads read by transaction id, not by ``trigger_id > max_seen``."""
    from smart_triggerer.supervisor.identities import compute_identities

    dsn = env.database_dsn
    supervisor = make_supervisor()
    early = seed(env, 2)
    late = seed(env, 2, moment=(dt.datetime.now(dt.UTC) + dt.timedelta(hours=4)).isoformat())
    assert max(early.trigger_ids) < min(late.trigger_ids)
    other = psycopg2.connect(dsn)  # another instance hashing the early rows, committing late
    try:
        cur = other.cursor()
        cur.execute(
            "SELECT id, classpath, kwargs FROM trigger WHERE id = ANY(%s) FOR UPDATE", (early.trigger_ids,)
        )
        for identity in compute_identities(cur.fetchall(), supervisor.settings):
            cur.execute(
                "INSERT INTO smart_triggerer.trigger_identity (trigger_id, identity_hash, "
                "shard, dedupable, execution) VALUES (%s, %s, %s, %s, %s)",
                (
                    identity.trigger_id,
                    identity.identity_hash,
                    identity.shard,
                    identity.dedupable,
                    json.dumps(identity.execution),
                ),
            )
        load(supervisor)
        assert set(supervisor.member_info) == set(late.trigger_ids)
        other.commit()
    finally:
        other.close()
    load(supervisor)
    assert set(supervisor.member_info) == set(early.trigger_ids) | set(late.trigger_ids)


def test_the_resume_hold_uses_the_database_clock(env: AirflowConfig) -> None:
    """Issue 11.10: an API server whose clock runs an hour ahead must not hold events for an hour."""
    dsn = env.database_dsn
    supervisor = make_supervisor(resume_hold_seconds=5.0)
    seeded = seed(env, 2)
    rows(
        dsn,
        "UPDATE trigger SET created_date = now() + interval '1 hour' WHERE id = ANY(%s) RETURNING 1",
        seeded.trigger_ids,
    )
    load(supervisor)
    holds = [supervisor.young_until[t] - time.monotonic() for t in seeded.trigger_ids]
    assert all(0 < h <= 5.0 for h in holds), holds


def test_young_task_members_of_a_mixed_group_are_held_then_resumed(env: AirflowConfig) -> None:
    """Issue 11.10: task members of a group that also serves an asset watcher."""

    dsn = env.database_dsn
    supervisor = make_supervisor(resume_hold_seconds=30.0)
    seeded = seed(env, 2)

    watcher = add_watcher("mixed")
    load(supervisor)
    group = supervisor.groups.by_hash[supervisor.groups.hash_of_member[watcher]]
    assert group.members == {watcher, *seeded.trigger_ids}
    runner = runner_of(supervisor, seeded)
    supervisor.events.append(event_entry(runner, {"moment": LATER}))
    supervisor.handle_events()
    assert group.members == {watcher}  # the watcher keeps the coroutine
    assert set(supervisor.held) == set(seeded.trigger_ids)
    for trigger_id in seeded.trigger_ids:
        supervisor.held[trigger_id].release_at = 0.0
    supervisor.release_held()
    assert set(ti_states(dsn, seeded.dag_id).values()) == {"scheduled"}


def test_health_snapshot_never_reads_what_the_loop_mutates(env: AirflowConfig) -> None:
    """Issue 11.10: /health used to iterate the group dicts while the loop changed them (500s)."""
    supervisor = make_supervisor()
    errors: list[BaseException] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            try:
                supervisor.snapshot()
            except BaseException as err:
                errors.append(err)

    thread = threading.Thread(target=poll)
    thread.start()
    try:
        for i in range(20_000):
            supervisor.groups.join(i, i % 50)
            if i % 3 == 0:
                supervisor.groups.leave(i - 1)
            if i % 100 == 0:
                supervisor.publish_snapshot()
    finally:
        stop.set()
        thread.join()
    assert errors == []


def test_starting_many_groups_deserializes_each_dag_version_once(
    env: AirflowConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 13 (50,000 waiters): Airflow's _create_workload deserializes the task's DAG for every trigger;
    one build reads each DAG version once and the workloads are what Airflow builds."""
    from airflow.jobs.triggerer_job_runner import TriggerRunnerSupervisor
    from airflow.models.dagbag import DBDagBag
    from airflow.models.trigger import Trigger
    from airflow.serialization.serialized_objects import DagSerialization
    from airflow.utils.helpers import log_filename_template_renderer
    from airflow.utils.session import create_session

    calls: list[int] = []
    original = DagSerialization.from_dict.__func__  # type: ignore[attr-defined]

    def counting(cls: Any, data: dict[str, Any]) -> Any:
        calls.append(1)
        return original(cls, data)

    supervisor = make_supervisor()
    first = seed_deferred(
        env.database_dsn,
        env.dags_folder,
        count=6,
        classpath=AT_TIME,
        kwargs_for=lambda i: {"moment": f"2099-01-0{i + 1}T00:00:00+00:00"},
    )
    second = seed(env, 2)
    load(supervisor)
    monkeypatch.setattr(DagSerialization, "from_dict", classmethod(counting))
    supervisor.starting.start_groups()
    started = {w.id: w for w in supervisor.creating_triggers}
    assert set(started) >= set(first.trigger_ids) | {min(second.trigger_ids)}
    assert len(calls) == 2  # two DAGs, one version each: not one per trigger
    assert supervisor.build_bag is None  # nothing kept past the build

    calls.clear()
    with create_session() as session:  # Airflow's own _create_workload, with its own DAG bag
        bag, render = DBDagBag(), log_filename_template_renderer()
        triggers = Trigger.bulk_fetch(set(first.trigger_ids), session=session).values()
        stock = [
            TriggerRunnerSupervisor._create_workload(supervisor, t, bag, render, session) for t in triggers
        ]
    assert len(calls) == len(first.trigger_ids)  # what Airflow alone costs
    for workload in stock:  # what the runner gets (the DTO's executor-only fields are never sent)
        assert workload is not None
        assert started[workload.id].model_dump() == workload.model_dump()


def blip_once(monkeypatch: pytest.MonkeyPatch, method: str) -> list[str]:
    """The next call of ``Store.<method>`` loses its connection first: its own backend is terminated by
    the server (a real connection blip, seen by SQLAlchemy as an invalidated connection)."""
    from sqlalchemy import text

    from smart_triggerer.db.store import Store

    original = getattr(Store, method)
    blips: list[str] = []

    def blipping(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not blips:
            blips.append(method)
            self.session.execute(text("SELECT pg_terminate_backend(pg_backend_pid())"))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Store, method, blipping)
    return blips


def test_shards_taken_in_a_loop_that_then_fails_are_read_when_it_recovers(
    env: AirflowConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 25.1, a rolling deploy: A stops gracefully; B takes A's shards in a loop whose next statement
    loses its connection. The shards stay "to be read in full" until that read commits."""
    first = make_supervisor()
    seeded = seed_deferred(
        env.database_dsn,
        env.dags_folder,
        count=12,
        classpath=AT_TIME,
        kwargs_for=lambda i: {"moment": f"2099-01-{i + 1:02d}T00:00:00+00:00"},
    )
    load(first)
    second = make_supervisor()
    load(second)  # A's leases hold: B owns nothing yet, but has read the feed (its position is set)
    assert set(first.member_info) == set(seeded.trigger_ids) and not second.owned
    first.release_all()

    blips = blip_once(monkeypatch, "waiting_triggers")
    second._db_step("load", second.read_changes)
    assert blips and second.owned == {0, 1, 2, 3} and not second.db_ok  # taken, then the blip
    second._db_step("load", second.read_changes)
    assert set(second.member_info) == set(seeded.trigger_ids)
    assert not second.to_read


def test_members_fenced_out_on_its_own_lapsed_lease_run_again_when_it_reclaims(
    env: AirflowConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 25.3: a slow loop lets the instance's own leases lapse by the database clock; the event it
    then stores is fenced out. Renewing the same shards must read their waiters again, not leave them
    deferred with no coroutine; the event is stored once they are back."""
    dsn = env.database_dsn
    supervisor = make_supervisor(lease_seconds=3.0)
    seeded = seed(env, 3)
    load(supervisor)
    runner = runner_of(supervisor, seeded)
    supervisor.running_triggers.add(runner)  # the coroutine runs on, and fires

    def valid_leases() -> list[tuple[Any, ...]]:
        # its membership is kept (a heartbeat without a lease renewal): the re-read that follows must come
        # from the lapsed shards alone, not from a full re-read after a lapsed membership
        supervisor.leases.heartbeat_counters()
        return rows(
            dsn, "SELECT count(*) FROM smart_triggerer.shard_lease WHERE expires_at > clock_timestamp()"
        )

    wait_for(
        valid_leases, lambda r: r == [(0,)], 10, "the leases to lapse by the database clock", interval=0.05
    )
    full_reads: list[int] = []
    original = supervisor.leases.lost_the_feed
    monkeypatch.setattr(
        supervisor.leases,
        "lost_the_feed",
        lambda: (full_reads.append(1), original())[1],  # type: ignore[func-returns-value]
    )
    supervisor.events.append(event_entry(runner, {"moment": LATER}, seq=21))
    # by the host's clock the leases were renewed a moment ago (the database's clock stepped forward):
    # the loop does not renew before it writes, and the write's fence finds them lapsed
    supervisor.leases.last_renewal = time.monotonic()
    supervisor._db_step("events", supervisor.handle_events)
    assert set(ti_states(dsn, seeded.dag_id).values()) == {"deferred"}  # fenced out
    assert not supervisor.owned and list(supervisor.persisted_event_seqs) == []

    supervisor.leases.heartbeat_counters()
    load(supervisor)  # the same instance claims the same shards again
    assert not full_reads, "its membership held: the lapsed shards alone are read again"
    assert set(seeded.trigger_ids) <= set(supervisor.member_info)
    supervisor.starting.start_groups()
    supervisor._db_step("events", supervisor.handle_events)
    assert set(ti_states(dsn, seeded.dag_id).values()) == {"scheduled"}
    assert list(supervisor.persisted_event_seqs) == [21] and supervisor.resumed_total == 3


def lease_expiries(dsn: str) -> dict[int, dt.datetime]:
    return dict(rows(dsn, "SELECT shard, expires_at FROM smart_triggerer.shard_lease WHERE queues = ''"))


def test_a_slow_loop_with_valid_leases_keeps_its_groups_running(env: AirflowConfig) -> None:
    """Issue 25.11: a busy host made one loop take longer than 0.6 of a lease; the leases were still
    valid by the database clock, yet every shard was dropped and taken back (a stall for every wait)."""
    from structlog.testing import capture_logs

    dsn = env.database_dsn
    supervisor = make_supervisor()
    seeded = seed(env, 3)
    load(supervisor)
    runner = runner_of(supervisor, seeded)
    before = lease_expiries(dsn)
    time.sleep(supervisor.settings.lease_seconds * 0.7)  # the slow loop itself (the fault, not a wait)
    with capture_logs() as logs:
        supervisor.leases.guard()
    assert supervisor.owned == {0, 1, 2, 3}
    assert supervisor.groups.by_runner(runner) is not None
    assert set(supervisor.member_info) == set(seeded.trigger_ids)
    after = lease_expiries(dsn)
    assert all(after[shard] > before[shard] for shard in before)  # renewed on the database clock
    assert not [entry for entry in logs if "stopping all shards" in entry["event"]]


def test_shards_stop_before_expiry_when_the_database_is_unreachable_and_the_cause_is_logged(
    env: AirflowConfig,
) -> None:
    from structlog.testing import capture_logs

    dsn = env.database_dsn
    supervisor = make_supervisor()
    seeded = seed(env, 3)
    load(supervisor)
    runner_of(supervisor, seeded)
    dbname = dsn.rsplit("/", 1)[1]
    admin = dsn.rsplit("/", 1)[0] + "/postgres"
    rows(admin, f'ALTER DATABASE "{dbname}" ALLOW_CONNECTIONS false; SELECT 1')
    rows(admin, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", dbname)
    try:
        time.sleep(supervisor.settings.lease_seconds * 0.7)  # the loop that could not renew
        with capture_logs() as logs:
            supervisor.leases.guard()
    finally:
        rows(admin, f'ALTER DATABASE "{dbname}" ALLOW_CONNECTIONS true; SELECT 1')
    assert not supervisor.owned and not supervisor.member_info
    stopped = [entry for entry in logs if "stopping all shards" in entry["event"]]
    assert len(stopped) == 1 and "OperationalError" in stopped[0]["cause"], logs


def watcher_group(supervisor: Any, watcher: int) -> Any:
    return supervisor.groups.by_hash[supervisor.groups.hash_of_member[watcher]]


def restarted(supervisor: Any, watcher: int) -> Any:
    """One loop's start step; the watcher group's runner id once it asked the runner for it again."""
    supervisor.starting.start_groups()
    return watcher_group(supervisor, watcher).runner_id


def test_an_event_the_asset_manager_cannot_store_fails_alone_and_the_instance_lives(
    env: AirflowConfig, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """Issue 25.6: a non-database exception in the event path (here Airflow's configured asset manager is
    the bridge's, and its routes file is missing on this host) used to escape the loop and kill the
    instance; the next owner re-fired the event and died too. The watcher restarts with backoff, the
    task group's event in the same batch is stored (restarted, reported)."""
    import airflow.assets.manager

    from dataset_bridge.asset_manager import OutboxAssetManager
    from smart_triggerer.web.health import render_metrics

    dsn = env.database_dsn
    supervisor = make_supervisor()
    other = (dt.datetime.now(dt.UTC) + dt.timedelta(hours=3)).isoformat()
    tasks = seed(env, 2, moment=other)
    watcher = add_watcher("poisoned")  # after seeding: syncing a DAG drops watchers no DAG declares
    load(supervisor)
    supervisor.starting.start_groups()
    watcher_runner = watcher_group(supervisor, watcher).runner_id
    task_runner = runner_of(supervisor, tasks)
    supervisor.running_triggers.update({watcher_runner, task_runner})
    good_manager = airflow.assets.manager.asset_manager
    monkeypatch.setattr(
        airflow.assets.manager,
        "asset_manager",
        OutboxAssetManager(routes=str(tmp_path / "missing-routes.json")),
    )
    supervisor.events.append(
        event_entry(watcher_runner, {"moment": LATER, "idempotency_key": "row-1"}, seq=5)
    )
    supervisor.events.append(event_entry(task_runner, {"moment": other}))
    supervisor._db_step("events", supervisor.handle_events)

    assert not supervisor.events and list(supervisor.persisted_event_seqs) == []
    assert set(ti_states(dsn, tasks.dag_id).values()) == {"scheduled"}
    assert rows(dsn, "SELECT count(*) FROM asset_event") == [(0,)]
    group = watcher_group(supervisor, watcher)
    assert group.members == {watcher} and group.runner_id is None  # kept, its coroutine stopped
    counters = supervisor._counters()
    assert counters["watchers_failing"] == 1 and counters["watcher_restarts_total"] == 1
    supervisor.publish_snapshot()
    assert "cannot read the routes" in supervisor.snapshot()["last_watcher_error"]
    assert 'smart_triggerer_watchers_failing{job_id="' in render_metrics(supervisor.snapshot())

    supervisor.running_triggers.discard(watcher_runner)  # the runner cancelled it
    runner = wait_for(
        lambda: restarted(supervisor, watcher),
        lambda r: r is not None,
        10,
        "the watcher to start again after its backoff",
        interval=0.1,
    )
    assert runner in {w.id for w in supervisor.creating_triggers}
    monkeypatch.setattr(airflow.assets.manager, "asset_manager", good_manager)
    supervisor.running_triggers.add(runner)
    supervisor.events.append(event_entry(runner, {"moment": LATER, "idempotency_key": "row-1"}, seq=6))
    supervisor._db_step("events", supervisor.handle_events)
    assert rows(dsn, "SELECT count(*) FROM asset_event") == [(1,)]
    assert list(supervisor.persisted_event_seqs) == [6]
    assert supervisor._counters()["watchers_failing"] == 0


def test_a_failed_asset_watcher_starts_again_with_backoff(env: AirflowConfig) -> None:
    """Issue 25.4: a watcher whose coroutine failed once was never restarted on this instance (stock
    Airflow restarts it); the wait doubles with each failure in a row."""
    supervisor = make_supervisor()
    watcher = add_watcher("flaky")
    load(supervisor)
    supervisor.starting.start_groups()
    first = watcher_group(supervisor, watcher).runner_id
    supervisor.failed_triggers.append((first, ConnectionRefusedError("warehouse is down")))
    supervisor._db_step("failures", supervisor.handle_failed_triggers)
    assert watcher in supervisor.member_info and watcher_group(supervisor, watcher).runner_id is None
    failed_at = time.monotonic()
    again = wait_for(
        lambda: restarted(supervisor, watcher),
        lambda r: r is not None,
        10,
        "the first restart",
        interval=0.05,
    )
    first_wait = time.monotonic() - failed_at
    supervisor.failed_triggers.append((again, ConnectionRefusedError("warehouse is down")))
    supervisor._db_step("failures", supervisor.handle_failed_triggers)
    failed_at = time.monotonic()
    wait_for(
        lambda: restarted(supervisor, watcher),
        lambda r: r is not None,
        10,
        "the second restart",
        interval=0.05,
    )
    second_wait = time.monotonic() - failed_at
    # 1 s, then 2 s: each under the next step's wait (a busy host's loop adds a little, never a step)
    assert 0.9 <= first_wait < 1.9 <= second_wait < 3.9, (first_wait, second_wait)
    assert supervisor.watcher_restarts_total == 2
    assert supervisor.failures_total == 0  # nothing to fail: no task waits on it


def test_a_watcher_event_that_never_stores_is_set_aside_and_acknowledged(
    env: AirflowConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From a review: a watcher whose source replays what was not acknowledged (a status table in
    ack mode) met the same unstorable event at every restart, for ever, and its later rows never became
    events. After DEAD_AFTER failures of that event it is set aside (dead_event) and acknowledged; the
    watcher runs on and its next event is stored."""
    import airflow.assets.manager

    import smart_triggerer.supervisor.events as supervisor_module

    dsn = env.database_dsn
    monkeypatch.setattr(supervisor_module, "DEAD_AFTER", 3)
    monkeypatch.setattr(supervisor_module, "WATCHER_BACKOFF_SECONDS", 0.01)
    supervisor = make_supervisor()
    watcher = add_watcher("replayed")
    load(supervisor)
    supervisor.starting.start_groups()

    class Refusing:
        def register_asset_change(self, **kw: Any) -> None:
            raise ValueError("the listener cannot take row 'row-1'")

    good_manager = airflow.assets.manager.asset_manager
    monkeypatch.setattr(airflow.assets.manager, "asset_manager", Refusing())
    for attempt in (1, 2, 3):
        runner = wait_for(
            lambda: restarted(supervisor, watcher),
            lambda r: r is not None,
            10,
            "the watcher to start (again)",
            interval=0.02,
        )
        supervisor.running_triggers.add(runner)
        supervisor.events.append(
            event_entry(runner, {"moment": LATER, "idempotency_key": "row-1"}, seq=attempt)
        )
        supervisor._db_step("events", supervisor.handle_events)
        if attempt < 3:
            assert list(supervisor.persisted_event_seqs) == []
            assert watcher_group(supervisor, watcher).runner_id is None  # restarting with backoff
            supervisor.running_triggers.discard(runner)  # the runner cancelled it
    assert list(supervisor.persisted_event_seqs) == [3]
    dead = rows(dsn, "SELECT trigger_id, attempts, cause, payload FROM smart_triggerer.dead_event")
    assert len(dead) == 1 and dead[0][:2] == (watcher, 3)
    assert "cannot take row" in dead[0][2] and "row-1" in dead[0][3]
    assert watcher_group(supervisor, watcher).runner_id == runner  # runs on: its source moves past it
    supervisor.publish_snapshot()
    assert supervisor.snapshot()["events_dead_total"] == 1

    monkeypatch.setattr(airflow.assets.manager, "asset_manager", good_manager)
    supervisor.events.append(event_entry(runner, {"moment": LATER, "idempotency_key": "row-2"}, seq=4))
    supervisor._db_step("events", supervisor.handle_events)
    assert rows(dsn, "SELECT count(*) FROM asset_event") == [(1,)]
    assert list(supervisor.persisted_event_seqs) == [3, 4]


def test_thousands_of_coroutines_ending_at_once_close_their_files_a_budget_at_a_time(
    env: AirflowConfig, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A handover of 13,000 coroutines at 50,000 waiters ended them all in one runner message; Airflow
    closed (and made, their first lines still held) every log file while handling it, and the loop stood
    for seconds past the lease: the instance's other shards were taken by its peer and taken back (a flap
    seen in the bench's logs). The files are closed a budget per loop pass instead, each with its lines."""
    from pathlib import Path

    from airflow.jobs.triggerer_job_runner import messages

    from smart_triggerer.supervisor import log_files
    from smart_triggerer.supervisor.trigger_logs import PooledTriggerLoggingFactory

    monkeypatch.setattr(log_files, "WRITE_HELD_SECONDS", 0.0)  # one file per pass: the budget is what counts
    supervisor = make_supervisor()
    ids = list(range(1_000_000, 1_000_300))
    supervisor.log_files.pool.holding = True  # a takeover's start: first lines held, files not made yet
    for trigger_id in ids:
        factory = PooledTriggerLoggingFactory(
            log_path=str(tmp_path / f"{trigger_id}.log"),
            ti=None,  # type: ignore[arg-type]  # no task instance: the test plays the runner
            pool=supervisor.log_files.pool,
        )
        factory([lambda _l, _m, event: str(event["event"]).encode()]).log(20, "trigger starting")
        supervisor.logger_cache[trigger_id] = factory
        supervisor.running_triggers.add(trigger_id)

    # events' default is in its Field(), which mypy does not read (no pydantic plugin)
    supervisor._handle_request(messages.TriggerStateChanges(finished=ids), structlog.get_logger(), 1)  # type: ignore[call-arg]
    files = [tmp_path / f"{trigger_id}.log" for trigger_id in ids]
    assert not any(f.exists() for f in files) and list(supervisor.log_files.ended) == ids
    assert not supervisor.running_triggers & set(ids)  # Airflow's own bookkeeping went on

    supervisor._pool_log_file(ids[-1])  # the id starts again here: its ended file is closed first
    assert files[-1].exists() and ids[-1] not in supervisor.log_files.ended
    passes = 0
    while supervisor.log_files.ended:
        supervisor.log_files.written_at = -math.inf  # a pass is due (the test does not wait for the interval)
        supervisor.log_files.pace()
        passes += 1
    assert passes == len(ids) - 1
    assert all(Path(f).read_text() == "trigger starting\n" for f in files)


def test_a_log_file_that_cannot_be_closed_never_stops_the_loop(
    env: AirflowConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Closing an ended coroutine's file runs in the loop, outside Airflow's request handling (which
    caught any error): a full disk or a stale network mount, or a remote log handler that cannot even be
    loaded, must cost a warning, not the supervisor."""
    from airflow.jobs.triggerer_job_runner import messages
    from airflow.sdk import log as sdk_log

    def unreachable() -> None:
        raise RuntimeError("remote log store unreachable")

    monkeypatch.setattr(sdk_log, "load_remote_log_handler", unreachable)

    class Unclosable:
        log_path = "dag_id=d/unclosable.log"

        def close(self) -> None:
            raise OSError(28, "No space left on device")

    supervisor = make_supervisor()
    supervisor.logger_cache[7] = Unclosable()
    supervisor.running_triggers.add(7)
    supervisor._handle_request(messages.TriggerStateChanges(finished=[7]), structlog.get_logger(), 1)  # type: ignore[call-arg]
    supervisor.log_files.written_at = -math.inf
    with structlog.testing.capture_logs() as logs:
        supervisor.log_files.pace()
    assert not supervisor.log_files.ended
    events = {e["event"] for e in logs}
    assert {"Failed to upload trigger logs to remote", "could not close a trigger's log file"} <= events
