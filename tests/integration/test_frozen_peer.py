"""A peer frozen for good in the middle of a transaction, with real `smart-triggerer run` processes.

Issue 25.2 and 25.10: an instance stopped (SIGSTOP: a paused VM, a partition) while its event transaction
holds its lease rows and its tasks' rows must not freeze the fleet: the server ends that transaction
(``idle_in_transaction_session_timeout``), the survivor's claim skips locked rows instead of queueing, and
the frozen instance, if it ever wakes up, writes nothing for the shards it lost (fencing). The waits are on
an HTTP source that answers "ready" once per key: the frozen instance holds events the survivor never sees,
so only its lease checks (a renewal before it writes, the fence inside each write) keep the woken instance
from resuming those tasks (with both disabled this test fails: "the woken instance wrote"). What is
checked is what the database holds: every task left DEFERRED exactly once, by the survivor (an audit
trigger of the chaos run).
"""

from __future__ import annotations

import signal
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import psycopg2
import pytest

from devkit.devstack import AirflowStack
from tests.helpers.chaos.databases import AUDIT_DDL
from tests.helpers.http_server import ControlledServer
from tests.helpers.waiting import lease_owners, rows, ti_states, wait_for
from tests.integration.test_smart_triggerer import LEASE, SHARDS, _job_of, health_url, metrics, seed, start

GROUPS = 12  # distinct waits, 2 tasks each
SOURCE_POLL = "tests.helpers.chaos_triggers.SourcePollTrigger"


@pytest.fixture
def audited(airflow_stack: AirflowStack) -> Iterator[AirflowStack]:
    rows(airflow_stack.config.database_dsn, AUDIT_DDL + "; SELECT 1")
    yield airflow_stack


def backend_blocked_by(dsn: str, pid: int) -> list[tuple[int, str]]:
    return rows(dsn, "SELECT pid, state FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))", pid)


def session_state(dsn: str, pid: int) -> list[tuple[str]]:
    return rows(dsn, "SELECT state FROM pg_stat_activity WHERE pid = %s", pid)


def lock_one_task_of(dsn: str, job_id: int) -> tuple[psycopg2.extensions.connection, str]:
    """A row lock on one deferred task of a group whose shard the instance ``job_id`` owns."""
    found = rows(
        dsn,
        "SELECT ti.id::text FROM task_instance ti "
        "JOIN smart_triggerer.trigger_identity i ON i.trigger_id = ti.trigger_id "
        "JOIN smart_triggerer.shard_lease l ON l.shard = i.shard AND l.queues = '' "
        "WHERE ti.state = 'deferred' AND l.owner_job_id = %s ORDER BY ti.id LIMIT 1",
        job_id,
    )
    assert found, f"instance {job_id} owns no shard with a waiter"
    conn = psycopg2.connect(dsn)
    conn.cursor().execute(
        "SELECT 1 FROM task_instance WHERE id = %s AND state = 'deferred' FOR UPDATE", (found[0][0],)
    )
    return conn, found[0][0]


@pytest.mark.alone  # asserts a time bound (lease + 3 s): no other test's stack beside it
def test_a_peer_frozen_inside_its_transaction_is_taken_over_and_fenced(audited: AirflowStack) -> None:
    dsn = audited.config.database_dsn
    with ControlledServer().running() as source:
        frozen, survivor = start(audited, "smart-a"), start(audited, "smart-b")
        frozen_job, survivor_job = _job_of(health_url(frozen)), _job_of(health_url(survivor))
        wait_for(
            lambda: lease_owners(dsn),
            lambda o: set(o.values()) == {frozen_job, survivor_job},
            60,
            "both instances to own shards",
        )
        keys = keys_on_both(source.url, lease_owners(dsn), frozen_job)
        seeded = seed(
            audited,
            2 * GROUPS,
            SOURCE_POLL,
            lambda i: {"url": source.url, "key": keys[i % GROUPS], "poll_interval": 0.05},
        )
        urls = [health_url(frozen), health_url(survivor)]
        wait_for(
            lambda: [metrics(u) for u in urls],
            lambda ms: sum(m["smart_triggerer_waiters"] for m in ms) == 2 * GROUPS,
            30,
            "every waiter running",
        )
        held_ti, frozen_pid, frozen_at = freeze_inside_event_transaction(
            audited, source, frozen, frozen_job, (seeded.dag_id, keys)
        )
        # its events stored before the freeze resumed their tasks; those of its open transaction did not
        stuck = {
            i
            for i, state in ti_states(dsn, seeded.dag_id).items()
            if state == "deferred" and keys[i % GROUPS] in source.answered_ready
        }
        assert stuck
        try:
            wait_for(
                lambda: lease_owners(dsn),
                lambda o: set(o.values()) == {survivor_job},
                LEASE + 10,
                "the survivor to own every shard",
                interval=0.05,
            )
            took = time.monotonic() - frozen_at
            print(f"takeover from a frozen holder: {took:.2f}s")
            assert took <= LEASE + 3, f"takeover took {took:.1f}s (limit lease + 3 s = {LEASE + 3:.0f}s)"
            assert session_state(dsn, frozen_pid) == []  # the server ended the frozen transaction
            # the survivor runs the frozen instance's waits: its polls get "not ready" (the source said
            # "ready" once, to the frozen instance)
            stuck_keys = {keys[i % GROUPS] for i in stuck}
            polled = {k: source.polls.get(k, 0) for k in stuck_keys}
            wait_for(
                lambda: {k for k in stuck_keys if source.polls.get(k, 0) > polled[k]},
                lambda seen: seen == stuck_keys,
                LEASE + 10,
                "the survivor to poll the frozen waits",
            )
            waiting = sum(1 for state in ti_states(dsn, seeded.dag_id).values() if state == "deferred")
            wait_for(
                lambda: metrics(health_url(survivor)),
                lambda m: m["smart_triggerer_waiters"] == waiting,
                LEASE + 10,
                "the survivor to run every wait still deferred",
            )
        finally:
            frozen.signal(signal.SIGCONT)
        # awake again with events in hand for tasks still deferred: fencing alone keeps it from writing
        wait_for(
            lambda: frozen.log_tail(20_000),
            lambda t: "handing over shards" in t or "lapsed" in t,
            30,
            "the woken instance to give up its shards",
        )
        wait_for(
            lambda: metrics(health_url(frozen)),
            lambda m: m["smart_triggerer_shards_owned"] == 0,
            30,
            "the woken instance to run nothing",
        )
        states = ti_states(dsn, seeded.dag_id)
        assert {i for i in stuck if states[i] != "deferred"} == set(), "the woken instance wrote"
        source.ready.update(keys)  # now the survivor's polls find them ready
        wait_for(
            lambda: ti_states(dsn, seeded.dag_id),
            lambda s: set(s.values()) == {"scheduled"},
            LEASE + 10,
            "every waiter resumed by the survivor",
        )
    assert_each_resolved_once(dsn, seeded.dag_id, held_ti)
    assert frozen.running() and survivor.running()


def keys_on_both(url: str, owners: dict[int, int | None], frozen_job: int) -> list[str]:
    """GROUPS keys, half of them in shards the instance to freeze owns (the split of 16 shards over two
    instances can be lopsided: keys picked at random could all land on one)."""
    from triggers.identity import identity_hash, shard_of

    mine: list[str] = []
    theirs: list[str] = []
    for n in range(10_000):
        key = f"key-{n}"
        side = (
            mine
            if owners[shard_of(identity_hash(SOURCE_POLL, {"url": url, "key": key}), SHARDS)] == frozen_job
            else theirs
        )
        if len(side) < GROUPS // 2:
            side.append(key)
        if len(mine) + len(theirs) == GROUPS:
            return [k for pair in zip(mine, theirs, strict=True) for k in pair]
    raise AssertionError("no keys found on both instances' shards")


def freeze_inside_event_transaction(
    stack: AirflowStack, source: ControlledServer, frozen: Any, frozen_job: int, waits: tuple[str, list[str]]
) -> tuple[str, int, float]:
    """Make the frozen instance's waits ready once (its polls only), wait until its event transaction
    queues behind a task row we lock, SIGSTOP it there and let its statement finish: its session sits idle
    in its transaction, its process stopped. Returns the locked task, the frozen backend's pid and the
    moment of the freeze."""
    dsn = stack.config.database_dsn
    dag_id, keys = waits
    frozen_keys = set(frozen_waits(dsn, frozen_job, dag_id, keys))
    assert frozen_keys, "the instance to freeze owns no wait"
    holder, held_ti = lock_one_task_of(dsn, frozen_job)
    try:
        holder_pid = holder.get_backend_pid()
        source.ready_once.update(frozen_keys)
        blocked = wait_for(
            lambda: backend_blocked_by(dsn, holder_pid),
            bool,
            60,
            "the instance's event transaction to wait on the locked task",
            interval=0.02,
        )
        frozen.signal(signal.SIGSTOP)
        frozen_at = time.monotonic()
    finally:
        holder.rollback()
        holder.close()
    frozen_pid = blocked[0][0]
    # it got the row and finished the statement; its process stopped before it could commit
    wait_for(
        lambda: session_state(dsn, frozen_pid),
        lambda s: s == [("idle in transaction",)],
        5,
        "the frozen session to sit inside its transaction",
        interval=0.02,
    )
    assert source.answered_ready <= frozen_keys
    return held_ti, frozen_pid, frozen_at


def frozen_waits(dsn: str, job_id: int, dag_id: str, keys: list[str]) -> list[str]:
    """The keys of the waits whose shard ``job_id`` owns (waiter i waits on keys[i % len(keys)])."""
    found = rows(
        dsn,
        "SELECT DISTINCT ti.map_index FROM task_instance ti "
        "JOIN smart_triggerer.trigger_identity i ON i.trigger_id = ti.trigger_id "
        "JOIN smart_triggerer.shard_lease l ON l.shard = i.shard AND l.queues = '' "
        "WHERE ti.dag_id = %s AND ti.state = 'deferred' AND l.owner_job_id = %s",
        dag_id,
        job_id,
    )
    return sorted({keys[r[0] % len(keys)] for r in found})


def assert_each_resolved_once(dsn: str, dag_id: str, held_ti: str) -> None:
    audit = rows(
        dsn,
        "SELECT a.ti_id::text, a.op, a.next_method FROM chaos.ti_audit a "
        "JOIN task_instance ti ON ti.id = a.ti_id WHERE ti.dag_id = %s ORDER BY a.seq",
        dag_id,
    )
    resolved = Counter(ti for ti, op, _method in audit if op == "resolved")
    assert len(resolved) == 2 * GROUPS and set(resolved.values()) == {1}, audit
    assert not [a for a in audit if a[1] in ("rewritten", "deleted")], audit
    assert held_ti in resolved
