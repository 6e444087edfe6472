"""A peer frozen for good in the middle of a transaction, with real `smart-triggerer run` processes.

Issue 25.2 and 25.10: an instance stopped (SIGSTOP: a paused VM, a partition) while its event transaction
holds its lease rows and its tasks' rows must not freeze the fleet: the server ends that transaction
(``idle_in_transaction_session_timeout``), the survivor's claim skips locked rows instead of queueing, and
the frozen instance, if it ever wakes up, writes nothing for the shards it lost (fencing). What is checked
is what the database holds: every task left DEFERRED exactly once (an audit trigger of the chaos run).
"""

from __future__ import annotations

import datetime as dt
import signal
import time
from collections import Counter
from collections.abc import Iterator

import psycopg2
import pytest

from tests.helpers.chaos import AUDIT_DDL
from tests.helpers.waiting import lease_owners, rows, ti_states, wait_for
from tests.integration.test_smart_triggerer import AT_TIME, LEASE, _job_of, health_url, metrics, seed, start
from triggerer.devstack import AirflowStack

GROUPS = 12  # distinct waits, 2 tasks each, all due at one moment


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
    found = rows(dsn, "SELECT ti.id::text FROM task_instance ti "
                      "JOIN smart_triggerer.trigger_identity i ON i.trigger_id = ti.trigger_id "
                      "JOIN smart_triggerer.shard_lease l ON l.shard = i.shard AND l.queues = '' "
                      "WHERE ti.state = 'deferred' AND l.owner_job_id = %s ORDER BY ti.id LIMIT 1", job_id)
    assert found, f"instance {job_id} owns no shard with a waiter"
    conn = psycopg2.connect(dsn)
    conn.cursor().execute("SELECT 1 FROM task_instance WHERE id = %s AND state = 'deferred' FOR UPDATE",
                          (found[0][0],))
    return conn, found[0][0]


def test_a_peer_frozen_inside_its_transaction_is_taken_over_and_fenced(audited: AirflowStack) -> None:
    dsn = audited.config.database_dsn
    frozen, survivor = start(audited, "smart-a"), start(audited, "smart-b")
    frozen_job, survivor_job = _job_of(health_url(frozen)), _job_of(health_url(survivor))
    wait_for(lambda: lease_owners(dsn), lambda o: set(o.values()) == {frozen_job, survivor_job}, 60,
             "both instances to own shards")
    due = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=25)
    moments = [(due + dt.timedelta(milliseconds=k)).isoformat() for k in range(GROUPS)]
    seeded = seed(audited, 2 * GROUPS, AT_TIME, lambda i: {"moment": moments[i % GROUPS]})
    urls = [health_url(frozen), health_url(survivor)]
    wait_for(lambda: [metrics(u) for u in urls],
             lambda ms: sum(m["smart_triggerer_waiters"] for m in ms) == 2 * GROUPS, 30,
             "every waiter running")

    holder, held_ti = lock_one_task_of(dsn, frozen_job)
    try:
        holder_pid = holder.get_backend_pid()
        # at the moment, the frozen-to-be instance stores its events: fence taken, then it queues behind us
        blocked = wait_for(lambda: backend_blocked_by(dsn, holder_pid), bool, 60,
                           "the instance's event transaction to wait on the locked task", interval=0.02)
        frozen.signal(signal.SIGSTOP)
        frozen_at = time.monotonic()
    finally:
        holder.rollback()
        holder.close()
    try:
        frozen_pid = blocked[0][0]
        # it got the row and finished the statement; its process stopped before it could commit
        wait_for(lambda: session_state(dsn, frozen_pid), lambda s: s == [("idle in transaction",)], 5,
                 "the frozen session to sit inside its transaction", interval=0.02)
        wait_for(lambda: lease_owners(dsn), lambda o: set(o.values()) == {survivor_job}, LEASE + 10,
                 "the survivor to own every shard", interval=0.05)
        took = time.monotonic() - frozen_at
        print(f"takeover from a frozen holder: {took:.2f}s")
        assert took <= LEASE + 3, f"takeover took {took:.1f}s (limit lease + 3 s = {LEASE + 3:.0f}s)"
        assert session_state(dsn, frozen_pid) == []  # the server ended the frozen transaction
        wait_for(lambda: ti_states(dsn, seeded.dag_id), lambda s: set(s.values()) == {"scheduled"},
                 LEASE + 10, "every waiter resumed by the survivor")
        resumed = time.monotonic() - frozen_at
        print(f"every waiter resumed {resumed:.2f}s after the freeze")
    finally:
        frozen.signal(signal.SIGCONT)
    # awake again, it finds its session gone and its leases taken: it must write nothing
    wait_for(lambda: frozen.log_tail(20_000), lambda t: "handing over shards" in t or "lapsed" in t, 30,
             "the woken instance to give up its shards")
    assert_each_resolved_once(dsn, seeded.dag_id, held_ti)
    assert frozen.running() and survivor.running()


def assert_each_resolved_once(dsn: str, dag_id: str, held_ti: str) -> None:
    audit = rows(dsn, "SELECT a.ti_id::text, a.op, a.next_method FROM chaos.ti_audit a "
                      "JOIN task_instance ti ON ti.id = a.ti_id WHERE ti.dag_id = %s ORDER BY a.seq", dag_id)
    resolved = Counter(ti for ti, op, _method in audit if op == "resolved")
    assert len(resolved) == 2 * GROUPS and set(resolved.values()) == {1}, audit
    assert not [a for a in audit if a[1] in ("rewritten", "deleted")], audit
    assert held_ti in resolved
