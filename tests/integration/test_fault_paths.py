"""Fault paths an independent review found, each a test that failed before its fix: a refusal
while failing members, errors told apart by SQLSTATE, a migration behind a reader, a slow renewal, a lingering
session of its own, a lock on one task row, a workload that cannot be built, unstartable groups, the
connection limits' reach, and a frozen holder with a result in flight."""

from __future__ import annotations

import datetime as dt
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg2
import pytest
import structlog.testing

from devkit.devstack import AirflowConfig
from tests.helpers.waiting import rows, ti_states, wait_for
from tests.integration.test_supervisor_faults import (
    LATER,
    add_watcher,
    event_entry,
    load,
    make_supervisor,
    runner_of,
    seed,
    watcher_group,
)


@pytest.fixture
def bounded(env: AirflowConfig) -> Iterator[Callable[[float], float]]:
    """What ``service.run`` does (``bound_waits``), for this test only: a call bounds every connection
    of Airflow's engine opened from then on by that lease; removed again at teardown."""
    from airflow import settings
    from sqlalchemy import event

    from smart_triggerer.db.bounded import bound_waits

    listeners: list[Any] = []

    def bound(lease: float) -> float:
        listeners.append(bound_waits(lease))
        return lease

    try:
        yield bound
    finally:
        for listener in listeners:
            if event.contains(settings.engine, "do_connect", listener):  # tests may configure a new engine
                event.remove(settings.engine, "do_connect", listener)
        assert settings.engine is not None
        settings.engine.dispose()


def other_time(hours: int) -> str:
    return (dt.datetime.now(dt.UTC) + dt.timedelta(hours=hours)).isoformat()


def mixed_and_healthy(env: AirflowConfig, supervisor: Any, asset: str) -> tuple[Any, int, Any, int, str]:
    """Two running groups: tasks and an asset watcher on one identity (the mixed group), and tasks alone
    on another (the healthy group, due at the moment returned). Returns each group's seeded tasks and
    runner id."""
    mixed = seed(env, 2)
    other = other_time(3)
    healthy = seed(env, 2, moment=other)
    watcher = add_watcher(asset)
    load(supervisor)
    supervisor.starting.start_groups()
    mixed_runner = watcher_group(supervisor, watcher).runner_id
    healthy_runner = runner_of(supervisor, healthy)
    supervisor.running_triggers.update({mixed_runner, healthy_runner})
    return mixed, mixed_runner, healthy, healthy_runner, other


# --- 1. a refusal while failing members blocks every failure / event behind it --------------------------


def test_a_failure_whose_traceback_jsonb_refuses_never_blocks_later_failures(env: AirflowConfig) -> None:
    """A trigger raised an exception whose message holds a NUL (or an unpaired surrogate): fanout.fail's
    CAST(... AS jsonb) refuses the traceback. Expected (25.6): that group fails with some cause, the next
    failure is handled, the loop says nothing about the database being unavailable."""
    dsn = env.database_dsn
    supervisor = make_supervisor()
    bad = seed(env, 2)
    good = seed(env, 2, moment=other_time(3))
    load(supervisor)
    bad_runner, good_runner = runner_of(supervisor, bad), runner_of(supervisor, good)
    supervisor.failed_triggers.append(
        (bad_runner, ["Traceback (most recent call last):\n", "ValueError: unexpected reply 'ok\x00'\n"])
    )
    supervisor.failed_triggers.append((good_runner, ["ValueError: the warehouse said no\n"]))
    for _ in range(3):  # three loops
        supervisor._db_step("failures", supervisor.handle_failed_triggers)
    print(
        "\nfailed_triggers left:",
        len(supervisor.failed_triggers),
        "| db_ok:",
        supervisor.db_ok,
        "| last_error:",
        supervisor.last_error,
    )
    print("bad group TIs:", ti_states(dsn, bad.dag_id), "| good group TIs:", ti_states(dsn, good.dag_id))
    assert set(ti_states(dsn, good.dag_id).values()) == {"scheduled"}, "the next failure is blocked"
    assert not supervisor.failed_triggers


def test_a_poison_event_whose_cause_jsonb_refuses_never_blocks_other_events(
    env: AirflowConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mixed group (tasks + an asset watcher on one identity); the asset manager raises with the value it
    could not store in its message (a NUL). _poisoned -> _group_failed -> fanout.fail(cause) is refused by
    jsonb, raised out of the except block: handle_events stops, the events stay queued for ever."""
    import airflow.assets.manager

    dsn = env.database_dsn
    supervisor = make_supervisor()
    mixed_tasks, mixed_runner, healthy, healthy_runner, other = mixed_and_healthy(env, supervisor, "mixed")

    class Refusing:
        def register_asset_change(self, **kw: Any) -> None:
            raise ValueError("cannot read the routes file: unexpected byte '\x00' at offset 0")

    monkeypatch.setattr(airflow.assets.manager, "asset_manager", Refusing())
    supervisor.events.append(event_entry(mixed_runner, {"moment": LATER, "idempotency_key": "row-1"}))
    supervisor.events.append(event_entry(healthy_runner, {"moment": other}))
    for _ in range(3):
        supervisor._db_step("events", supervisor.handle_events)
    print(
        "\nevents left:",
        len(supervisor.events),
        "| db_ok:",
        supervisor.db_ok,
        "| last_error:",
        supervisor.last_error,
    )
    print("mixed TIs:", ti_states(dsn, mixed_tasks.dag_id), "| healthy TIs:", ti_states(dsn, healthy.dag_id))
    assert set(ti_states(dsn, healthy.dag_id).values()) == {"scheduled"}, "an unrelated event is blocked"
    assert not supervisor.events


# --- 2. a frozen holder whose result is still being sent ------------------------------------------------

CHILD = r"""
import sys, psycopg2
from smart_triggerer.db.bounded import connect_params
from smart_triggerer.db.store import queries
dsn, job_id, lease = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
conn = psycopg2.connect(dsn, **connect_params(lease))
cur = conn.cursor()
cur.execute("SET statement_timeout = '2s'")  # does not help either: a backend blocked writing to the client
import re
cur.execute(re.sub(r"(?<!:):(\w+)", r"%(\1)s", queries()["fence_shards"]),
            {"job_id": job_id, "shards": [0, 1, 2, 3], "queues": ""})
print("fenced", cur.fetchall(), flush=True)
# any statement after the fence whose result outgrows the socket buffers (lock_deferred of a 2,000-member
# chunk with real next_kwargs, timeout_members of a mass timeout, the ORM path's full TaskInstance rows)
cur.execute("SELECT 'probe-big-result', repeat('x', 400) FROM generate_series(1, 200000)")
print("read", len(cur.fetchall()), flush=True)
conn.commit()
"""


@pytest.mark.alone  # asserts a time bound: runs with no other test beside it (dev.py)
def test_a_frozen_holder_with_a_result_in_flight_is_taken_over_within_lease_plus_3s(
    env: AirflowConfig,
) -> None:
    dsn = env.database_dsn
    lease = 6.0
    holder = make_supervisor(lease_seconds=lease)
    holder_job = holder.job_id
    assert holder.owned == set()
    load(holder)
    assert holder.owned == {0, 1, 2, 3}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, dsn, str(holder_job), str(lease)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    try:
        deadline = time.monotonic() + 30
        while not rows(
            dsn,
            "SELECT 1 FROM pg_stat_activity WHERE state = 'active' "
            "AND query LIKE 'SELECT ''probe-big-result''%%'",
        ):
            assert time.monotonic() < deadline and child.poll() is None, child.communicate()
            time.sleep(0.005)
        child.send_signal(signal.SIGSTOP)  # the host stops while the server is sending the result
        frozen_at = time.monotonic()
        time.sleep(1.0)
        print(
            "\n1 s after SIGSTOP:",
            rows(
                dsn,
                "SELECT state, wait_event FROM pg_stat_activity "
                "WHERE query LIKE 'SELECT ''probe-big-result''%%'",
            ),
        )
        taker = make_supervisor(lease_seconds=lease)
        while time.monotonic() - frozen_at < lease + 6:
            taker._db_step("load", taker.read_changes)
            if taker.owned == {0, 1, 2, 3}:
                break
            time.sleep(0.25)
        took = time.monotonic() - frozen_at
        backend = rows(
            dsn,
            "SELECT state, wait_event_type, wait_event, now() - state_change "
            "FROM pg_stat_activity WHERE query LIKE 'SELECT ''probe-big-result''%%'",
        )
        print(f"\nafter {took:.1f}s: taker owns {sorted(taker.owned)}; frozen backend: {backend}")
        assert taker.owned == {0, 1, 2, 3} and took <= lease + 3
    finally:
        child.send_signal(signal.SIGCONT)
        child.kill()
        child.wait()


# --- 3. a pending migration queues every instance's renewal behind it -----------------------------------


def test_a_migration_behind_a_reader_never_makes_running_instances_drop_shards(
    env: AirflowConfig, bounded: Callable[[float], float], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new release starts (its migration alters smart_triggerer.instance, as 0008 does) while something
    holds an ordinary read lock on that table (pg_dump, a long status/BI query, an old-release instance
    stopped inside a transaction). Its ALTER waited up to 60 s, and every running instance's heartbeat
    queued behind it. Now each try waits 0.5 s and the start tries again for a minute (register()): the
    running instance renews meanwhile, and the new release migrates once the reader is gone."""
    from structlog.testing import capture_logs

    import smart_triggerer.db.store as store_module

    dsn = env.database_dsn
    lease = bounded(4.0)
    running = make_supervisor(lease_seconds=lease)
    seeded = seed(env, 3)
    load(running)
    assert running.owned == {0, 1, 2, 3} and set(seeded.trigger_ids) <= set(running.member_info)

    reader = psycopg2.connect(dsn)
    reader.cursor().execute("SELECT count(*) FROM smart_triggerer.instance")  # AccessShareLock, kept
    shipped = store_module.migrations()
    monkeypatch.setattr(
        store_module,
        "migrations",
        lambda: [
            *shipped,
            (99, "next_release", "ALTER TABLE smart_triggerer.instance ADD COLUMN probe integer"),
        ],
    )
    outcome: list[str] = []

    def new_release_starts() -> None:
        try:
            make_supervisor(lease_seconds=lease)  # register(): migrate, retried while the schema is busy
            outcome.append("migrated")
        except Exception as err:
            outcome.append(f"{type(err).__name__}: {err}")

    starter = threading.Thread(target=new_release_starts)
    starter.start()
    try:
        alter = "ALTER TABLE smart_triggerer.instance ADD COLUMN probe%"
        wait_for(
            lambda: rows(
                dsn,
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE %s",
                alter,
            ),
            lambda found: found[0][0] > 0,
            30,
            "the new release's ALTER to queue behind the reader",
            interval=0.02,
        )
        running.leases.last_renewal -= (
            lease * 0.65
        )  # one ordinary slow loop later the running instance renews
        with capture_logs() as logs:
            running.leases.guard()
        stopped = [e for e in logs if "stopping all shards" in e["event"]]
        print(
            f"\nrunning instance owns {sorted(running.owned)}, {len(running.member_info)} waiters; "
            f"log: {stopped}"
        )
        assert running.owned == {0, 1, 2, 3}, "a pending migration made a healthy instance drop every shard"
        assert not outcome, "the new release gave up while the reader was there"
    finally:
        reader.rollback()
        reader.close()
        starter.join(70)
    print("new release's migration:", outcome)
    assert outcome == ["migrated"]
    assert rows(
        dsn,
        "SELECT count(*) FROM information_schema.columns WHERE table_schema = 'smart_triggerer' "
        "AND table_name = 'instance' AND column_name = 'probe'",
    ) == [(1,)]


# --- 4. idle_in_transaction_session_timeout on Airflow's own transactions -------------------------------


def test_a_slow_workload_build_still_starts_the_group(
    env: AirflowConfig, bounded: Callable[[float], float], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Airflow's build_trigger_workloads keeps one transaction open while it deserializes each DAG. A DAG
    whose deserialization takes longer than half a lease on this host (a big DAG, a busy host) gets the
    session killed, every loop, deterministically: the group never starts and the log says 'database
    unavailable'."""
    from airflow.serialization.serialized_objects import DagSerialization

    lease = bounded(3.0)
    supervisor = make_supervisor(lease_seconds=lease)
    seeded = seed(env, 2)
    load(supervisor)
    original = DagSerialization.from_dict.__func__  # type: ignore[attr-defined]

    def slow(cls: Any, data: dict[str, Any]) -> Any:
        time.sleep(lease / 2 + 0.3)  # stands for deserializing a large DAG on a loaded host
        return original(cls, data)

    monkeypatch.setattr(DagSerialization, "from_dict", classmethod(slow))
    for _ in range(3):
        supervisor._db_step("load", supervisor.load_triggers)
    print(
        f"\ncreating: {[w.id for w in supervisor.creating_triggers]}; db_ok={supervisor.db_ok}; "
        f"last_error={supervisor.last_error}"
    )
    assert {w.id for w in supervisor.creating_triggers} & set(seeded.trigger_ids)


@pytest.mark.parametrize("builder", ["one statement per batch", "airflow's"])
def test_a_workload_build_frozen_while_it_thinks_holds_no_lock(
    env: AirflowConfig, bounded: Callable[[float], float], monkeypatch: pytest.MonkeyPatch, builder: str
) -> None:
    """A host frozen while it deserializes a DAG for a workload (between two statements of the build):
    its session must hold no lock on ``trigger`` or ``task_instance`` meanwhile (a migration's ALTER, and
    every statement behind it, would queue behind the share lock of a transaction left open) and must not
    be idle inside a transaction. Checked from another session while the build is stopped there."""
    from airflow.serialization.serialized_objects import DagSerialization

    from smart_triggerer.supervisor import runner_comms

    dsn = env.database_dsn
    lease = bounded(4.0)
    supervisor = make_supervisor(lease_seconds=lease)
    seed(env, 2)
    load(supervisor)
    if builder == "airflow's":
        monkeypatch.setattr(runner_comms, "log_renderer", lambda: None)
    original = DagSerialization.from_dict.__func__  # type: ignore[attr-defined]
    frozen, thawed = threading.Event(), threading.Event()

    def frozen_there(cls: Any, data: dict[str, Any]) -> Any:
        frozen.set()
        thawed.wait(60)  # stands for a host stopped while it deserializes
        return original(cls, data)

    monkeypatch.setattr(DagSerialization, "from_dict", classmethod(frozen_there))
    build = threading.Thread(target=supervisor._db_step, args=("load", supervisor.load_triggers))
    build.start()
    try:
        assert frozen.wait(60), "the build never reached a DAG to deserialize"
        ours = (
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        held = rows(
            dsn,
            f"SELECT c.relname, l.mode FROM pg_locks l JOIN pg_class c ON c.oid = l.relation "
            f"WHERE l.pid IN ({ours}) AND c.relname IN ('trigger', 'task_instance')",
        )
        idle_in_transaction = rows(
            dsn,
            f"SELECT count(*) FROM pg_stat_activity WHERE pid IN ({ours}) "
            "AND starts_with(state, 'idle in transaction')",
        )
        alter_waits = rows(
            dsn,
            "SET lock_timeout = '500ms'; "
            "LOCK TABLE task_instance, trigger IN ACCESS EXCLUSIVE MODE; SELECT 1",
        )
    finally:
        thawed.set()
        build.join(60)
    print(f"\nwhile frozen: locks {held}, idle in transaction {idle_in_transaction}")
    assert held == [] and idle_in_transaction == [(0,)] and alter_waits == [(1,)]
    assert supervisor.creating_triggers, "the build went on once the host thawed"


def test_the_connection_limits_reach_airflows_engine_only(
    env: AirflowConfig, bounded: Callable[[float], float]
) -> None:
    """bound_waits listens on the Engine class: a trigger's or hook's own SQLAlchemy engine (to a user's
    warehouse) in this process, and in the forked runner subprocess, gets the lease's limits too."""
    from sqlalchemy import create_engine, text

    user_db = create_engine(env.database_dsn.replace("postgresql://", "postgresql+psycopg2://", 1))
    with user_db.connect() as conn:
        got = {
            name: conn.execute(text(f"SHOW {name}")).scalar()
            for name in ("lock_timeout", "idle_in_transaction_session_timeout")
        }
    user_db.dispose()
    print("\na user's engine in the triggerer process:", got)
    assert got == {"lock_timeout": "0", "idle_in_transaction_session_timeout": "0"}


# --- 5. a lock held on one task row --------------------------------------------------------------------


def test_one_locked_task_row_holds_back_only_its_own_event(
    env: AirflowConfig, bounded: Callable[[float], float]
) -> None:
    """lock_deferred waits lease/4 on a row another transaction holds, which is an 'outage': the whole
    events step stops and the next loop retries the same chunk first."""
    dsn = env.database_dsn
    bounded(4.0)
    supervisor = make_supervisor(lease_seconds=4.0, max_resumes_per_transaction=2)
    locked = seed(env, 2)
    other = other_time(3)
    free = seed(env, 2, moment=other)
    load(supervisor)
    locked_runner, free_runner = runner_of(supervisor, locked), runner_of(supervisor, free)
    holder = psycopg2.connect(dsn)
    try:
        holder.cursor().execute("SELECT 1 FROM task_instance WHERE id = %s FOR UPDATE", (locked.ti_ids[0],))
        supervisor.events.append(event_entry(locked_runner, {"moment": LATER}))
        supervisor.events.append(event_entry(free_runner, {"moment": other}))
        for _ in range(3):
            supervisor._db_step("events", supervisor.handle_events)
        print(
            "\nevents left:",
            len(supervisor.events),
            "| last_error:",
            supervisor.last_error,
            "| free TIs:",
            ti_states(dsn, free.dag_id),
        )
        assert set(ti_states(dsn, free.dag_id).values()) == {"scheduled"}
    finally:
        holder.close()


# --- 6. a non-database exception building one workload ------------------------------------------------


def test_a_workload_that_cannot_be_built_never_kills_the_instance(
    env: AirflowConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A DAG that cannot be deserialized on the triggerer host (a timetable or class not installed there):
    the exception left load_triggers, _db_step did not catch it, run_once ended, the instance exited; the
    shard's next owner built the same workload. Now that row cannot lead here, and the others start."""
    from airflow.serialization.serialized_objects import DagSerialization

    supervisor = make_supervisor()
    broken = seed(env, 2)
    fine = seed(env, 1, moment=other_time(4))
    load(supervisor)
    original = DagSerialization.from_dict.__func__  # type: ignore[attr-defined]

    def failing(cls: Any, data: dict[str, Any]) -> Any:
        if data["dag"]["dag_id"] == broken.dag_id:
            raise ImportError("timetable 'plugins.BusinessDays' is not registered")
        return original(cls, data)

    monkeypatch.setattr(DagSerialization, "from_dict", classmethod(failing))
    try:
        with structlog.testing.capture_logs() as logs:
            supervisor._db_step("load", supervisor.load_triggers)
        escaped = None
    except Exception as err:
        escaped = f"{type(err).__name__}: {err}"
    print("\nescaped _db_step:", escaped)
    assert escaped is None
    started = {w.id for w in supervisor.creating_triggers}
    assert set(fine.trigger_ids) <= started and not started & set(broken.trigger_ids)
    cannot = [e for e in logs if e["event"] == "a trigger's workload cannot be built on this host"]
    assert {e["trigger_id"] for e in cannot} <= set(broken.trigger_ids) and cannot
    assert "BusinessDays" in cannot[0]["error"]


# --- 7. a deterministic refusal psycopg2 files under OperationalError ----------------------------------


def test_an_idempotency_key_too_big_for_its_index_is_no_outage(env: AirflowConfig) -> None:
    """asset_event_key's primary key is a btree over (asset_id, idempotency_key): a key over ~2.7 kB
    (incompressible) is refused with SQLSTATE 54000 (program_limit_exceeded), which psycopg2 maps to
    OperationalError -> is_outage() -> the event is kept and retried every loop, ahead of every other."""
    import secrets

    dsn = env.database_dsn
    supervisor = make_supervisor()
    other = other_time(3)
    healthy = seed(env, 2, moment=other)
    watcher = add_watcher("long-keys")
    load(supervisor)
    supervisor.starting.start_groups()
    watcher_runner = watcher_group(supervisor, watcher).runner_id
    healthy_runner = runner_of(supervisor, healthy)
    supervisor.running_triggers.update({watcher_runner, healthy_runner})
    supervisor.events.append(
        event_entry(watcher_runner, {"moment": LATER, "idempotency_key": secrets.token_hex(2000)})
    )
    supervisor.events.append(event_entry(healthy_runner, {"moment": other}))
    for _ in range(3):
        supervisor._db_step("events", supervisor.handle_events)
    print(
        "\nevents left:",
        len(supervisor.events),
        "| last_error:",
        supervisor.last_error,
        "| healthy TIs:",
        ti_states(dsn, healthy.dag_id),
    )
    assert set(ti_states(dsn, healthy.dag_id).values()) == {"scheduled"}


# --- 8. groups no member can start stay at the head of `unstarted` -------------------------------------


def test_unstartable_groups_never_starve_later_groups(env: AirflowConfig) -> None:
    """_create_workload returns None for a task instance without dag_version_id (deferred before a 2->3
    upgrade): every member becomes unstartable, Groups.start returns None and leaves the group in
    `unstarted`, where it keeps one of the max_new_per_loop slots for ever."""
    dsn = env.database_dsn
    supervisor = make_supervisor(max_new_per_loop=2)
    stuck = [seed(env, 1, moment=other_time(10 + k)) for k in range(2)]
    for s in stuck:
        rows(dsn, "UPDATE task_instance SET dag_version_id = NULL WHERE dag_id = %s RETURNING 1", s.dag_id)
    load(supervisor)
    for _ in range(2):
        supervisor.groups.version += 1
        supervisor.starting.start_groups()
    later = seed(env, 1, moment=other_time(20))  # a task that defers afterwards
    load(supervisor)
    for _ in range(4):
        supervisor.groups.version += 1  # as if something changed every loop
        supervisor.starting.start_groups()
    started = {w.id for w in supervisor.creating_triggers}
    print(
        "\nstarted:",
        started,
        "| later group's trigger:",
        later.trigger_ids,
        "| unstarted:",
        len(supervisor.groups.unstarted),
    )
    assert set(later.trigger_ids) <= started


# --- 9. its own lease row still share-locked by its own lingering backend ------------------------------


def test_a_lingering_session_of_its_own_never_makes_it_drop_valid_shards(env: AirflowConfig) -> None:
    """After a network blip the client gave up on its fenced transaction, but the server's backend still
    holds the FOR SHARE on the lease rows until its own timeouts fire (up to half a lease). The next
    renewal SKIPs LOCKED its own, still valid, rows and hands the shards over to nobody: every group of
    them is dropped (every coroutine restarted a loop later)."""
    import re

    from smart_triggerer.db.store import queries

    dsn = env.database_dsn
    supervisor = make_supervisor()
    seeded = seed(env, 4, moment=other_time(5))
    load(supervisor)
    before = set(supervisor.member_info)
    lingering = psycopg2.connect(dsn)  # stands for the backend of the transaction the client gave up on
    try:
        lingering.cursor().execute(
            re.sub(r"(?<!:):(\w+)", r"%(\1)s", queries()["fence_shards"]),
            {"job_id": supervisor.job_id, "shards": [0, 1, 2, 3], "queues": ""},
        )
        supervisor._db_step("load", supervisor.read_changes)
        valid = rows(
            dsn,
            "SELECT count(*) FROM smart_triggerer.shard_lease WHERE owner_job_id = %s "
            "AND expires_at > clock_timestamp()",
            supervisor.job_id,
        )[0][0]
        print(
            f"\nowned after renewal: {sorted(supervisor.owned)}; "
            f"leases still valid in the database: {valid}; "
            f"waiters kept: {len(set(supervisor.member_info) & before)}/{len(before)}"
        )
        assert set(seeded.trigger_ids) <= set(supervisor.member_info)
    finally:
        lingering.close()


# --- 10. a renewal that succeeds slowly -----------------------------------------------------------------


def test_a_slow_but_successful_renewal_keeps_the_shards(
    env: AirflowConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 25.11 on a busy host: the overdue renewal itself takes longer than 0.6 of a lease (the process
    is descheduled, the database is slow) and succeeds. last_renewal is the time it *started*, so the check
    right after it still finds it overdue and stops every shard, with whatever last_error was."""
    from structlog.testing import capture_logs

    from smart_triggerer.db.store import Store

    supervisor = make_supervisor()
    seeded = seed(env, 3)
    load(supervisor)
    lease = supervisor.settings.lease_seconds
    original = Store.live_candidates

    def slow(self: Any, *args: Any, **kwargs: Any) -> Any:
        time.sleep(lease * 0.62)
        return original(self, *args, **kwargs)

    time.sleep(lease * 0.62)  # the slow loop
    monkeypatch.setattr(Store, "live_candidates", slow)
    with capture_logs() as logs:
        supervisor.leases.guard()
    stopped = [e for e in logs if "stopping all shards" in e["event"]]
    print(f"\nowned: {sorted(supervisor.owned)}; log: {stopped}")
    assert set(seeded.trigger_ids) <= set(supervisor.member_info) and not stopped


# --- 11. the second review: what is the event's fault, and what is the database's -----------------------


def set_read_only(dsn: str, on: bool) -> None:
    """The database refuses every writer from the next session on (SQLSTATE 25006), as a primary demoted
    by a failover does behind a stale DNS name; Airflow's pool is emptied so its next session sees it."""
    from airflow import settings

    conn = psycopg2.connect(dsn, options="-c default_transaction_read_only=off")  # ours may still write
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute("SELECT current_database()")
        name = cur.fetchone()[0]
        value = "on" if on else "off"
        cur.execute(f'ALTER DATABASE "{name}" SET default_transaction_read_only = {value}')
    conn.close()
    assert settings.engine is not None
    settings.engine.dispose()


def failed_with(dsn: str, dag_id: str) -> dict[int, str | None]:
    """map index -> the failure's text for task instances failed through the __fail__ path."""
    found = rows(
        dsn,
        "SELECT map_index, next_kwargs::text FROM task_instance "
        "WHERE dag_id = %s AND next_method = '__fail__'",
        dag_id,
    )
    return {r[0]: r[1] for r in found}


def test_a_database_refusing_every_writer_keeps_every_event_and_failure_and_fails_no_task(
    env: AirflowConfig,
) -> None:
    """Read-only (25006) is no event's fault: the events were taken one by one as poison, their tasks'
    failure refused too, and the groups ended with every member forgotten, left deferred with no
    coroutine. Every event and failure must stay queued, its group kept, and be stored once writable."""
    dsn = env.database_dsn
    supervisor = make_supervisor()
    first, second = seed(env, 2), seed(env, 2, moment=other_time(3))
    broken = seed(env, 2, moment=other_time(4))
    load(supervisor)
    r1, r2, r3 = (runner_of(supervisor, s) for s in (first, second, broken))
    supervisor.running_triggers.update({r1, r2, r3})
    supervisor.events.append(event_entry(r1, {"moment": LATER}))
    supervisor.events.append(event_entry(r2, {"moment": other_time(3)}))
    supervisor.failed_triggers.append((r3, ["ValueError: the warehouse said no\n"]))
    set_read_only(dsn, True)
    supervisor.leases.last_renewal = (
        time.monotonic()
    )  # renewed by load(): no renewal falls due in the loops below
    try:
        for _ in range(2):
            supervisor._db_step("events", supervisor.handle_events)
            supervisor._db_step("failures", supervisor.handle_failed_triggers)
        print("\nlast error while read-only:", supervisor.last_error)
        assert [e.trigger_id for e in supervisor.events] == [r1, r2]
        assert [f[0] for f in supervisor.failed_triggers] == [r3]
        for seeded in (first, second, broken):
            assert set(ti_states(dsn, seeded.dag_id).values()) == {"deferred"}
            assert supervisor.groups.by_runner(runner_of(supervisor, seeded)) is not None
    finally:
        set_read_only(dsn, False)
    supervisor._db_step("events", supervisor.handle_events)
    supervisor._db_step("failures", supervisor.handle_failed_triggers)
    assert (
        set(ti_states(dsn, first.dag_id).values())
        == set(ti_states(dsn, second.dag_id).values())
        == {"scheduled"}
    )
    assert not failed_with(dsn, first.dag_id) and not failed_with(dsn, second.dag_id)
    assert all("the warehouse said no" in (text or "") for text in failed_with(dsn, broken.dag_id).values())
    assert len(failed_with(dsn, broken.dag_id)) == 2


def test_events_put_off_for_a_lock_survive_a_refusal_of_every_writer_behind_them(
    env: AirflowConfig, bounded: Callable[[float], float], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One by one, the first event meets a row lock (kept for the next loop in a local list) and the
    second finds the database refusing every writer: raising out of the loop lost the list, so the first
    event was neither stored, queued nor acknowledged."""
    from smart_triggerer.supervisor.events import EventFanout

    dsn = env.database_dsn
    supervisor = make_supervisor(lease_seconds=8.0)
    locked, free = seed(env, 2), seed(env, 2, moment=other_time(3))
    load(supervisor)
    locked_runner, free_runner = runner_of(supervisor, locked), runner_of(supervisor, free)
    supervisor.running_triggers.update({locked_runner, free_runner})
    original = EventFanout._store_events

    def store(self: Any, entries: Any) -> None:
        try:
            original(self, entries)
        except Exception:
            if [e.trigger_id for e in entries] == [locked_runner]:
                set_read_only(dsn, True)  # right after the lock timeout: the next event meets it
            raise

    monkeypatch.setattr(EventFanout, "_store_events", store)
    # lock waits of 0.5 s (a lease of 2 s bounds the connections opened from here) under a lease of 8 s,
    # renewed by load() just now: the chunk's and then the event's lock wait end long before the leases
    # fall due for renewal (4.8 s). With lease and bound equal (4 s: two waits of 1 s against renewal at
    # 2.4 s, after the shards' read), a slow host reached the renewal, which met the read-only database and
    # stopped every shard (right: nothing is stored without a lease), so the second event was left for the
    # shard's next owner instead of meeting the refusal this test is about
    bounded(2.0)
    supervisor.leases.last_renewal = time.monotonic()
    holder = psycopg2.connect(dsn)
    try:
        holder.cursor().execute("SELECT 1 FROM task_instance WHERE id = %s FOR UPDATE", (locked.ti_ids[0],))
        supervisor.events.append(event_entry(locked_runner, {"moment": LATER}))
        supervisor.events.append(event_entry(free_runner, {"moment": other_time(3)}))
        supervisor._db_step("events", supervisor.handle_events)
        queued = [e.trigger_id for e in supervisor.events]
        print("\nqueued after the loop:", queued, "| last error:", supervisor.last_error)
        assert supervisor.owned, "the leases were dropped (a renewal met the read-only database)"
        assert "read-only" in (supervisor.last_error or "")
        assert sorted(queued) == sorted([locked_runner, free_runner])
    finally:
        holder.close()
        set_read_only(dsn, False)
    monkeypatch.setattr(EventFanout, "_store_events", original)
    supervisor._db_step("events", supervisor.handle_events)
    assert (
        set(ti_states(dsn, locked.dag_id).values())
        == set(ti_states(dsn, free.dag_id).values())
        == {"scheduled"}
    )


def test_an_event_whose_listener_outlasts_the_idle_limit_fails_alone_and_the_rest_flow(
    env: AirflowConfig, bounded: Callable[[float], float], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A listener slower than half a lease: the server ends the event's transaction (idle in transaction),
    the loop took it for an outage and kept retrying the same head chunk for ever, everything behind it
    stuck. Now the database is asked right after: it answers, so the events are stored one by one; the
    slow one, losing its session three times in a row, fails its own tasks; the others are resumed."""
    import airflow.assets.manager

    dsn = env.database_dsn
    lease = bounded(3.0)
    supervisor = make_supervisor(lease_seconds=lease)
    slow_tasks, slow_runner, healthy, healthy_runner, other = mixed_and_healthy(
        env, supervisor, "slow-listener"
    )

    class Slow:
        def register_asset_change(self, **kw: Any) -> None:
            time.sleep(lease / 2 + 0.5)  # a listener that calls a slow service inside the transaction

    monkeypatch.setattr(airflow.assets.manager, "asset_manager", Slow())
    supervisor.events.append(event_entry(slow_runner, {"moment": LATER, "idempotency_key": "row-1"}))
    supervisor.events.append(event_entry(healthy_runner, {"moment": other}))
    supervisor._db_step("events", supervisor.handle_events)
    assert set(ti_states(dsn, healthy.dag_id).values()) == {"scheduled"}, "an unrelated event is stuck"
    for _ in range(3):
        if not supervisor.events:
            break
        supervisor._db_step("events", supervisor.handle_events)
    print("\nevents left:", len(supervisor.events), "| failed:", failed_with(dsn, slow_tasks.dag_id))
    assert not supervisor.events
    assert len(failed_with(dsn, slow_tasks.dag_id)) == 2
    assert all("ended its transaction" in (t or "") for t in failed_with(dsn, slow_tasks.dag_id).values())


def test_a_row_whose_workload_the_database_refuses_never_blocks_other_groups(
    env: AirflowConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A deterministic database error building one row's workload (here a real DataError in the build's
    transaction) was re-raised like an outage: the load step failed on it every loop and no group started
    on that instance again. The batch's one statement refused (workloads.py) is read again row by row,
    where the row is named."""
    from airflow.jobs.triggerer_job_runner import TriggerRunnerSupervisor
    from sqlalchemy import text

    from smart_triggerer.supervisor import runner_comms

    supervisor = make_supervisor()
    bad = seed(env, 1)
    good = seed(env, 2, moment=other_time(3))
    load(supervisor)
    original = TriggerRunnerSupervisor._create_workload

    def refusing(self: Any, trigger: Any, dag_bag: Any, render_log_fname: Any, session: Any) -> Any:
        if trigger.id in bad.trigger_ids:
            session.execute(text("SELECT CAST('not a number' AS integer)"))  # 22P02, aborts the build
        return original(self, trigger, dag_bag, render_log_fname, session)

    monkeypatch.setattr(TriggerRunnerSupervisor, "_create_workload", refusing)
    read_in_one = runner_comms.task_rows  # type: ignore[attr-defined]  # the name the build looks it up by

    def refusing_the_batch(session: Any, trigger_ids: Any) -> Any:
        if set(trigger_ids) & set(bad.trigger_ids):  # the batch's one statement, refused by that row
            session.execute(text("SELECT CAST('not a number' AS integer)"))
        return read_in_one(session, trigger_ids)

    monkeypatch.setattr(runner_comms, "task_rows", refusing_the_batch)
    for _ in range(2):
        supervisor._db_step("load", supervisor.load_triggers)
    started = {w.id for w in supervisor.creating_triggers}
    print("\nstarted:", started, "| last error:", supervisor.last_error)
    assert started & set(good.trigger_ids)
    assert not started & set(bad.trigger_ids)


def test_a_handover_while_a_session_of_its_own_locks_its_leases_keeps_the_renewal(
    env: AirflowConfig, bounded: Callable[[float], float]
) -> None:
    """A peer joins while a session of this instance that lost its client still share-locks its lease rows:
    releasing the peer's share waited lock_timeout on them and aborted the whole renewal (every loop until
    that session died: past 0.6 of a lease every shard was dropped). The release skips them instead."""
    import re

    from smart_triggerer.db.store import queries

    dsn = env.database_dsn
    lease = bounded(6.0)
    first = make_supervisor(lease_seconds=lease)
    # Identities until every shard holds one: whichever shards the peer takes, the first keeps a wait
    # (with a fixed eight, all of them missed the two shards it keeps in one run in 256).
    waits: list[int] = []
    for k in range(64):
        waits += seed(env, 1, moment=other_time(5 + k)).trigger_ids
        load(first)
        if {first.shared.shard_of(t) for t in waits} == {0, 1, 2, 3}:
            break
    assert {first.shared.shard_of(t) for t in waits} == {0, 1, 2, 3}, "64 identities missed a shard"
    assert first.owned == {0, 1, 2, 3}
    lingering = psycopg2.connect(dsn)
    try:
        lingering.cursor().execute(
            re.sub(r"(?<!:):(\w+)", r"%(\1)s", queries()["fence_shards"]),
            {"job_id": first.job_id, "shards": [0, 1, 2, 3], "queues": ""},
        )
        make_supervisor(lease_seconds=lease)  # a peer joins: rendezvous gives it a share
        first.failed_step = None
        first._db_step("load", first.read_changes)
        print(f"\nowned after the renewal: {sorted(first.owned)}; failed step: {first.failed_step}")
        assert first.failed_step is None, "the renewal failed"
        assert first.owned and first.owned < {0, 1, 2, 3}
        kept = {t for t in waits if first.shared.shard_of(t) in first.owned}
        assert kept and kept <= set(first.member_info)
    finally:
        lingering.close()


def test_sessions_ended_from_outside_again_and_again_fail_no_event(
    env: AirflowConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chaos run's db_error fault (every session of the instance terminated again and again for a
    second) failed two innocent tasks: each attempt lost its session at once while a fresh connection
    still answered, which was counted as the event's own slow listener three times. Only an attempt that
    sat as long as the idle limit counts: these stay queued and are stored once the sessions live on."""
    from sqlalchemy import text

    from smart_triggerer.supervisor import fanout

    dsn = env.database_dsn
    supervisor = make_supervisor()
    seeded = seed(env, 2)
    load(supervisor)
    runner = runner_of(supervisor, seeded)
    supervisor.running_triggers.add(runner)
    ended: list[Any]
    original, ended = fanout.resume, []

    def ended_from_outside(session: Any, batches: Any) -> Any:
        if len(ended) < 6:  # each loop: the chunk, then the event alone (three strikes on the old code)
            pid = session.execute(text("SELECT pg_backend_pid()")).scalar()
            rows(dsn, "SELECT pg_terminate_backend(%s)", pid)
            ended.append(pid)
        return original(session, batches)

    monkeypatch.setattr(fanout, "resume", ended_from_outside)
    supervisor.events.append(event_entry(runner, {"moment": LATER}))
    for _ in range(3):
        supervisor._db_step("events", supervisor.handle_events)
    print(
        "\nsessions ended:",
        len(ended),
        "| queued:",
        len(supervisor.events),
        "| failed:",
        failed_with(dsn, seeded.dag_id),
        "| last error:",
        supervisor.last_error,
    )
    assert len(ended) == 6
    assert not failed_with(dsn, seeded.dag_id)
    assert [e.trigger_id for e in supervisor.events] == [runner]
    supervisor._db_step("events", supervisor.handle_events)
    assert set(ti_states(dsn, seeded.dag_id).values()) == {"scheduled"}
    assert not supervisor.events
