"""The smart triggerer against a real PostgreSQL and real `smart-triggerer run` processes.

Waiters are seeded deferred task instances (no scheduler, no workers): what is asserted is what the
triggerer wrote into Airflow's tables.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from devkit.devstack import AirflowStack, Component
from tests.helpers.chaos.databases import AUDIT_DDL
from tests.helpers.descriptors import descriptors
from tests.helpers.seeding import Seeded, seed_deferred
from tests.helpers.shards import keys_per_shard
from tests.helpers.triggers import KillMarkerTrigger
from tests.helpers.waiting import lease_owners, rows, ti_states, wait_for

ROOT = Path(__file__).resolve().parents[2]
AT_TIME = "tests.helpers.triggers.AtTimeTrigger"
FAILING = "tests.helpers.triggers.FailingTrigger"
FLAG_FILE = "tests.helpers.triggers.FlagFileTrigger"
SHARDS = 16
LEASE = 6.0
ENV = {
    "PYTHONPATH": str(ROOT),
    "AIRFLOW__SMART_TRIGGERER__SHARDS": str(SHARDS),
    "AIRFLOW__SMART_TRIGGERER__LEASE_SECONDS": str(LEASE),
    # Seeded waiters deferred "just now"; the race guard is tested on its own in e2e.
    "AIRFLOW__SMART_TRIGGERER__RESUME_HOLD_SECONDS": "0",
    # --capacity is a cap (as in Airflow): sized for the largest test's waits on one instance, as a user
    # sizes it for a fleet's; the capacity tests pass their own
    "AIRFLOW__TRIGGERER__CAPACITY": "10000",
}


def in_seconds(seconds: float) -> str:
    return (dt.datetime.now(dt.UTC) + dt.timedelta(seconds=seconds)).isoformat()


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name.split("{")[0]] = float(value)
    return values


def health_url(component: Component) -> str:
    return component.health_url(30)


@pytest.fixture
def stack(airflow_stack: AirflowStack) -> Iterator[AirflowStack]:
    yield airflow_stack


def start(stack: AirflowStack, name: str = "smart-triggerer", **settings: str) -> Component:
    """Start an instance; ``settings`` override ``[smart_triggerer]`` keys (upper case)."""
    extra = {f"AIRFLOW__SMART_TRIGGERER__{k}": v for k, v in settings.items()}
    return stack.start_smart_triggerer(name, env={**ENV, **extra})


def seed(stack: AirflowStack, count: int, classpath: str, kwargs_for: Any, **kw: Any) -> Seeded:
    return seed_deferred(
        stack.config.database_dsn,
        stack.config.dags_folder,
        count=count,
        classpath=classpath,
        kwargs_for=kwargs_for,
        **kw,
    )


def next_kwargs(dsn: str, dag_id: str) -> dict[int, dict[str, Any]]:
    return {
        r[0]: json.loads(r[1]) if isinstance(r[1], str) else r[1]
        for r in rows(dsn, "SELECT map_index, next_kwargs FROM task_instance WHERE dag_id = %s", dag_id)
    }


def test_one_coroutine_per_identity_resumes_every_waiter_once(stack: AirflowStack) -> None:
    dsn = stack.config.database_dsn
    # far enough ahead that the counts below are read before any group fires: on a loaded CI host the
    # instance's start and the status command took past 12 s (a group had resumed: "2 == 3")
    moments = [in_seconds(40 + g) for g in range(3)]
    seeded = seed(stack, 30, AT_TIME, lambda i: {"moment": moments[i % 3], "poll_interval": 0.2 + i % 2})
    instance = start(stack)
    url = health_url(instance)

    waiting = wait_for(
        lambda: metrics(url),
        lambda m: m.get("smart_triggerer_waiters") == 30 and m.get("smart_triggerer_coroutines", 0) > 0,
        30,
        "all 30 waiters running",
    )
    assert waiting["smart_triggerer_groups"] == 3
    assert waiting["smart_triggerer_coroutines"] == 3
    status = stack.smart_status()
    assert status["totals"]["groups"] == 3 and status["totals"]["waiters"] == 30
    assert status["dedup_ratio"] == 10.0

    wait_for(
        lambda: ti_states(dsn, seeded.dag_id),
        lambda s: set(s.values()) == {"scheduled"},
        90,
        "every waiter resumed",
    )
    kwargs = next_kwargs(dsn, seeded.dag_id)
    for map_index, value in kwargs.items():
        assert value["event"]["moment"] == moments[map_index % 3], value
    done = metrics(url)
    assert done["smart_triggerer_events_total"] == 3
    assert done["smart_triggerer_resumed_total"] == 30
    # Only the three leaders ran: one trigger log per group.
    logs = list((stack.config.home / "logs").rglob("*.trigger.*.log"))
    assert len(logs) == 3, logs
    # Each says it started and fired; "trigger completed" is left out after a fired event.
    texts = wait_for(
        lambda: [log.read_text() for log in logs],
        lambda t: all("Trigger fired event" in text for text in t),
        30,
        "fired lines written",
    )
    assert all("starting" in text and "trigger completed" not in text for text in texts), texts
    # The runner subprocess runs on uvloop ([smart_triggerer] event_loop's default).
    lines = instance.log_path.read_text().splitlines()
    started = [line for line in lines if "trigger runner started" in line]
    assert len(started) == 1 and "uvloop" in started[0], started


def test_a_failing_trigger_fails_every_member_with_the_cause(stack: AirflowStack) -> None:
    dsn = stack.config.database_dsn
    bad = seed(stack, 6, FAILING, lambda i: {"target": "warehouse-db", "delay": 0.5})
    soon = in_seconds(3)
    good = seed(stack, 4, AT_TIME, lambda i: {"moment": soon})
    url = health_url(start(stack))

    wait_for(
        lambda: ti_states(dsn, bad.dag_id),
        lambda s: set(s.values()) == {"scheduled"},
        60,
        "every member of the failing group failed",
    )
    for value in next_kwargs(dsn, bad.dag_id).values():
        assert value["error"] == "Trigger failure"
        assert "boom: warehouse-db is unreachable" in "".join(value["traceback"])
    wait_for(
        lambda: ti_states(dsn, good.dag_id),
        lambda s: set(s.values()) == {"scheduled"},
        60,
        "the healthy group still resumed",
    )
    assert metrics(url)["smart_triggerer_failures_total"] == 6


def test_one_member_timing_out_leaves_the_others_waiting(stack: AirflowStack) -> None:
    dsn = stack.config.database_dsn
    later = in_seconds(600)
    seeded = seed(stack, 5, AT_TIME, lambda i: {"moment": later}, trigger_timeout=dt.timedelta(minutes=30))
    # due well after the instance has loaded all five (a start can take several seconds on a busy
    # machine; the timeout is read with the waiter, as deferral writes it once)
    rows(
        dsn,
        "UPDATE task_instance SET trigger_timeout = now() + interval '20 seconds' "
        "WHERE dag_id = %s AND map_index = 0 RETURNING 1",
        seeded.dag_id,
    )
    url = health_url(start(stack))
    wait_for(lambda: metrics(url), lambda m: m.get("smart_triggerer_waiters") == 5, 18, "5 waiters")

    states = wait_for(
        lambda: ti_states(dsn, seeded.dag_id), lambda s: s[0] == "scheduled", 45, "member 0 timed out"
    )
    assert [states[i] for i in range(1, 5)] == ["deferred"] * 4
    assert next_kwargs(dsn, seeded.dag_id)[0] == {"error": "Trigger timeout"}
    after = wait_for(
        lambda: metrics(url),
        lambda m: m.get("smart_triggerer_waiters") == 4,
        30,
        "the group shrank to 4",
        interval=0.5,
    )
    assert after["smart_triggerer_groups"] == 1 and after["smart_triggerer_coroutines"] == 1


def test_three_instances_own_disjoint_shards_covering_all(stack: AirflowStack) -> None:
    dsn = stack.config.database_dsn
    moments = [in_seconds(600 + k) for k in range(20)]
    seed(stack, 60, AT_TIME, lambda i: {"moment": moments[i % 20]})
    urls = [health_url(start(stack, f"smart-{n}")) for n in range(3)]

    def owners() -> dict[int, int | None]:
        return lease_owners(dsn)

    settled = wait_for(
        owners,
        lambda o: len(o) == SHARDS and None not in o.values() and len(set(o.values())) == 3,
        60,
        "3 instances owning all shards",
    )
    # each instance publishes its metrics at the end of its loop: one that just handed shards over may
    # still show them for a loop after the lease rows changed, so wait for the metrics to catch up
    per_instance = wait_for(
        lambda: [metrics(u) for u in urls],
        lambda ms: sum(m["smart_triggerer_shards_owned"] for m in ms) == SHARDS,
        15,
        "metrics owning all shards once",
    )
    assert all(m["smart_triggerer_shards_owned"] >= 1 for m in per_instance)
    total = wait_for(
        lambda: [metrics(u) for u in urls],
        lambda ms: sum(m["smart_triggerer_waiters"] for m in ms) == 60,
        30,
        "60 waiters",
    )
    assert sum(m["smart_triggerer_groups"] for m in total) == 20
    assert len(settled) == SHARDS


def _owned_by(dsn: str, job_ids: set[int]) -> bool:
    owners = lease_owners(dsn)
    return len(owners) == SHARDS and set(owners.values()) <= job_ids


def _job_of(url: str) -> int:
    # the endpoint listens before the supervisor has started (it answers 503 without a job id until then)
    body = wait_for(
        lambda: httpx.get(f"{url}/health", timeout=5).json(),
        lambda b: "job_id" in b,
        30,
        "the instance's job id",
    )
    return int(body["job_id"])


@pytest.mark.alone  # asserts a time bound (2.3 s after a SIGTERM): no other test's stack beside it
@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_takeover_after_crash_and_graceful_stop(stack: AirflowStack, how: str, tmp_path: Path) -> None:
    dsn = stack.config.database_dsn
    rows(dsn, AUDIT_DDL + "; SELECT 1")  # every write of a task instance leaving DEFERRED
    flag = tmp_path / "go"
    seeded = seed(stack, 40, FLAG_FILE, lambda i: {"key": f"k{i % 8}", "flag": str(flag)})
    components = [start(stack, f"smart-{n}") for n in range(3)]
    urls = [health_url(c) for c in components]
    jobs = [_job_of(u) for u in urls]
    wait_for(
        lambda: lease_owners(dsn),
        lambda o: None not in o.values() and len(set(o.values())) == 3,
        60,
        "3 owners",
    )
    victim, survivors = components[0], set(jobs[1:])

    started = time.monotonic()
    os.killpg(victim.pid, getattr(signal, how))
    wait_for(lambda: _owned_by(dsn, survivors), bool, LEASE + 10, f"takeover after {how}", interval=0.05)
    took = time.monotonic() - started
    # lease + 2 loops after a crash, 2 s after a graceful stop; 0.3 s for this test's own polling
    limit = (LEASE + 2 * 1.0 if how == "SIGKILL" else 2.0) + 0.3
    print(f"takeover after {how}: {took:.2f}s")
    assert took <= limit, f"takeover after {how} took {took:.1f}s (limit {limit:.1f}s)"

    total = wait_for(
        lambda: [metrics(u) for u in urls[1:]],
        lambda ms: sum(m["smart_triggerer_waiters"] for m in ms) == 40,
        30,
        "survivors run every waiter",
    )
    assert sum(m["smart_triggerer_groups"] for m in total) == 8
    assert set(ti_states(dsn, seeded.dag_id).values()) == {"deferred"}
    if how == "SIGTERM":
        assert victim.process is not None and victim.process.wait(15) == 0
    # the waits resume after the takeover, each task written out of DEFERRED once
    flag.touch()
    wait_for(
        lambda: ti_states(dsn, seeded.dag_id),
        lambda s: set(s.values()) == {"scheduled"},
        60,
        "every wait resumed by the survivors",
    )
    resolved = Counter(
        ti for ti, op in rows(dsn, "SELECT ti_id::text, op FROM chaos.ti_audit WHERE op = 'resolved'")
    )
    assert len(resolved) == 40 and set(resolved.values()) == {1}, resolved


def test_database_outage_is_survived_without_restart(stack: AirflowStack) -> None:
    dsn = stack.config.database_dsn
    dbname = dsn.rsplit("/", 1)[1]
    soon = in_seconds(25)
    seeded = seed(stack, 6, AT_TIME, lambda i: {"moment": soon})
    component = start(stack)
    url = health_url(component)
    wait_for(lambda: metrics(url), lambda m: m.get("smart_triggerer_waiters") == 6, 30, "6 waiters")

    admin = dsn.rsplit("/", 1)[0] + "/postgres"
    rows(admin, f'ALTER DATABASE "{dbname}" ALLOW_CONNECTIONS false; SELECT 1')
    rows(admin, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", dbname)
    try:
        down = wait_for(
            lambda: httpx.get(f"{url}/health", timeout=5),
            lambda r: r.status_code == 503,
            LEASE + 10,
            "/health to report the outage",
        )
        assert down.json()["shards_owned"] == 0  # stopped running shards before the leases could expire
    finally:
        rows(admin, f'ALTER DATABASE "{dbname}" ALLOW_CONNECTIONS true; SELECT 1')

    wait_for(
        lambda: httpx.get(f"{url}/health", timeout=5),
        lambda r: r.status_code == 200,
        30,
        "/health to recover",
    )
    wait_for(
        lambda: ti_states(dsn, seeded.dag_id),
        lambda s: set(s.values()) == {"scheduled"},
        60,
        "waiters resumed after the outage",
    )
    assert component.running()


def test_unimportable_or_undecryptable_triggers_fail_alone(stack: AirflowStack) -> None:
    dsn = stack.config.database_dsn
    missing = seed(stack, 3, "no_such_module.GoneTrigger", lambda i: {"x": i})
    soon = in_seconds(5)
    garbled = seed(stack, 2, AT_TIME, lambda i: {"moment": soon})
    rows(
        dsn,
        "UPDATE trigger SET kwargs = 'gAAAAABnot-a-fernet-token' WHERE id = ANY(%s) RETURNING 1",
        garbled.trigger_ids,
    )
    healthy = seed(stack, 4, AT_TIME, lambda i: {"moment": soon})
    component = start(stack)

    for broken in (missing, garbled):
        wait_for(
            lambda b=broken: ti_states(dsn, b.dag_id),  # type: ignore[misc]  # no lambda with a default
            lambda s: set(s.values()) == {"scheduled"},
            60,
            f"{broken.dag_id} failed",
        )
    for value in next_kwargs(dsn, missing.dag_id).values():
        assert "no_such_module" in "".join(value["traceback"])
    for value in next_kwargs(dsn, garbled.dag_id).values():
        text = "".join(value["traceback"])
        assert "could not read the kwargs" in text and "not-a-fernet-token" not in text
    wait_for(
        lambda: ti_states(dsn, healthy.dag_id),
        lambda s: set(s.values()) == {"scheduled"},
        60,
        "healthy waiters resumed",
    )
    assert all("event" in v for v in next_kwargs(dsn, healthy.dag_id).values())
    assert component.running()


def test_handover_never_calls_on_kill_but_user_action_does(stack: AirflowStack, tmp_path: Path) -> None:
    dsn = stack.config.database_dsn
    markers = tmp_path / "markers"
    markers.mkdir()
    # One group in every shard, so whichever shards the second instance takes, groups are handed over to it
    keys = keys_per_shard(lambda key: KillMarkerTrigger(key, str(markers)), SHARDS)
    shared = seed(
        stack,
        2 * SHARDS,
        "tests.helpers.triggers.KillMarkerTrigger",
        lambda i: {"key": keys[i % SHARDS], "marker_dir": str(markers)},
    )
    lone = seed(
        stack,
        2,
        "tests.helpers.triggers.LoneKillMarkerTrigger",
        lambda i: {"key": f"lone{i}", "marker_dir": str(markers)},
    )
    running = SHARDS + 2
    first = health_url(start(stack, "smart-a"))
    wait_for(
        lambda: metrics(first),
        lambda m: m.get("smart_triggerer_coroutines") == running,
        30,
        f"{SHARDS} groups + 2 lone triggers running",
    )

    second = health_url(start(stack, "smart-b"))
    # settled: each instance runs exactly its groups' coroutines (none still being started or cancelled)
    both = wait_for(
        lambda: [metrics(first), metrics(second)],
        lambda ms: (
            all(m.get("smart_triggerer_shards_owned", 0) > 0 for m in ms)
            and sum(m["smart_triggerer_waiters"] for m in ms) == 2 * SHARDS + 2
            and sum(m["smart_triggerer_coroutines"] for m in ms) == running
            and all(m["smart_triggerer_coroutines"] == m["smart_triggerer_groups"] for m in ms)
            and ms[1]["smart_triggerer_groups"] > 0
        ),
        40,
        "shards split over two",
    )
    assert both[0]["smart_triggerer_shards_owned"] + both[1]["smart_triggerer_shards_owned"] == SHARDS
    # Every coroutine counted once over both: the first instance's handed-over ones have ended, and a cancel
    # calls on_kill (if it does) before its coroutine ends; so no marker now means none was written
    assert both[1]["smart_triggerer_coroutines"] > 0
    assert list(markers.iterdir()) == [], "a shard handover called on_kill"
    assert set(ti_states(dsn, shared.dag_id).values()) == {"deferred"}

    # A user marks one lone task failed: its own trigger is cancelled as a user action (on_kill).
    rows(
        dsn,
        "UPDATE task_instance SET state = 'failed' WHERE dag_id = %s AND map_index = 0 RETURNING 1",
        lone.dag_id,
    )
    found = wait_for(
        lambda: sorted(p.name for p in markers.iterdir()),
        lambda names: len(names) == 1,
        30,
        "on_kill of the task the user acted on",
    )
    assert found[0].startswith("on_kill-lone0-")


def test_events_for_just_deferred_members_are_held_back(stack: AirflowStack) -> None:
    """The guard against Airflow 3.3.2 failing tasks resumed within ~5 s of deferral (#71580 family)."""
    dsn = stack.config.database_dsn
    past = in_seconds(-60)
    seeded = seed(stack, 5, AT_TIME, lambda i: {"moment": past})
    created = rows(dsn, "SELECT min(created_date) FROM trigger WHERE id = ANY(%s)", seeded.trigger_ids)[0][0]
    start(stack, RESUME_HOLD_SECONDS="8")

    wait_for(
        lambda: ti_states(dsn, seeded.dag_id),
        lambda s: set(s.values()) == {"scheduled"},
        60,
        "held waiters resumed",
    )
    resumed_at = rows(dsn, "SELECT min(scheduled_dttm) FROM task_instance WHERE dag_id = %s", seeded.dag_id)
    assert (resumed_at[0][0] - created).total_seconds() >= 8.0


def test_a_more_demanding_newcomer_restarts_the_group_with_its_setting(stack: AirflowStack) -> None:
    dsn = stack.config.database_dsn
    moment = in_seconds(12)
    slow = seed(stack, 3, AT_TIME, lambda i: {"moment": moment, "poll_interval": 120.0})
    url = health_url(start(stack))
    wait_for(
        lambda: metrics(url), lambda m: m.get("smart_triggerer_coroutines") == 1, 30, "the slow group running"
    )

    fast = seed(stack, 1, AT_TIME, lambda i: {"moment": moment, "poll_interval": 0.2})
    both = wait_for(
        lambda: ti_states(dsn, slow.dag_id) | {9: ti_states(dsn, fast.dag_id)[0]},
        lambda s: set(s.values()) == {"scheduled"},
        40,
        "the whole group resumed",
    )
    assert len(both) == 4
    resumed = rows(
        dsn,
        "SELECT max(scheduled_dttm) FROM task_instance WHERE dag_id IN (%s, %s)",
        slow.dag_id,
        fast.dag_id,
    )[0][0]
    # With the members' 120 s interval the group would have fired minutes late.
    assert (resumed - dt.datetime.fromisoformat(moment)).total_seconds() < 5
    assert metrics(url)["smart_triggerer_groups"] == 0


def test_queue_sets_own_disjoint_shard_spaces(stack: AirflowStack) -> None:
    """Issue 11.6: instances with different --queues each run only their own queues' triggers."""
    dsn = stack.config.database_dsn
    later = in_seconds(600)
    queued = seed(stack, 6, AT_TIME, lambda i: {"moment": later, "poll_interval": 5.0})
    plain = seed(stack, 4, AT_TIME, lambda i: {"moment": later})
    rows(dsn, "UPDATE trigger SET queue = 'reports' WHERE id = ANY(%s) RETURNING 1", queued.trigger_ids)
    on_queue = health_url(stack.start_smart_triggerer("smart-reports", env=ENV, queues="reports"))
    default = health_url(start(stack, "smart-default"))
    settled = wait_for(
        lambda: (metrics(on_queue), metrics(default)),
        lambda ms: ms[0].get("smart_triggerer_waiters") == 6 and ms[1].get("smart_triggerer_waiters") == 4,
        40,
        "each instance runs its own queue",
    )
    assert settled[0]["smart_triggerer_shards_owned"] == SHARDS
    assert settled[1]["smart_triggerer_shards_owned"] == SHARDS
    owners = rows(
        dsn,
        "SELECT t.queue, t.triggerer_id FROM trigger t WHERE t.id = ANY(%s)",
        queued.trigger_ids + plain.trigger_ids,
    )
    by_queue = {queue: {job for q, job in owners if q == queue} for queue, _ in owners}
    assert by_queue["reports"] == {_job_of(on_queue)} and by_queue[None] == {_job_of(default)}


def test_overlapping_queue_sets_are_refused(stack: AirflowStack) -> None:
    first = stack.start_smart_triggerer("smart-ab", env=ENV, queues="a,b")
    health_url(first)
    second = stack.start_smart_triggerer("smart-bc", env=ENV, queues="b,c")
    assert second.process is not None and second.process.wait(60) == 2
    assert "overlaps a live instance's --queues a,b" in second.log_tail()


def test_an_instance_with_another_lease_is_refused_naming_both(stack: AirflowStack) -> None:
    """Peers judge each other's membership by their own lease: a fleet must agree on lease_seconds."""
    first = start(stack, "smart-8")
    health_url(first)
    second = start(stack, "smart-30", LEASE_SECONDS="30")
    assert second.process is not None and second.process.wait(60) == 2
    said = [line for line in second.log_tail().splitlines() if "lease_seconds is 30 here" in line]
    assert len(said) == 1 and f"but {LEASE:g} on the live instances" in said[0], second.log_tail()
    assert first.running()


def test_the_supervisor_never_imports_trigger_code(stack: AirflowStack, tmp_path: Path) -> None:
    """Issue 11.8: identities come from the serialized kwargs; only the runner subprocess imports."""
    marker = tmp_path / "imports"
    seed(stack, 4, "tests.helpers.import_marker.MarkerTrigger", lambda i: {"key": f"k{i % 2}"})
    component = stack.start_smart_triggerer(env={**ENV, "SMART_TRIGGERER_IMPORT_MARKER": str(marker)})
    url = health_url(component)
    ran = wait_for(
        lambda: metrics(url),
        lambda m: m.get("smart_triggerer_coroutines") == 2,
        30,
        "two groups of two running",
    )
    assert ran["smart_triggerer_waiters"] == 4
    importers = {int(line) for line in marker.read_text().split()}
    runner_pids = {p.pid for p in component.tree()} - {component.pid}
    assert importers and importers <= runner_pids, (importers, component.pid, runner_pids)


def test_a_push_member_joining_a_polling_group_is_woken_by_notify(stack: AirflowStack) -> None:
    """Issue 11.1: a waiter with notify_channel joins a group a poll-only waiter started (300 s polls)."""
    dsn = stack.config.database_dsn
    rows(
        dsn,
        "CREATE SCHEMA meta; CREATE TABLE meta.detail_process_table_status (id serial PRIMARY KEY, "
        "table_name text, status text, created_dttm timestamptz DEFAULT now()); SELECT 1",
    )
    env = {"AIRFLOW_CONN_WH": dsn}
    table_load = "triggers.table_load.TableLoadTrigger"
    polling = seed(
        stack,
        2,
        table_load,
        lambda i: {"conn_id": "wh", "required_tables": ["dds.user"], "poll_interval": 300.0},
    )
    url = health_url(stack.start_smart_triggerer(env={**ENV, **env}))
    wait_for(lambda: metrics(url), lambda m: m.get("smart_triggerer_coroutines") == 1, 30, "polling group")
    pushed = seed(
        stack,
        1,
        table_load,
        lambda i: {
            "conn_id": "wh",
            "required_tables": ["dds.user"],
            "poll_interval": 300.0,
            "notify_channel": "loads",
        },
    )
    wait_for(lambda: metrics(url), lambda m: m.get("smart_triggerer_waiters") == 3, 30, "the push member")
    # The restarted coroutine LISTENs, then checks: once a check ran after the LISTEN, only the NOTIFY can
    # wake it within 300 s (a broken LISTEN fails here, or at the bound below).
    listening = wait_for(
        lambda: rows(
            dsn, "SELECT max(query_start) FROM pg_stat_activity WHERE query ILIKE 'LISTEN %%loads%%'"
        ),
        lambda r: r[0][0] is not None,
        30,
        "the push member's LISTEN",
    )[0][0]
    # (a check returns its pooled connection, which asyncpg resets: the reset is its last query)
    wait_for(
        lambda: rows(
            dsn,
            "SELECT count(*) FROM pg_stat_activity WHERE state = 'idle' "
            "AND query ILIKE '%%RESET ALL%%' AND query_start > %s",
            listening,
        ),
        lambda r: r[0][0] > 0,
        30,
        "the group's first check after its LISTEN",
    )
    rows(
        dsn,
        "INSERT INTO meta.detail_process_table_status (table_name, status) VALUES ('dds.user', "
        "'SUCCESS'); NOTIFY loads; SELECT 1",
    )
    flipped = time.monotonic()
    for seeded in (polling, pushed):
        wait_for(
            lambda s=seeded: ti_states(dsn, s.dag_id),  # type: ignore[misc]  # no lambda with a default
            lambda s: set(s.values()) == {"scheduled"},
            20,
            "resumed by the NOTIFY, not the 300 s poll",
        )
    assert time.monotonic() - flipped < 10


FD_LIMIT = 200
# runs the command after it under RLIMIT_NOFILE = argv[1] (soft and hard: the process cannot raise it)
LIMITED = (
    "import os, resource, sys; n = int(sys.argv[1]); "
    "resource.setrlimit(resource.RLIMIT_NOFILE, (n, n)); os.execv(sys.argv[2], sys.argv[2:])"
)


def open_trigger_logs(pid: int) -> int:
    """Trigger log files the process holds open now."""
    return sum(".log.trigger." in target for target in descriptors(pid).values())


def test_more_coroutines_than_open_files_allowed(stack: AirflowStack) -> None:
    """Airflow keeps each running trigger's log file open; an instance running more coroutines than its
    RLIMIT_NOFILE allows (a survivor that took over a dead peer's shards) died of "Too many open files".
    Here 400 coroutines run, log and fire under a limit of 200 descriptors."""
    dsn = stack.config.database_dsn
    count = 2 * FD_LIMIT
    command = [
        str(Path(sys.executable).with_name("smart-triggerer")),
        "run",
        "--skip-serve-logs",
        "--health-port",
        "0",
    ]
    instance = stack.add("smart-limited", [sys.executable, "-c", LIMITED, str(FD_LIMIT), *command], ENV)
    url = health_url(instance)
    wait_for(
        lambda: metrics(url),
        lambda m: m.get("smart_triggerer_shards_owned") == SHARDS,
        30,
        "every shard owned",
    )
    # waiters arrive at a running instance (as in a takeover); they fire when the flag is set, below
    flag = stack.config.home / "fire"
    seeded = seed(
        stack, count, FLAG_FILE, lambda i: {"key": f"w{i}", "flag": str(flag), "poll_interval": 1.0}
    )

    running = wait_for(
        lambda: metrics(url),
        lambda m: m.get("smart_triggerer_coroutines") == count,
        30,
        f"{count} coroutines running",
    )
    assert running["smart_triggerer_groups"] == count
    logs_dir = stack.config.home / "logs"
    began = time.monotonic()
    wait_for(
        lambda: len(list(logs_dir.rglob("*.trigger.*.log"))),
        lambda n: n == count,
        20,
        "every coroutine's log file written",
    )
    print(f"\nevery log file written {time.monotonic() - began:.1f}s after all {count} coroutines ran")
    held = open_trigger_logs(instance.pid)
    assert 0 < held <= FD_LIMIT // 4, held

    flag.touch()  # every coroutine started and logged: now all fire, and log again
    wait_for(
        lambda: ti_states(dsn, seeded.dag_id),
        lambda s: set(s.values()) == {"scheduled"},
        60,
        "every waiter resumed",
    )
    assert instance.running(), instance.log_tail()
    assert "Too many open files" not in instance.log_path.read_text()
    # A file closed to make room is appended to when its trigger writes again: no line is lost.
    texts = wait_for(
        lambda: [log.read_text() for log in logs_dir.rglob("*.trigger.*.log")],
        lambda t: all("Trigger fired event" in text for text in t),
        30,
        "fired lines written",
    )
    assert len(texts) == count
    assert all(text.count("starting") == 1 for text in texts)
    assert open_trigger_logs(instance.pid) <= FD_LIMIT // 4
