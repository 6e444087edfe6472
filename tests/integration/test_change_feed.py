"""The change feed: each loop reads what changed among trigger rows, never every waiter.

Driven step by step in this process against a real PostgreSQL, as in test_supervisor_faults: the test
plays the runner and calls the supervisor's loop steps, then checks what the database and the supervisor
hold. Every fault is one the old full reload covered and the feed must cover by itself: a late commit, a
hasher that dies holding row locks, a trigger an asset watcher starts to use, a departure, a timeout, an
instance that lost track of the feed while the others pruned it.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Iterator
from typing import Any

import psycopg2
import pytest

from devkit.devstack import AirflowConfig
from smart_triggerer.db.store import Store
from tests.helpers.seeding import Seeded, seed_deferred
from tests.helpers.waiting import rows, ti_states, wait_for
from tests.integration.test_supervisor_faults import (
    AT_TIME,
    LATER,
    add_watcher,
    event_entry,
    load,
    make_supervisor,
)


def seed(config: AirflowConfig, count: int, **kw: Any) -> Seeded:
    return seed_deferred(
        config.database_dsn,
        config.dags_folder,
        count=count,
        classpath=AT_TIME,
        kwargs_for=lambda i: {"moment": LATER},
        **kw,
    )


class Reads:
    """Counts the waiter rows the supervisor's store returns (full reads and incremental ones)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.full = 0
        self.changed = 0
        read = Store.waiting_triggers

        def counted(store: Store, *args: Any, **kwargs: Any) -> Any:
            found = read(store, *args, **kwargs)
            if kwargs.get("after_xid") is None:
                self.full += len(found)
            else:
                self.changed += len(found)
            return found

        monkeypatch.setattr(Store, "waiting_triggers", counted)


@pytest.fixture
def statements() -> Iterator[list[str]]:
    """The first words of every statement this process runs while the test does."""
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    seen: list[str] = []

    def after(conn: Any, cursor: Any, statement: str, *_rest: Any) -> None:
        seen.append(" ".join(statement.split()[:4]))

    event.listen(Engine, "after_cursor_execute", after)
    yield seen
    event.remove(Engine, "after_cursor_execute", after)


def test_a_loop_in_which_nothing_changed_reads_no_waiter(
    env: AirflowConfig, monkeypatch: pytest.MonkeyPatch, statements: list[str]
) -> None:
    supervisor = make_supervisor()
    seeded = seed(env, 30)
    reads = Reads(monkeypatch)
    load(supervisor)  # the first load reads everything once
    assert reads.full == 30 and set(supervisor.member_info) == set(seeded.trigger_ids)
    catch_up(supervisor, reads)
    statements.clear()
    for _ in range(5):
        load(supervisor)
    assert (reads.full, reads.changed) == (0, 0)
    # renewal (heartbeat, live members, the shards' owners and loads for placement, leases) and one probe
    # of the feed: nothing per waiter
    assert len(statements) == 5 * 5, statements
    more = seed(env, 3)
    load(supervisor)
    assert (reads.full, reads.changed) == (0, 3)
    assert set(supervisor.member_info) == set(seeded.trigger_ids) | set(more.trigger_ids)


def catch_up(supervisor: Any, reads: Reads) -> None:
    """Load until a load reads no waiter: the feed positions have passed the first load's own writes. Alone,
    one load does it; a transaction open in another database of the cluster (a test beside this one)
    holds back every snapshot's xmin, and so the positions, and loads read those rows again until it ends."""

    def read_by_a_load() -> tuple[int, int]:
        reads.full = reads.changed = 0
        load(supervisor)
        return reads.full, reads.changed

    wait_for(
        read_by_a_load,
        lambda read: read == (0, 0),
        60,
        "the feed positions to pass the first load's writes",
        interval=0.1,
    )


def test_a_departure_is_read_from_the_feed(env: AirflowConfig) -> None:
    """A task cleared while deferred: Airflow's clean_unused deletes its trigger row; the next load
    forgets the member (its coroutine is cancelled with on_kill, as stock Airflow does)."""
    from airflow.models.trigger import Trigger

    dsn = env.database_dsn
    supervisor = make_supervisor()
    seeded = seed(env, 2)
    load(supervisor)
    gone = seeded.trigger_ids[0]
    rows(dsn, "UPDATE task_instance SET state = 'success' WHERE trigger_id = %s RETURNING 1", gone)
    Trigger.clean_unused()
    load(supervisor)
    assert set(supervisor.member_info) == {seeded.trigger_ids[1]}
    assert supervisor.groups.waiter_count() == 1


def test_a_hasher_that_dies_holding_new_rows_loses_none(env: AirflowConfig) -> None:
    """Another instance locked the new rows to hash them and died before committing: the feed position
    must not move past them, so they are hashed (and waited on) once the lock is gone."""
    dsn = env.database_dsn
    supervisor = make_supervisor()
    load(supervisor)
    seeded = seed(env, 3)
    other = psycopg2.connect(dsn)
    try:
        other.cursor().execute("SELECT id FROM trigger WHERE id = ANY(%s) FOR UPDATE", (seeded.trigger_ids,))
        load(supervisor)
        load(supervisor)
        assert supervisor.member_info == {}
    finally:
        other.close()  # dies: its transaction rolls back, nothing was hashed
    load(supervisor)
    load(supervisor)
    assert set(supervisor.member_info) == set(seeded.trigger_ids)


def test_a_sweep_reads_on_from_its_last_batch_and_a_later_pass_hashes_what_a_peer_held(
    env: AirflowConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A start's sweep (rows the feed does not cover) reads in id order, each batch from where the last
    one ended, never from the first row again; rows a peer held locked meanwhile and then let go unhashed
    (it died) are hashed by the next pass, which starts from the first row."""
    dsn = env.database_dsn
    seeded = seed(env, 30)  # before the instance starts: only its sweep reads them
    held = seeded.trigger_ids[8:12]
    batches: list[tuple[int, list[int]]] = []  # (after_id, ids read) of each batch of a sweep
    read = Store.unhashed_triggers

    def recorded(store: Store, *args: Any, **kwargs: Any) -> Any:
        found = read(store, *args, **kwargs)
        if kwargs.get("after_xid") is None:
            batches.append((kwargs.get("after_id", 0), [r[0] for r in found]))
        return found

    monkeypatch.setattr(Store, "unhashed_triggers", recorded)
    supervisor = make_supervisor(max_new_per_loop=1)  # batches of 4 rows
    ours = [i for i in seeded.trigger_ids if i not in held]

    def hashed(ids: list[int]) -> int:
        supervisor.read_changes()
        query = "SELECT count(*) FROM smart_triggerer.trigger_identity WHERE trigger_id = ANY(%s)"
        return int(rows(dsn, query, ids)[0][0])

    other = psycopg2.connect(dsn)
    try:
        other.cursor().execute("SELECT id FROM trigger WHERE id = ANY(%s) FOR UPDATE", (held,))
        wait_for(
            lambda: hashed(ours), lambda n: n == len(ours), 60, "the rows no peer holds hashed", interval=0.0
        )
        assert hashed(held) == 0
    finally:
        other.close()  # dies: its transaction rolls back, nothing was hashed
    first_pass = batches[: next(n for n, (_after, ids) in enumerate(batches) if len(ids) < 4) + 1]
    for (after, ids), (_, before) in zip(first_pass[1:], first_pass, strict=False):
        assert after == before[-1] and all(i > after for i in ids)  # on from the last row, never back
    assert set(ours) <= {i for _after, ids in first_pass for i in ids}
    load(supervisor)
    load(supervisor)
    assert hashed(seeded.trigger_ids) == len(seeded.trigger_ids)
    assert any(after == 0 for after, _ in batches[1:])  # a later pass started from the first row


def test_a_trigger_an_asset_watcher_starts_to_use_is_loaded(env: AirflowConfig) -> None:
    """Airflow may point a new asset watcher at an existing trigger row: no row is inserted into trigger,
    yet the row is waited on from now."""
    from airflow.models.asset import AssetModel, AssetWatcherModel
    from airflow.models.trigger import Trigger
    from airflow.utils.session import create_session

    from tests.helpers.triggers import AtTimeTrigger

    supervisor = make_supervisor()
    with create_session() as session:
        row = Trigger.from_object(AtTimeTrigger(moment=LATER))
        session.add(row)
        session.flush()
        trigger_id = int(row.id)
    load(supervisor)
    load(supervisor)
    assert trigger_id not in supervisor.member_info  # hashed, but nothing waits on it yet
    with create_session() as session:
        asset = AssetModel(name="late", uri="test://late", group="asset")
        session.add(asset)
        session.flush()
        session.add(AssetWatcherModel(name="w", asset_id=asset.id, trigger_id=trigger_id))
    load(supervisor)
    assert trigger_id in supervisor.member_info


def test_a_member_times_out_when_its_deadline_comes(env: AirflowConfig) -> None:
    """Timeouts are kept from the load (no query per loop) and fire when due, by the database clock."""
    dsn = env.database_dsn
    supervisor = make_supervisor()
    seeded = seed(env, 2, trigger_timeout=dt.timedelta(seconds=6))
    load(supervisor)
    supervisor.deadlines.timeout_members()
    # read after the check: the deadline still ahead by the database clock (6 s: a busy host's seed and
    # load took most of the 2 s this test once had)
    assert rows(
        dsn,
        "SELECT bool_and(trigger_timeout > clock_timestamp()) FROM task_instance WHERE dag_id = %s",
        seeded.dag_id,
    ) == [(True,)]
    assert set(ti_states(dsn, seeded.dag_id).values()) == {"deferred"}

    def timed_out() -> dict[int, str]:
        load(supervisor)  # a loop: the leases renewed (a time-out is written under them, fenced)
        supervisor.deadlines.timeout_members()
        return ti_states(dsn, seeded.dag_id)

    wait_for(timed_out, lambda s: set(s.values()) == {"scheduled"}, 30, "the tasks timed out", interval=0.2)
    # timed out when due: the write (scheduled_dttm, its transaction's start) came within a loop (a look
    # just before the deadline by the database clock is taken again a loop later) and this test's looks
    late = rows(
        dsn,
        "SELECT min(extract(epoch FROM scheduled_dttm - trigger_timeout)), "
        "max(extract(epoch FROM scheduled_dttm - trigger_timeout)) FROM task_instance "
        "WHERE dag_id = %s",
        seeded.dag_id,
    )[0]
    assert float(late[0]) > -0.5 and float(late[1]) < 3.0, late
    assert supervisor.member_info == {}


def test_an_instance_that_lost_track_of_the_feed_reads_everything_again(env: AirflowConfig) -> None:
    """Paused past its membership (SIGSTOP, a long GC), it no longer holds back pruning: the others
    prune the feed meanwhile. Back, it must read every waiter again, not trust a position whose rows are
    gone."""
    from airflow.models.trigger import Trigger

    dsn = env.database_dsn
    paused = make_supervisor()
    seeded = seed(env, 3)
    load(paused)
    # while it sleeps: one waiter leaves, three arrive, its membership lapses, and a live instance (of
    # another queue set, so that it takes none of these shards) that has read everything prunes the feed
    rows(
        dsn,
        "UPDATE task_instance SET state = 'success' WHERE trigger_id = %s RETURNING 1",
        seeded.trigger_ids[0],
    )
    Trigger.clean_unused()
    arrived = seed(env, 3)
    lapse(dsn, paused.job_id)
    # its position past every transaction begun so far (xmax, not xmin: the snapshot's xmin is the
    # cluster's, held back by any transaction open in another database, e.g. a test running beside this one)
    rows(
        dsn,
        "INSERT INTO smart_triggerer.instance (job_id, hostname, capacity, queues, feed_xmin) "
        "VALUES (-1, 'other', 1, 'elsewhere', pg_snapshot_xmax(pg_current_snapshot())) RETURNING 1",
    )
    with _session() as session:
        assert Store(session).prune_feed(6.0) > 0
    assert rows(dsn, "SELECT count(*) FROM smart_triggerer.trigger_change")[0][0] == 0
    paused.leases.last_renewal = time.monotonic() - 60  # it wakes up
    load(paused)
    assert set(paused.member_info) == set(seeded.trigger_ids[1:]) | set(arrived.trigger_ids)


def test_pruning_keeps_what_a_live_instance_has_not_read(env: AirflowConfig) -> None:
    supervisor = make_supervisor()
    load(supervisor)
    seed(env, 2)
    with _session() as session:
        assert Store(session).prune_feed(6.0) == 0  # its published position is before the new rows
    load(supervisor)
    load(supervisor)  # hashed, loaded, and the position published with the next heartbeat

    # once its published position passes the new rows: its position is a snapshot's xmin, the cluster's,
    # which a transaction open in another database (a test running beside this one) holds back a while
    def pruned_after_a_load() -> int:
        load(supervisor)
        with _session() as session:
            return Store(session).prune_feed(6.0)

    assert wait_for(pruned_after_a_load, bool, 60, "the feed rows to be pruned", interval=0.1) > 0


def test_the_feed_triggers_are_put_back_when_missing(env: AirflowConfig) -> None:
    """`airflow db` commands that recreate a table drop our triggers with it: each start puts them back."""
    dsn = env.database_dsn
    supervisor = make_supervisor()
    load(supervisor)
    rows(dsn, "DROP TRIGGER smart_triggerer_feed_created ON trigger; SELECT 1")
    with _session() as session:
        assert Store(session).ensure_feed() is True  # what every start runs (Store.migrate)
    with _session() as session:
        assert Store(session).ensure_feed() is False
    seeded = seed(env, 2)
    load(supervisor)
    load(supervisor)
    assert set(supervisor.member_info) == set(seeded.trigger_ids)


def lapse(dsn: str, job_id: int, lease_seconds: float = 6.0) -> None:
    """The instance renews nothing (paused: no loop runs) until its membership lapses by the database
    clock: a real lapse, waited for, not a row written back in time."""
    wait_for(
        lambda: rows(
            dsn,
            "SELECT heartbeat_at < now() - make_interval(secs => %s) FROM "
            "smart_triggerer.instance WHERE job_id = %s",
            lease_seconds,
            job_id,
        ),
        lambda r: r == [(True,)],
        3 * lease_seconds,
        "its membership lapsed",
    )


def feed_triggers(dsn: str) -> int:
    return int(rows(dsn, "SELECT count(*) FROM pg_trigger WHERE tgname LIKE 'smart_triggerer_feed_%%'")[0][0])


def test_the_last_instance_to_stop_takes_the_feed_off_airflows_tables(env: AirflowConfig) -> None:
    """Back to the stock triggerer, nothing should keep writing a feed nobody reads."""
    dsn = env.database_dsn
    first, second = make_supervisor(), make_supervisor()
    load(first)
    load(second)
    # an instance of an older version, live, that neither reads nor prunes the feed: it does not count
    rows(
        dsn,
        "INSERT INTO smart_triggerer.instance (job_id, hostname, capacity, queues) "
        "VALUES (-2, 'old-version', 1, 'elsewhere') RETURNING 1",
    )
    first.release_all()
    assert feed_triggers(dsn) == 3  # another instance still reads it
    second.release_all()
    assert feed_triggers(dsn) == 0
    assert rows(dsn, "SELECT count(*) FROM smart_triggerer.trigger_change")[0][0] == 0
    seeded = seed(env, 2)  # deferred while no smart triggerer runs: no feed rows
    third = make_supervisor()
    assert feed_triggers(dsn) == 3
    load(third)
    assert set(third.member_info) == set(seeded.trigger_ids)


def test_an_instance_paused_while_the_last_other_stopped_puts_the_feed_back(env: AirflowConfig) -> None:
    dsn = env.database_dsn
    paused, other = make_supervisor(), make_supervisor()
    load(paused)
    load(other)
    lapse(dsn, paused.job_id)
    other.release_all()  # `paused` looks stopped: the feed goes
    assert feed_triggers(dsn) == 0
    early = seed(env, 2)
    paused.leases.last_renewal = time.monotonic() - 60  # it wakes up
    load(paused)
    assert feed_triggers(dsn) == 3
    late = seed(env, 2)
    load(paused)
    load(paused)
    assert set(paused.member_info) == set(early.trigger_ids) | set(late.trigger_ids)


def test_positions_ahead_of_the_database_mean_it_went_back(env: AirflowConfig) -> None:
    """A failover to a replica that missed the last transactions hands out transaction ids again below
    what was read: rows committed there must not be skipped."""
    supervisor = make_supervisor()
    load(supervisor)
    ahead = str(10**12)
    supervisor.load_xmin = supervisor.hash_xmin = ahead
    seeded = seed(env, 2)
    load(supervisor)
    load(supervisor)
    assert set(supervisor.member_info) == set(seeded.trigger_ids)


def test_a_watcher_coroutine_that_ended_with_its_event_is_started_again(env: AirflowConfig) -> None:
    """Watchers keep waiting after an event: a coroutine that ended after yielding one is started again
    once its event is stored, even when nothing else changes (the runner is asked only on changes)."""
    supervisor = make_supervisor()
    watcher = add_watcher("again")
    load(supervisor)
    supervisor.starting.start_groups()
    assert [w.id for w in supervisor.creating_triggers] == [watcher]
    # the runner takes it, the coroutine yields an event and ends; the next load comes before the event
    # is stored (as run_once orders its steps)
    supervisor.creating_triggers.clear()
    supervisor.events.append(event_entry(watcher, {"moment": LATER}))
    supervisor.runner_changes += 1
    supervisor.starting.start_groups()
    assert not supervisor.creating_triggers
    supervisor.handle_events()
    supervisor.starting.start_groups()
    assert [w.id for w in supervisor.creating_triggers] == [watcher]


def test_deadlines_of_members_that_left_do_not_pile_up(env: AirflowConfig) -> None:
    supervisor = make_supervisor()
    seeded = seed(env, 2, trigger_timeout=dt.timedelta(days=7))
    load(supervisor)
    supervisor.deadlines.deadlines.extend((supervisor.shared.db_now() + 3600 + i, -i) for i in range(1, 5000))
    supervisor.deadlines.timeout_members()
    assert sorted(t for _due, t in supervisor.deadlines.deadlines) == sorted(seeded.trigger_ids)


def test_a_task_cleared_while_deferred_stops_its_coroutine(env: AirflowConfig) -> None:
    """Airflow keeps the trigger row of a task cleared while deferred (state NULL, trigger_id kept): the
    feed never reports it, the once-a-minute check does."""
    dsn = env.database_dsn
    supervisor = make_supervisor()
    seeded = seed(env, 2)
    load(supervisor)
    cleared = seeded.trigger_ids[0]
    rows(dsn, "UPDATE task_instance SET state = NULL WHERE trigger_id = %s RETURNING 1", cleared)
    load(supervisor)
    assert cleared in supervisor.member_info  # no row was deleted
    supervisor.housekeeping.forget_lingering()
    assert set(supervisor.member_info) == {seeded.trigger_ids[1]}


def _session() -> Any:
    from airflow.utils.session import create_session

    return create_session()


def feed_functions(dsn: str) -> dict[str, str]:
    """Each feed trigger's function name."""
    found = rows(
        dsn,
        "SELECT t.tgname, p.proname FROM pg_trigger t JOIN pg_proc p ON p.oid = t.tgfoid "
        "WHERE t.tgname LIKE 'smart_triggerer_feed_%%'",
    )
    return {name: function for name, function in found}


def changes(dsn: str, trigger_ids: list[int]) -> list[tuple[int, bool]]:
    return [
        (r[0], r[1])
        for r in rows(
            dsn,
            "SELECT trigger_id, created FROM smart_triggerer.trigger_change WHERE trigger_id = ANY(%s) "
            "ORDER BY xid, trigger_id",
            trigger_ids,
        )
    ]


def delete_triggers(dsn: str, trigger_ids: list[int]) -> None:
    rows(
        dsn,
        "UPDATE task_instance SET trigger_id = NULL WHERE trigger_id = ANY(%s); "
        "DELETE FROM trigger WHERE id = ANY(%s) RETURNING id",
        trigger_ids,
        trigger_ids,
    )


@pytest.mark.parametrize("installed_by", ["this version", "the version before"])
def test_one_function_feeds_every_change(env: AirflowConfig, installed_by: str) -> None:
    """Version 11 merged the three feed functions into one; triggers that an instance of the previous
    version installs again at its start (a rolling upgrade) still use the old ones, and feed the same."""
    dsn = env.database_dsn
    load(make_supervisor())
    assert set(feed_functions(dsn).values()) == {"feed_change"}
    if installed_by == "the version before":
        rows(
            dsn,
            "DROP TRIGGER smart_triggerer_feed_created ON trigger; "
            "CREATE TRIGGER smart_triggerer_feed_created AFTER INSERT ON public.trigger "
            "REFERENCING NEW TABLE AS changed_rows FOR EACH STATEMENT "
            "EXECUTE FUNCTION smart_triggerer.feed_created(); "
            "DROP TRIGGER smart_triggerer_feed_deleted ON trigger; "
            "CREATE TRIGGER smart_triggerer_feed_deleted AFTER DELETE ON public.trigger "
            "REFERENCING OLD TABLE AS changed_rows FOR EACH STATEMENT "
            "EXECUTE FUNCTION smart_triggerer.feed_deleted(); SELECT 1",
        )
        assert feed_functions(dsn)["smart_triggerer_feed_created"] == "feed_created"
    ids = sorted(seed(env, 2).trigger_ids)
    delete_triggers(dsn, ids[:1])
    assert changes(dsn, ids) == [(ids[0], True), (ids[1], True), (ids[0], False)]
    with _session() as session:  # the next start of this version re-points them, once
        assert Store(session).ensure_feed() is (installed_by == "the version before")
    with _session() as session:
        assert Store(session).ensure_feed() is False
    assert set(feed_functions(dsn).values()) == {"feed_change"}
