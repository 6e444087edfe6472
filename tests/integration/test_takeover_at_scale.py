"""Issue 30: a takeover of thousands of waits, timed by the first poll of each wait after the kill.

Real ``smart-triggerer run`` processes and a real HTTP source that logs every poll: a wait is "polling
again" when its key is polled after the moment its instance was SIGKILLed. Each wait has its own key (no
duplicates) and a 30 s poll interval, so a poll seen soon after the kill can only come from the taker.
"""

from __future__ import annotations

import datetime as dt
import math
import signal
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from devkit.devstack import AirflowConfig, AirflowStack, Component
from tests.helpers.chaos.databases import AUDIT_DDL
from tests.helpers.http_server import ControlledServer
from tests.helpers.waiting import lease_owners, rows, ti_states, wait_for
from tests.integration.test_smart_triggerer import LEASE, _job_of, health_url, metrics, seed, start

SOURCE_POLL = "tests.helpers.chaos_triggers.SourcePollTrigger"
WAITS = 3000
POLL_INTERVAL = 30.0
# the takeover goal at 50,000 waiters; the loading path before it took lease + 7 s for 1,500 waits here
BOUND = LEASE + 5.0


@pytest.fixture
def audited(airflow_stack: AirflowStack) -> Iterator[AirflowStack]:
    rows(airflow_stack.config.database_dsn, AUDIT_DDL + "; SELECT 1")
    yield airflow_stack


def waits_of(dsn: str, job_id: int, dag_id: str) -> list[int]:
    """Map indexes of the deferred waits whose shard ``job_id`` holds (waiter i waits on key-i)."""
    return [
        r[0]
        for r in rows(
            dsn,
            "SELECT ti.map_index FROM task_instance ti "
            "JOIN smart_triggerer.trigger_identity i ON i.trigger_id = ti.trigger_id "
            "JOIN smart_triggerer.shard_lease l ON l.shard = i.shard AND l.queues = '' "
            "WHERE ti.dag_id = %s AND ti.state = 'deferred' AND l.owner_job_id = %s",
            dag_id,
            job_id,
        )
    ]


def two_instances_polling(stack: AirflowStack, source: ControlledServer) -> tuple[list[Component], str]:
    """Two instances owning shards and WAITS waits on distinct keys, every one polled once."""
    dsn = stack.config.database_dsn
    instances = [start(stack, "smart-a"), start(stack, "smart-b")]
    jobs = [_job_of(health_url(c)) for c in instances]
    wait_for(
        lambda: lease_owners(dsn), lambda o: set(o.values()) == set(jobs), 60, "both instances to own shards"
    )
    seeded = seed(
        stack,
        WAITS,
        SOURCE_POLL,
        lambda i: {"url": source.url, "key": f"key-{i}", "poll_interval": POLL_INTERVAL},
    )
    wait_for(
        lambda: len(source.polled_since(0.0)),
        lambda n: n == WAITS,
        120,
        "every wait polled once",
        interval=0.5,
    )
    return instances, seeded.dag_id


def all_polling_after(source: ControlledServer, since: float, keys: set[str], timeout: float) -> float:
    """Seconds from ``since`` (wall clock) until each of these keys was polled after it."""
    polled = wait_for(
        lambda: source.polled_since(since),
        lambda p: keys <= set(p),
        timeout,
        f"{len(keys)} waits to poll again",
        interval=0.2,
    )
    return max(polled[k] for k in keys) - since


@pytest.mark.alone  # asserts a time bound: runs with no other test beside it (dev.py)
def test_a_takeover_of_thousands_of_waits_polls_every_one_within_lease_plus_5s(audited: AirflowStack) -> None:
    dsn = audited.config.database_dsn
    with ControlledServer().running() as source:
        instances, dag_id = two_instances_polling(audited, source)
        # the instance with more waits is killed (the split of 16 shards over two can be lopsided)
        owned = [{f"key-{i}" for i in waits_of(dsn, _job_of(health_url(c)), dag_id)} for c in instances]
        most = 0 if len(owned[0]) >= len(owned[1]) else 1
        victim, survivor, keys = instances[most], instances[1 - most], owned[most]
        killed = time.time()
        victim.signal(signal.SIGKILL)
        took = all_polling_after(source, killed, keys, LEASE + 60)
        print(
            f"\n{len(keys)} waits of the killed instance all polling again {took:.2f}s after the kill "
            f"(lease {LEASE:g}s)"
        )
        assert took <= BOUND, f"the takeover took {took:.1f}s until every wait polled (bound {BOUND:g}s)"
        assert metrics(health_url(survivor))["smart_triggerer_waiters"] == WAITS
        source.ready.update(f"key-{i}" for i in range(WAITS))
        wait_for(
            lambda: ti_states(dsn, dag_id),
            lambda s: set(s.values()) == {"scheduled"},
            POLL_INTERVAL + 30,
            "every wait resumed",
        )
    assert_each_resolved_once(dsn, dag_id)


def test_a_takeover_interrupted_halfway_still_loads_every_wait(audited: AirflowStack) -> None:
    """The taker is SIGKILLed while it starts the victim's waits (some polling again, not all): the last
    instance reads those shards in full and runs every wait; each resumes exactly once when its key turns
    ready (a wait left unloaded would never resume: its key is polled by nobody)."""
    dsn = audited.config.database_dsn
    with ControlledServer().running() as source:
        (victim, taker), dag_id = two_instances_polling(audited, source)
        last = start(audited, "smart-c")
        last_job = _job_of(health_url(last))
        wait_for(
            lambda: lease_owners(dsn),
            lambda o: last_job in set(o.values()),
            60,
            "the third instance to own shards",
        )
        victim_job = _job_of(health_url(victim))
        keys = {f"key-{i}" for i in waits_of(dsn, victim_job, dag_id)}
        killed = time.time()
        victim.signal(signal.SIGKILL)
        # kill a taker as soon as the victim's waits have started polling again, before all of them
        started = wait_for(
            lambda: set(source.polled_since(killed)) & keys,
            bool,
            LEASE + 30,
            "the takeover to start",
            interval=0.01,
        )
        taker.signal(signal.SIGKILL)
        print(f"\nkilled a taker with {len(started)} of the victim's {len(keys)} waits polling again")
        wait_for(
            lambda: lease_owners(dsn),
            lambda o: set(o.values()) == {last_job},
            LEASE + 30,
            "the last instance to own every shard",
            interval=0.1,
        )
        wait_for(
            lambda: metrics(health_url(last)),
            lambda m: m["smart_triggerer_waiters"] == WAITS,
            60,
            "the last instance to run every wait",
        )
        source.ready.update(f"key-{i}" for i in range(WAITS))
        wait_for(
            lambda: ti_states(dsn, dag_id),
            lambda s: set(s.values()) == {"scheduled"},
            POLL_INTERVAL + 30,
            "every wait resumed",
        )
    assert_each_resolved_once(dsn, dag_id)


def assert_each_resolved_once(dsn: str, dag_id: str) -> None:
    audit = rows(
        dsn,
        "SELECT a.ti_id::text, a.op FROM chaos.ti_audit a "
        "JOIN task_instance ti ON ti.id = a.ti_id WHERE ti.dag_id = %s",
        dag_id,
    )
    resolved = Counter(ti for ti, op in audit if op == "resolved")
    assert len(resolved) == WAITS and set(resolved.values()) == {1}
    assert not [a for a in audit if a[1] in ("rewritten", "deleted")]


def test_groups_start_soonest_due_first(airflow_config: AirflowConfig) -> None:
    """A takeover starts the waits whose next poll or timeout is due soonest first (a wait just taken over
    may be due at once: its last poll is not known): asset watchers, then by poll interval or member
    timeout, whichever is sooner. One group per batch here, so the runner is asked in that order."""
    from tests.helpers.airflow_orm import use_airflow_db
    from tests.helpers.seeding import seed_deferred
    from tests.integration.test_supervisor_faults import AT_TIME, add_watcher, load, make_supervisor

    use_airflow_db(airflow_config.database_dsn)
    later = dt.datetime.now(dt.UTC) + dt.timedelta(hours=2)

    def group(poll_interval: float, *, hours: int, timeout: dt.timedelta | None = None) -> list[int]:
        moment = (later + dt.timedelta(hours=hours)).isoformat()
        seeded = seed_deferred(
            airflow_config.database_dsn,
            airflow_config.dags_folder,
            count=2,
            classpath=AT_TIME,
            trigger_timeout=timeout,
            kwargs_for=lambda i: {"moment": moment, "poll_interval": poll_interval},
        )
        return seeded.trigger_ids

    slow, mid = group(60.0, hours=1), group(10.0, hours=2)
    timing_out = group(60.0, hours=3, timeout=dt.timedelta(seconds=3))
    fast = group(1.0, hours=4)
    watcher = add_watcher("urgent")
    supervisor = make_supervisor(max_new_per_loop=1)
    load(supervisor)
    supervisor.starting.start_groups()
    started = [w.id for w in supervisor.creating_triggers]
    order = [[watcher], fast, timing_out, mid, slow]
    print("\nstarted in order:", started, "| groups:", order)
    assert len(started) == 5
    assert all(runner in members for runner, members in zip(started, order, strict=True))


def test_the_start_order_is_kept_between_calls_until_a_group_arrives(
    airflow_config: AirflowConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A takeover of thousands starts them a batch at a time over many calls: they are sorted once, not
    for every batch, and a group that comes to wait meanwhile (here an asset watcher, the most urgent) is
    started next."""
    from smart_triggerer.supervisor.starting import Starting
    from tests.helpers.airflow_orm import use_airflow_db
    from tests.helpers.seeding import seed_deferred
    from tests.integration.test_supervisor_faults import AT_TIME, add_watcher, load, make_supervisor

    use_airflow_db(airflow_config.database_dsn)
    base = dt.datetime.now(dt.UTC) + dt.timedelta(hours=2)
    seeded = seed_deferred(
        airflow_config.database_dsn,
        airflow_config.dags_folder,
        count=6,
        classpath=AT_TIME,
        kwargs_for=lambda i: {
            "moment": (base + dt.timedelta(minutes=i)).isoformat(),
            "poll_interval": 10.0 * (i + 1),
        },
    )
    sorts: list[int] = []
    original = Starting._by_urgency

    def counted(self: Starting) -> Any:
        sorts.append(len(self.shared.groups.unstarted))
        return original(self)

    monkeypatch.setattr(Starting, "_by_urgency", counted)
    supervisor = make_supervisor(max_new_per_loop=1)
    load(supervisor)

    def start_one() -> int:
        (group,) = supervisor.starting._next_to_start(1)  # as start_groups takes each batch
        return int(supervisor.groups.start(group))

    first, second = start_one(), start_one()
    assert [first, second] == seeded.trigger_ids[:2]  # the shortest intervals first
    assert sorts == [6]  # sorted once for both batches
    watcher = add_watcher("arrives-later")
    load(supervisor)
    assert start_one() == watcher
    assert sorts == [6, 5]  # sorted again: a group arrived
    assert [start_one() for _ in range(4)] == seeded.trigger_ids[2:]
    assert sorts == [6, 5]
    assert not supervisor.groups.unstarted


def test_groups_started_while_the_database_was_away_are_built_a_batch_at_a_time(
    airflow_config: AirflowConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """During an outage each start call marked a batch of groups started before its build failed; once
    the database was back, every one of them was built in one call (one transaction, no lease renewal, no
    runner served meanwhile: minutes at tens of thousands). Builds stay a batch each."""
    from sqlalchemy.exc import OperationalError

    from smart_triggerer.supervisor import SmartTriggerRunnerSupervisor
    from tests.helpers.airflow_orm import use_airflow_db
    from tests.helpers.seeding import seed_deferred
    from tests.integration.test_supervisor_faults import AT_TIME, load, make_supervisor

    use_airflow_db(airflow_config.database_dsn)
    base = dt.datetime.now(dt.UTC) + dt.timedelta(hours=2)
    seed_deferred(
        airflow_config.database_dsn,
        airflow_config.dags_folder,
        count=12,
        classpath=AT_TIME,
        kwargs_for=lambda i: {"moment": (base + dt.timedelta(minutes=i)).isoformat()},
    )
    supervisor = make_supervisor(max_new_per_loop=3)
    load(supervisor)
    original = SmartTriggerRunnerSupervisor.build_trigger_workloads
    builds: list[int] = []

    def away(self: Any, ids: set[int]) -> Any:
        raise OperationalError("SELECT 1", {}, Exception("connection refused"))

    monkeypatch.setattr(SmartTriggerRunnerSupervisor, "build_trigger_workloads", away)
    for _ in range(6):
        supervisor._db_step("start", supervisor.start_groups)
    assert not supervisor.groups.unstarted  # every group marked started, none built

    def counted(self: Any, ids: set[int]) -> Any:
        builds.append(len(ids))
        return original(self, ids)

    monkeypatch.setattr(SmartTriggerRunnerSupervisor, "build_trigger_workloads", counted)
    for _ in range(6):
        supervisor._db_step("start", supervisor.start_groups)
    print("\nbuild sizes after the outage:", builds)
    assert builds and max(builds) <= 3
    assert len({w.id for w in supervisor.creating_triggers}) == 12


def taken_over(config: AirflowConfig, monkeypatch: pytest.MonkeyPatch, count: int = 40) -> tuple[Any, Any]:
    """An in-process instance that owned every shard of ``count`` waits (one group each) and published its
    groups per shard, and a second that joined while it held them (its feed position set, nothing
    owned); ``FIRST_READ_GROUPS`` is 4 here. Returns (owner, taker)."""
    import math

    from smart_triggerer.supervisor import feed
    from tests.helpers.airflow_orm import use_airflow_db
    from tests.helpers.seeding import seed_deferred
    from tests.integration.test_supervisor_faults import AT_TIME, load, make_supervisor

    use_airflow_db(config.database_dsn)
    base = dt.datetime.now(dt.UTC) + dt.timedelta(hours=2)
    seed_deferred(
        config.database_dsn,
        config.dags_folder,
        count=count,
        classpath=AT_TIME,
        kwargs_for=lambda i: {"moment": (base + dt.timedelta(minutes=i)).isoformat()},
    )
    monkeypatch.setattr(feed, "FIRST_READ_GROUPS", 4)
    owner = make_supervisor(max_new_per_loop=5)
    load(owner)
    owner.leases.loads_counted_at = -math.inf  # publish its groups per shard with the next renewal
    owner.leases.renew()
    taker = make_supervisor(max_new_per_loop=5)
    load(taker)  # joins while the owner holds every shard: nothing to read yet
    assert not taker.owned and not taker.member_info
    return owner, taker


def waiting_ids(dsn: str) -> set[int]:
    return {r[0] for r in rows(dsn, "SELECT trigger_id FROM task_instance WHERE state = 'deferred'")}


def test_a_big_takeover_hands_its_first_shards_to_the_runner_before_reading_the_rest(
    airflow_config: AirflowConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The taker reads the shards holding its first ``FIRST_READ_GROUPS`` groups (by the loads the last
    owner published), starts them, then reads the other shards; every wait is loaded and claimed."""
    from smart_triggerer.db.store import Store
    from smart_triggerer.supervisor import SmartTriggerRunnerSupervisor
    from tests.integration.test_supervisor_faults import load

    dsn = airflow_config.database_dsn
    owner, taker = taken_over(airflow_config, monkeypatch)

    steps: list[str] = []
    reads = Store.waiting_triggers
    starts = SmartTriggerRunnerSupervisor.start_groups

    def read(self: Store, shards: Any, queues: Any, **kw: Any) -> Any:
        if kw.get("after_xid") is None and shards:
            steps.append(f"read {sorted(shards)}")
        return reads(self, shards, queues, **kw)

    def start(self: Any) -> None:
        steps.append(f"start {len(self.member_info)} waits")
        starts(self)

    monkeypatch.setattr(Store, "waiting_triggers", read)
    monkeypatch.setattr(SmartTriggerRunnerSupervisor, "start_groups", start)
    owner.release_all()  # a graceful stop: the taker claims its 4 shards with the next renewal
    load(taker)

    published = {shard: groups for shard, groups in taker.leases.shard_groups.items() if shard in taker.owned}
    print("\nloads published:", published, "| steps:", steps)
    assert taker.owned == {0, 1, 2, 3} and sum(published.values()) == 40
    expected, waits_read, budget, phase = [], 0, 4, []
    for shard in range(4):  # phases of 4 groups or more, then twice as many each, each started
        phase.append(shard)
        if sum(published[s] for s in phase) >= budget or shard == 3:
            expected.append(f"read {phase}")
            waits_read += sum(published[s] for s in phase)
            if shard < 3:
                expected.append(f"start {waits_read} waits")
            phase, budget = [], budget * 2
    assert len([s for s in expected if s.startswith("read")]) >= 2
    assert steps == expected
    assert set(taker.member_info) == waiting_ids(dsn)
    assert not taker.to_read
    assert rows(dsn, "SELECT DISTINCT triggerer_id FROM trigger") == [(taker.job_id,)]


def test_a_takeover_whose_second_read_fails_reads_the_shards_left_in_the_next_loop(
    airflow_config: AirflowConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sqlalchemy.exc import OperationalError

    from smart_triggerer.db.store import Store
    from tests.integration.test_supervisor_faults import load

    dsn = airflow_config.database_dsn
    owner, taker = taken_over(airflow_config, monkeypatch)
    reads = Store.waiting_triggers
    full_reads: list[list[int]] = []

    def second_fails(self: Store, shards: Any, queues: Any, **kw: Any) -> Any:
        if kw.get("after_xid") is None and shards:
            full_reads.append(sorted(shards))
            if len(full_reads) == 2:
                raise OperationalError("SELECT", {}, Exception("server closed the connection unexpectedly"))
        return reads(self, shards, queues, **kw)

    monkeypatch.setattr(Store, "waiting_triggers", second_fails)
    owner.release_all()
    taker._db_step("load", taker.read_changes)
    unread = {0, 1, 2, 3} - set(full_reads[0])  # the failed read's shards and those of later phases
    assert taker.owned == {0, 1, 2, 3} and taker.to_read == unread and set(full_reads[1]) <= unread
    loaded = set(taker.member_info)
    assert loaded and loaded < waiting_ids(dsn)
    load(taker)  # the next loop: the shards left unread are read in full
    print("\nfull reads:", full_reads)
    assert sorted(s for read in full_reads[2:] for s in read) == sorted(unread) and not taker.to_read
    assert set(taker.member_info) == waiting_ids(dsn)


@pytest.mark.parametrize("meanwhile", ["a share of the lease passed", "a stop was asked"])
def test_a_takeover_that_stops_between_phases_leaves_the_rest_to_read(
    airflow_config: AirflowConfig, monkeypatch: pytest.MonkeyPatch, meanwhile: str
) -> None:
    """Phases go on for a share of the lease after the renewal that took the shards (a slow machine, a
    short lease): then the next loop renews at once and reads the rest. A stop ends them too. Either
    way the shards not read yet stay to be read: nothing of them is lost or started unread."""
    from smart_triggerer.db.store import Store
    from smart_triggerer.supervisor import SmartTriggerRunnerSupervisor
    from tests.integration.test_supervisor_faults import load

    dsn = airflow_config.database_dsn
    owner, taker = taken_over(airflow_config, monkeypatch)
    reads, starts = Store.waiting_triggers, SmartTriggerRunnerSupervisor.start_groups
    full_reads: list[list[int]] = []

    def read(self: Store, shards: Any, queues: Any, **kw: Any) -> Any:
        if kw.get("after_xid") is None and shards:
            full_reads.append(sorted(shards))
        return reads(self, shards, queues, **kw)

    def slow_start(self: Any) -> None:
        starts(self)
        if meanwhile == "a stop was asked":
            self.stop = True
        else:
            self.leases.last_renewal -= (
                self.settings.lease_seconds
            )  # as if this start had taken a whole lease

    monkeypatch.setattr(Store, "waiting_triggers", read)
    monkeypatch.setattr(SmartTriggerRunnerSupervisor, "start_groups", slow_start)
    owner.release_all()
    taker._db_step("load", taker.read_changes)
    read_so_far = {s for shards in full_reads for s in shards}
    print(f"\n{meanwhile}: reads {full_reads}, left to read {sorted(taker.to_read)}")
    assert taker.owned == {0, 1, 2, 3} and taker.to_read == {0, 1, 2, 3} - read_so_far != set()
    assert {info.shard for info in taker.member_info.values()} == read_so_far
    if meanwhile == "a stop was asked":
        return
    assert taker.last_load == -math.inf  # the next loop renews at once
    monkeypatch.setattr(SmartTriggerRunnerSupervisor, "start_groups", starts)
    load(taker)
    assert not taker.to_read and set(taker.member_info) == waiting_ids(dsn)


def test_a_group_runs_with_its_members_merged_settings_and_a_uniform_one_with_its_leaders_own(
    airflow_config: AirflowConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two groups of two waits each: one whose members both poll every 60 s starts from its leader's
    workload as stored (its kwargs not even decrypted), one whose second member polls every 5 s starts
    with 5 s."""
    from airflow.models.trigger import Trigger

    from tests.helpers.airflow_orm import use_airflow_db
    from tests.helpers.seeding import seed_deferred
    from tests.integration.test_supervisor_faults import AT_TIME, LATER, load, make_supervisor

    use_airflow_db(airflow_config.database_dsn)
    other = (dt.datetime.fromisoformat(LATER) + dt.timedelta(hours=1)).isoformat()
    intervals = {0: (LATER, 60.0), 1: (LATER, 60.0), 2: (other, 60.0), 3: (other, 5.0)}
    seed_deferred(
        airflow_config.database_dsn,
        airflow_config.dags_folder,
        count=4,
        classpath=AT_TIME,
        kwargs_for=lambda i: {"moment": intervals[i][0], "poll_interval": intervals[i][1]},
    )
    supervisor = make_supervisor()
    load(supervisor)
    decrypt = Trigger._decrypt_kwargs
    decrypted: list[str] = []

    def counted(encrypted: str) -> Any:
        decrypted.append(encrypted)
        return decrypt(encrypted)

    monkeypatch.setattr(Trigger, "_decrypt_kwargs", staticmethod(counted))
    supervisor.starting.start_groups()
    monkeypatch.setattr(Trigger, "_decrypt_kwargs", staticmethod(decrypt))
    started = {decrypt(w.encrypted_kwargs)["moment"]: w for w in supervisor.creating_triggers}
    assert len(started) == 2 and len(decrypted) == 1  # the uniform group's kwargs were left as they are
    assert decrypt(started[LATER].encrypted_kwargs)["poll_interval"] == 60.0
    assert decrypt(started[other].encrypted_kwargs)["poll_interval"] == 5.0


@pytest.mark.parametrize("shard", [0, 3], ids=["in the first phase", "in the last phase"])
def test_a_shard_whose_lease_lapsed_during_a_read_starts_nothing(
    airflow_config: AirflowConfig, monkeypatch: pytest.MonkeyPatch, shard: int
) -> None:
    """A read's fence finds a shard's lease lapsed by the database clock (a clock step, a stall past the
    lease): no start after it may run its waits (a peer may be claiming it); it is dropped, and the
    other shards are read and started."""
    from smart_triggerer.db.store import Store
    from tests.integration.test_supervisor_faults import load

    owner, taker = taken_over(airflow_config, monkeypatch)
    fence = Store.fence
    lapsed: set[int] = set()

    def fence_lapses_the_shard(self: Store, job_id: int, shards: Any, queues: Any) -> set[int]:
        held = fence(self, job_id, shards, queues)
        if not lapsed and shard in held:
            lapsed.add(shard)
            return held - {shard}
        return held

    monkeypatch.setattr(Store, "fence", fence_lapses_the_shard)
    owner.release_all()
    load(taker)

    def started_shards() -> set[int]:
        return {taker.member_info[w.id].shard for w in taker.creating_triggers if w.id in taker.member_info}

    between = started_shards()
    taker.starting.start_groups()  # the loop's start after the reads
    print(
        "\nowned:",
        sorted(taker.owned),
        "| started between the reads:",
        sorted(between),
        "| after:",
        sorted(started_shards()),
    )
    assert lapsed == {shard} and shard not in taker.owned and shard not in between
    assert not any(info.shard == shard for info in taker.member_info.values())
    assert started_shards() == {0, 1, 2, 3} - {shard}
    of_the_shard = {
        r[0]
        for r in rows(
            airflow_config.database_dsn,
            "SELECT trigger_id FROM smart_triggerer.trigger_identity WHERE shard = %s",
            shard,
        )
    }
    assert of_the_shard and not of_the_shard & {w.id for w in taker.creating_triggers}  # never handed out


def test_waits_that_arrive_or_leave_between_a_takeovers_two_reads_are_followed(
    airflow_config: AirflowConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the first shards start (between the two reads), a wait of the first shards and one of the
    rest leave (their tasks cleared, their trigger rows deleted as Airflow's clean_unused does) and new
    waits arrive: after the next loop the taker runs exactly the waits still waiting."""
    from smart_triggerer.supervisor import SmartTriggerRunnerSupervisor
    from tests.helpers.seeding import seed_deferred
    from tests.integration.test_supervisor_faults import AT_TIME, LATER, load

    dsn = airflow_config.database_dsn
    owner, taker = taken_over(airflow_config, monkeypatch)
    starts = SmartTriggerRunnerSupervisor.start_groups
    moved: dict[str, int] = {}

    def meanwhile(self: Any) -> None:
        if not moved:  # the start between the reads: the first shards are members, the rest not yet
            first = min(self.member_info)
            rest = next(t for t in waiting_ids(dsn) if t not in self.member_info)
            for trigger_id in (first, rest):
                rows(
                    dsn,
                    "UPDATE task_instance SET state = 'scheduled', trigger_id = NULL "
                    "WHERE trigger_id = %s RETURNING 1",
                    trigger_id,
                )
                rows(dsn, "DELETE FROM trigger WHERE id = %s RETURNING 1", trigger_id)
            moved.update(first=first, rest=rest)
            seed_deferred(
                dsn,
                airflow_config.dags_folder,
                count=3,
                classpath=AT_TIME,
                kwargs_for=lambda i: {"moment": LATER, "poll_interval": 7.0 + i},
            )
        starts(self)

    monkeypatch.setattr(SmartTriggerRunnerSupervisor, "start_groups", meanwhile)
    owner.release_all()
    load(taker)
    assert moved and taker.owned == {0, 1, 2, 3}
    load(taker)  # the next loop: the change feed since the first read's position
    print("\nleft between the reads:", moved, "| members:", len(taker.member_info))
    assert set(taker.member_info) == waiting_ids(dsn)
    assert len(taker.member_info) == 40 - 2 + 3
