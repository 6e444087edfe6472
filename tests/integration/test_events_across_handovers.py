"""Events held for young members (``resume_hold_seconds``) live in the database, not only in memory.

An event for a member that deferred too recently is acknowledged to the runner and its coroutine ends: a
graceful stop, a handover or a crash during the hold must neither lose it nor make the trigger fire again,
and a member whose event came before its ``trigger_timeout`` is not failed as a time-out while held. A
shard that comes back while it drains keeps every waiter.
Driven step by step in this process against a real PostgreSQL (the test plays the runner).
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

from devkit.devstack import AirflowConfig
from tests.helpers.seeding import seed_deferred
from tests.helpers.waiting import rows, ti_states, wait_for
from tests.integration.test_supervisor_faults import (
    AT_TIME,
    LATER,
    event_entry,
    load,
    make_supervisor,
    runner_of,
)


def held_rows(dsn: str) -> dict[int, Any]:
    found = rows(dsn, "SELECT trigger_id, event FROM smart_triggerer.held_event")
    return {trigger_id: json.loads(event) for trigger_id, event in found}


def next_kwargs_of(dsn: str, dag_id: str) -> list[Any]:
    found = rows(dsn, "SELECT next_method, next_kwargs FROM task_instance WHERE dag_id = %s", dag_id)
    return [(method, json.loads(kw) if isinstance(kw, str) else kw) for method, kw in found]


def event_of(next_kwargs: Any) -> Any:
    from airflow.models.trigger import _decode_next_kwargs

    return _decode_next_kwargs(next_kwargs)["event"]


def test_an_event_held_through_a_graceful_stop_resumes_its_tasks_once_on_the_next_owner(
    env: AirflowConfig,
) -> None:
    dsn = env.database_dsn
    leaving = make_supervisor(resume_hold_seconds=3.0)
    seeded = seed_deferred(
        dsn, env.dags_folder, count=2, classpath=AT_TIME, kwargs_for=lambda i: {"moment": LATER}
    )
    load(leaving)
    runner = runner_of(leaving, seeded)
    leaving.events.append(event_entry(runner, {"fired": "once"}, seq=11))
    leaving.handle_events()
    assert set(leaving.held) == set(seeded.trigger_ids)
    assert list(leaving.persisted_event_seqs) == [11]  # acknowledged: the runner and its source move on
    assert set(held_rows(dsn)) == set(seeded.trigger_ids)
    leaving.release_all()  # SIGTERM during the hold

    taker = make_supervisor(resume_hold_seconds=3.0)
    load(taker)
    assert set(taker.held) == set(seeded.trigger_ids)
    assert not taker.groups.runners, "the trigger must not be started (and fire) again"
    assert set(ti_states(dsn, seeded.dag_id).values()) == {"deferred"}  # still within the hold

    def released() -> bool:
        taker.release_held()
        return set(ti_states(dsn, seeded.dag_id).values()) == {"scheduled"}

    wait_for(released, bool, timeout=15, what="the held event resumed by the next owner")
    for method, kwargs in next_kwargs_of(dsn, seeded.dag_id):
        assert method == "execute_complete"
        assert event_of(kwargs) == {"fired": "once"}
    assert held_rows(dsn) == {}
    assert not taker.held


def test_a_held_event_moves_with_its_shard_when_a_peer_joins(env: AirflowConfig) -> None:
    """A join hands shards over during the hold: the shard's new owner resumes from the stored event."""
    dsn = env.database_dsn
    first = make_supervisor(resume_hold_seconds=2.0)
    seeded = seed_deferred(
        dsn, env.dags_folder, count=40, classpath=AT_TIME, kwargs_for=lambda i: {"moment": f"{LATER}#{i}"}
    )
    load(first)
    for trigger_id in seeded.trigger_ids:
        group = first.groups.by_hash[first.groups.hash_of_member[trigger_id]]
        first.groups.start(group)
        first.events.append(event_entry(trigger_id, {"n": trigger_id}))
    first.handle_events()
    assert set(first.held) == set(seeded.trigger_ids)

    second = make_supervisor(resume_hold_seconds=2.0)

    def shared() -> bool:
        for supervisor in (first, second):
            load(supervisor)
        return bool(first.owned) and bool(second.owned) and not first.owned & second.owned

    wait_for(shared, bool, timeout=30, what="the shards split between the two")
    moved = {t for t in seeded.trigger_ids if t not in first.held}
    assert moved and set(second.held) == moved, "the held events of the shards handed over"
    assert not first.groups.runners and not second.groups.runners

    def all_resumed() -> bool:
        first.release_held()
        second.release_held()
        return set(ti_states(dsn, seeded.dag_id).values()) == {"scheduled"}

    wait_for(all_resumed, bool, timeout=20, what="every held event resumed once, by the shard's owner")
    resumed_with = {
        ti: event_of(kw)
        for ti, kw in rows(
            dsn, "SELECT ti.id, ti.next_kwargs FROM task_instance ti WHERE ti.dag_id = %s", seeded.dag_id
        )
    }
    expected = dict(zip(seeded.ti_ids, ({"n": t} for t in seeded.trigger_ids), strict=True))
    assert {str(k): v for k, v in resumed_with.items()} == {str(k): v for k, v in expected.items()}


def test_an_event_that_came_before_the_timeout_is_not_failed_as_a_timeout_while_held(
    env: AirflowConfig,
) -> None:
    """Held for 30 s, but the task's trigger_timeout is 4 s away: released a second before the deadline,
    before the scheduler's and our own time-out checks fail it (Airflow's own check is run here too)."""
    from airflow.jobs.job import Job
    from airflow.jobs.scheduler_job_runner import SchedulerJobRunner

    dsn = env.database_dsn
    supervisor = make_supervisor(resume_hold_seconds=30.0)
    seeded = seed_deferred(
        dsn,
        env.dags_folder,
        count=1,
        classpath=AT_TIME,
        kwargs_for=lambda i: {"moment": LATER},
        trigger_timeout=dt.timedelta(seconds=4),
    )
    load(supervisor)
    runner = runner_of(supervisor, seeded)
    supervisor.events.append(event_entry(runner, {"in": "time"}))
    supervisor.handle_events()
    assert set(supervisor.held) == set(seeded.trigger_ids)
    scheduler = SchedulerJobRunner(job=Job())

    def left_deferred() -> bool:
        supervisor.deadlines.timeout_members()
        scheduler.check_trigger_timeouts()
        supervisor.release_held()
        return set(ti_states(dsn, seeded.dag_id).values()) != {"deferred"}

    wait_for(left_deferred, bool, timeout=15, what="the held task resumed (or timed out)")
    [(method, kwargs)] = next_kwargs_of(dsn, seeded.dag_id)
    assert method == "execute_complete", (method, kwargs)
    assert "error" not in kwargs


def test_a_handover_stores_the_event_a_coroutine_sent_before_it_ended(env: AirflowConfig) -> None:
    """A peer joins and takes a shard whose coroutine is running: the leaving instance keeps the lease
    until the runner says the coroutine ended, and the event it sent meanwhile (one its source hands out
    once) resumes the task; only then is the shard released to the joiner."""
    dsn = env.database_dsn
    first = make_supervisor()
    seeded = seed_deferred(
        dsn, env.dags_folder, count=40, classpath=AT_TIME, kwargs_for=lambda i: {"moment": f"{LATER}#{i}"}
    )
    load(first)
    for trigger_id in seeded.trigger_ids:
        first.groups.start(first.groups.by_hash[first.groups.hash_of_member[trigger_id]])
        first.running_triggers.add(trigger_id)  # the runner runs them all
    second = make_supervisor()
    load(second)
    load(first)  # the first renews: the shards the placement gives the joiner start draining
    assert first.handover.leaving, "shards given up keep their leases while their coroutines end"
    leaving = set(first.handover.runners)
    assert leaving and not second.owned & set(first.handover.leaving)
    first.starting.request_started()
    assert leaving <= first.cancelling_triggers  # the runner is told to end them (without on_kill)

    # the runner's answer: the coroutines fired just before they were cancelled, then ended
    for runner in sorted(leaving):
        first.events.append(event_entry(runner, {"last": runner}, seq=runner))
    first.handle_events()
    first.running_triggers -= leaving
    first.leases.finish_leaving()
    load(first)  # releases the drained shards
    assert not first.handover.leaving and not first.owned & {s for s in range(4) if s in second.owned}

    def joiner_has_them() -> bool:
        load(second)
        return bool(second.owned)

    wait_for(joiner_has_them, bool, timeout=15, what="the joiner takes the drained shards")
    states = ti_states(dsn, seeded.dag_id)
    resumed = {
        t
        for t, state in zip(seeded.trigger_ids, [states[i] for i in sorted(states)], strict=True)
        if state == "scheduled"
    }
    assert resumed == leaving, "every event sent before its coroutine ended is stored"
    assert sorted(first.persisted_event_seqs) == sorted(leaving)  # acknowledged once stored
    assert not second.groups.runners & leaving


def test_a_shard_wanted_back_while_it_drains_keeps_the_waiters_that_had_no_coroutine(
    env: AirflowConfig,
) -> None:
    """The placement changes its mind before a drain ended (the joiner stops again, a fleet settling): the
    shards come back, and the waiters that were waiting for room when they began to leave (forgotten then:
    nothing in flight) are read again, not left with no instance to run them."""
    dsn = env.database_dsn
    first = make_supervisor()
    seeded = seed_deferred(
        dsn, env.dags_folder, count=40, classpath=AT_TIME, kwargs_for=lambda i: {"moment": f"{LATER}#{i}"}
    )
    load(first)
    running = set(seeded.trigger_ids[::2])  # the rest wait for room
    for trigger_id in running:
        first.groups.start(first.groups.by_hash[first.groups.hash_of_member[trigger_id]])
        first.running_triggers.add(trigger_id)
    second = make_supervisor()
    load(second)
    load(first)  # the shards the placement gives the joiner start draining
    assert first.handover.leaving, "shards given up keep their leases while their coroutines end"
    assert set(first.member_info) < set(seeded.trigger_ids), "those without a coroutine are forgotten"
    second.release_all()  # the joiner stops before the drain ended
    load(first)
    assert not first.handover.leaving and first.owned == set(range(first.settings.shards))
    assert set(first.member_info) == set(seeded.trigger_ids)
    assert set(first.groups.runners) == running  # the coroutines still running were kept
