"""A runner whose event loop is wedged gets its instance out of the fleet, on real processes.

Two ways to wedge it: a trigger that calls ``time.sleep`` in its coroutine (the whole event loop waits
in it), and SIGSTOP of the runner process alone (its supervisor goes on). Either way the instance must hand
every shard over within ``runner_stall_seconds`` plus a lease, also when every instance is full (then the
peer runs what its capacity allows, most urgent first, and the rest as room frees: capacity is a cap),
say why on ``/health`` (503), and take shards again once its runner answers. What is checked is what the
database holds: each wait's polls (``poll_trail``: the polling process's pid), the leases, and each task
resumed once (the audit trigger on ``task_instance``).
"""

from __future__ import annotations

import os
import signal
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from devkit.devstack import AirflowStack, Component
from tests.helpers.chaos.databases import AUDIT_DDL
from tests.helpers.triggers import POLL_TRAIL_DDL
from tests.helpers.waiting import rows, ti_states, wait_for
from tests.integration.test_smart_triggerer import LEASE, metrics, seed

POLL_TRAIL = "tests.helpers.triggers.PollTrailTrigger"
STALL = 4.0  # runner_stall_seconds in these tests (the default is three leases)
WAITS = 12


@pytest.fixture
def trail(airflow_stack: AirflowStack) -> Iterator[AirflowStack]:
    rows(airflow_stack.config.database_dsn, AUDIT_DDL + POLL_TRAIL_DDL + "; SELECT 1")
    yield airflow_stack


def runner_of(instance: Component) -> psutil.Process:
    """The runner subprocess: the supervisor's forked child."""
    children = wait_for(lambda: psutil.Process(instance.pid).children(), bool, 60, "the runner process")
    assert len(children) == 1, children
    return children[0]


def health(instance: Component) -> tuple[int, dict[str, object]]:
    reply = httpx.get(f"{instance.health_url(30)}/health", timeout=5)
    return reply.status_code, reply.json()


def polling_pids(dsn: str, since: float) -> dict[str, set[int]]:
    """Per key, the processes that polled it after ``since`` (epoch seconds, the database clock)."""
    found: dict[str, set[int]] = {}
    for key, pid in rows(dsn, "SELECT key, pid FROM poll_trail WHERE at > to_timestamp(%s)", since):
        found.setdefault(key, set()).add(pid)
    return found


def db_now(dsn: str) -> float:
    return float(rows(dsn, "SELECT extract(epoch FROM clock_timestamp())")[0][0])


def runs_some(dsn: str, runner: psutil.Process) -> bool:
    return bool(
        rows(
            dsn,
            "SELECT 1 FROM poll_trail WHERE pid = %s AND at > clock_timestamp() - interval '2 seconds'",
            runner.pid,
        )
    )


def start_fleet(stack: AirflowStack, capacity: int | None, tmp_path: Path) -> tuple[list[Component], Path]:
    dsn = stack.config.database_dsn
    flag = tmp_path / "block"
    keys = [f"w{i}" for i in range(WAITS)]
    seed(
        stack,
        WAITS,
        POLL_TRAIL,
        lambda i: {"dsn": dsn, "key": keys[i], "block_flag": str(flag), "poll_interval": 0.5},
    )
    fleet = [
        stack.start_smart_triggerer(name, capacity=capacity, env=_env()) for name in ("smart-a", "smart-b")
    ]
    urls = [instance.health_url(30) for instance in fleet]

    def polling_and_runnable() -> tuple[int, int, int]:
        """Waits polling now, waits the instances hold, and those their capacities let them run."""
        held = [int(metrics(url)["smart_triggerer_waiters"]) for url in urls]
        runnable = sum(held) if capacity is None else sum(min(h, capacity) for h in held)
        return len(polling_pids(dsn, db_now(dsn) - 1.5)), sum(held), runnable

    wait_for(
        polling_and_runnable,
        lambda r: r[1] == WAITS and r[0] == r[2],
        90,
        "every wait held, and polling where its instance has room",
    )
    for instance in fleet:  # both run some, so that either may be the victim
        runner = runner_of(instance)
        wait_for(lambda: runs_some(dsn, runner), bool, 60, f"{instance.name} runs waits")  # noqa: B023
    return fleet, flag


def _env() -> dict[str, str]:
    from tests.integration.test_smart_triggerer import ENV

    # the stall watch alone moves the waits here: the lag filter (its own tests: test_placement_load) sheds
    # shards of an instance whose loop lags, which a blocked loop does, and so does a loaded CI host, where
    # it kept shards moving while the fleet was still to settle before the wedge
    return {
        **ENV,
        "AIRFLOW__SMART_TRIGGERER__RUNNER_STALL_SECONDS": str(STALL),
        "AIRFLOW__SMART_TRIGGERER__MAX_LOOP_LAG_MS": "0",
    }


def check_handed_over(
    dsn: str, victim: Component, peer: Component, wedged_at: float, capacity: int | None = None
) -> None:
    """Within the stall threshold plus a lease of the wedge, the peer leases every shard and holds every
    wait, and every wait polls on it (when the fleet is full: the peer, at its capacity already, holds
    the victim's waits and runs them as room frees); the victim's /health says why."""
    peer_pid = runner_of(peer).pid
    peer_url = peer.health_url(30)
    limit = STALL + LEASE + 1.0  # one loop of slack for the peer's claim and the first poll
    try:
        wait_for(
            lambda: metrics(peer_url)["smart_triggerer_waiters"],
            lambda n: n == WAITS,
            limit + 20,
            "the peer holds every wait",
        )
    except AssertionError as err:  # say where each wait is: its shard, the lease owner, its task state
        dump = rows(
            dsn,
            "SELECT t.id, i.shard, l.owner_job_id, ti.state, ti.map_index FROM trigger t "
            "JOIN task_instance ti ON ti.trigger_id = t.id "
            "LEFT JOIN smart_triggerer.trigger_identity i ON i.trigger_id = t.id "
            "LEFT JOIN smart_triggerer.shard_lease l ON l.shard = i.shard ORDER BY t.id",
        )
        raise AssertionError(f"{err}; {dump}; {metrics(peer_url)}") from err
    took = db_now(dsn) - wedged_at
    assert took <= limit, f"the peer held every wait {took:.1f} s after the wedge (limit {limit} s)"
    # waited for, not asserted at once: the peer may hold every wait a moment before its claim of the
    # shards without any commits (with the lag filter on, as in a deployment, the victim also sheds the
    # shards with waits before it steps out)
    peer_job = health(peer)[1]["job_id"]
    wait_for(
        lambda: rows(
            dsn,
            "SELECT shard, owner_job_id, expires_at > clock_timestamp() FROM "
            "smart_triggerer.shard_lease ORDER BY shard",
        ),
        lambda leases: {owner for _, owner, live in leases if live} == {peer_job},
        limit + 20,
        "the peer leases every shard",
    )
    took = db_now(dsn) - wedged_at
    assert took <= limit, f"the peer leased every shard {took:.1f} s after the wedge (limit {limit} s)"
    if capacity is None:
        wait_for(
            lambda: polling_pids(dsn, wedged_at),
            lambda p: all(peer_pid in p.get(f"w{i}", ()) for i in range(WAITS)),
            limit + 20,
            "every wait polling on the peer",
        )
        first = dict(
            rows(
                dsn,
                "SELECT key, extract(epoch FROM min(at)) FROM poll_trail WHERE pid = %s "
                "AND at > to_timestamp(%s) GROUP BY key",
                peer_pid,
                wedged_at,
            )
        )
        late = {
            key: round(float(at) - wedged_at, 1) for key, at in first.items() if float(at) - wedged_at > limit
        }
        assert not late and len(first) == WAITS, f"polled again later than {limit} s: {late}, {first}"
    else:
        held = metrics(peer_url)
        assert held["smart_triggerer_coroutines"] <= capacity, held
        assert held["smart_triggerer_waiting_for_room"] == WAITS - capacity, held
    status, body = health(victim)
    assert status == 503 and "has not answered" in str(body["runner_stalled"]), body


def check_back_and_resumed_once(dsn: str, victim: Component, dag_id: str) -> None:
    wait_for(lambda: health(victim), lambda h: h[0] == 200, 60, "the victim healthy again")
    job = health(victim)[1]["job_id"]
    wait_for(
        lambda: rows(dsn, "SELECT count(*) FROM smart_triggerer.shard_lease WHERE owner_job_id = %s", job)[0][
            0
        ],
        bool,
        60,
        "the victim takes shards again",
    )
    for i in range(WAITS):
        rows(dsn, "INSERT INTO poll_release VALUES (%s) RETURNING 1", f"w{i}")
    wait_for(
        lambda: ti_states(dsn, dag_id), lambda s: set(s.values()) == {"scheduled"}, 90, "every task resumed"
    )
    resolved = Counter(
        ti for ti, op in rows(dsn, "SELECT ti_id::text, op FROM chaos.ti_audit WHERE op = 'resolved'")
    )
    assert len(resolved) == WAITS and set(resolved.values()) == {1}, resolved


def victim_of(fleet: list[Component], pid: int) -> tuple[Component, Component]:
    """The instance whose runner is ``pid``, and the other."""
    by_runner = {runner_of(instance).pid: instance for instance in fleet}
    victim = by_runner[pid]
    return victim, next(i for i in fleet if i is not victim)


@pytest.mark.parametrize("capacity", [None, 5], ids=["room", "fleet-full"])
def test_a_trigger_blocking_the_loop_hands_every_wait_to_a_peer(
    trail: AirflowStack, tmp_path: Path, capacity: int | None
) -> None:
    dsn = trail.config.database_dsn
    fleet, flag = start_fleet(trail, capacity, tmp_path)
    dag_id = rows(dsn, "SELECT DISTINCT dag_id FROM task_instance")[0][0]
    wedged_at = db_now(dsn)
    flag.write_text("block")  # the first coroutine to poll next blocks its runner's event loop
    taken = Path(f"{flag}.taken")
    pid = wait_for(lambda: taken.exists() and taken.read_text(), bool, 30, "a coroutine blocks its loop")
    victim, peer = victim_of(fleet, int(pid))
    check_handed_over(dsn, victim, peer, wedged_at, capacity)
    named = victim.wait_for_log("event loop is blocked")
    assert "holder_trigger_id=" in named and "holder_task=" in named, named
    Path(f"{flag}.end").write_text("end")  # the blocking call returns: the runner answers again
    check_back_and_resumed_once(dsn, victim, dag_id)


def test_a_stopped_runner_process_hands_every_wait_to_a_peer(trail: AirflowStack, tmp_path: Path) -> None:
    dsn = trail.config.database_dsn
    fleet, _ = start_fleet(trail, None, tmp_path)
    dag_id = rows(dsn, "SELECT DISTINCT dag_id FROM task_instance")[0][0]
    victim, peer = fleet
    runner = runner_of(victim)
    wedged_at = db_now(dsn)
    os.kill(runner.pid, signal.SIGSTOP)  # the runner alone: its supervisor goes on
    try:
        check_handed_over(dsn, victim, peer, wedged_at)
        named = victim.wait_for_log("event loop is blocked")
        assert "stopped (SIGSTOP)" in named, named
    finally:
        os.kill(runner.pid, signal.SIGCONT)
    check_back_and_resumed_once(dsn, victim, dag_id)
