"""Events whose source hands them out once survive handovers and graceful stops, on real processes.

``ConsumeOnceTrigger`` takes its message from a queue table: an event dropped after it fired (held for a
young member, in flight while a shard was handed over, queued in a stopping runner) is lost for good, and
its task never resumes. What is checked is what the database holds: every task resumed exactly once (an
audit trigger on ``task_instance``), with its own message, and no coroutine started twice.
"""

from __future__ import annotations

import json
import signal
import threading
from collections import Counter
from collections.abc import Iterator

import pytest

from devkit.devstack import AirflowStack, Component
from tests.helpers.chaos.databases import AUDIT_DDL
from tests.helpers.triggers import CONSUME_DDL
from tests.helpers.waiting import rows, ti_states, wait_for
from tests.integration.test_smart_triggerer import seed, start

CONSUME_ONCE = "tests.helpers.triggers.ConsumeOnceTrigger"


@pytest.fixture
def audited(airflow_stack: AirflowStack) -> Iterator[AirflowStack]:
    rows(airflow_stack.config.database_dsn, AUDIT_DDL + CONSUME_DDL + "; SELECT 1")
    yield airflow_stack


def stop_gracefully(instance: Component) -> None:
    instance.signal(signal.SIGTERM)  # the whole process group, runner included, as a service manager does
    assert instance.process is not None
    assert instance.process.wait(timeout=60) == 0, instance.log_tail()


def job_of(instance: Component) -> int:
    return int(instance.wait_for_log("smart triggerer started").split("job_id=")[1].split()[0])


def owns_shards(dsn: str, instance: Component) -> bool:
    return bool(
        rows(
            dsn,
            "SELECT 1 FROM smart_triggerer.shard_lease WHERE owner_job_id = %s "
            "AND expires_at > clock_timestamp()",
            job_of(instance),
        )
    )


def check_each_resumed_once_with_its_message(dsn: str, dag_id: str, keys: list[str]) -> Counter[str]:
    """Every task resumed once, with its own message, every message taken; returns starts per key."""
    wait_for(
        lambda: ti_states(dsn, dag_id), lambda s: set(s.values()) == {"scheduled"}, 90, "every task resumed"
    )
    found = rows(dsn, "SELECT map_index, next_kwargs FROM task_instance WHERE dag_id = %s", dag_id)
    from airflow.models.trigger import _decode_next_kwargs

    for map_index, stored in found:
        event = _decode_next_kwargs(json.loads(stored) if isinstance(stored, str) else stored)["event"]
        assert event == {"key": keys[map_index], "payload": f"message {keys[map_index]}"}, event
    resolved = Counter(
        ti for ti, op in rows(dsn, "SELECT ti_id::text, op FROM chaos.ti_audit WHERE op = 'resolved'")
    )
    assert len(resolved) == len(keys) and set(resolved.values()) == {1}, resolved
    starts = Counter(key for (key,) in rows(dsn, "SELECT key FROM consume_start"))
    assert rows(dsn, "SELECT count(*) FROM consumable") == [(0,)]
    return starts


def test_an_event_held_through_a_stop_and_a_join_resumes_once_without_firing_again(
    audited: AirflowStack,
) -> None:
    dsn = audited.config.database_dsn
    keys = [f"k{i}" for i in range(8)]
    seeded = seed(audited, len(keys), CONSUME_ONCE, lambda i: {"dsn": dsn, "key": keys[i]})
    first = start(audited, "smart-a", RESUME_HOLD_SECONDS="30")
    wait_for(
        lambda: rows(dsn, "SELECT count(*) FROM consume_start")[0][0],
        lambda n: n == len(keys),
        60,
        "every coroutine started",
    )
    for key in keys:
        rows(dsn, "INSERT INTO consumable VALUES (%s, %s) RETURNING 1", key, f"message {key}")
    wait_for(
        lambda: rows(dsn, "SELECT count(*) FROM smart_triggerer.held_event")[0][0],
        lambda n: n == len(keys),
        30,
        "every event held (the tasks deferred moments ago)",
    )
    stop_gracefully(first)

    second = start(audited, "smart-b", RESUME_HOLD_SECONDS="30")
    wait_for(lambda: owns_shards(dsn, second), bool, 60, "the second instance takes the shards")
    third = start(audited, "smart-c", RESUME_HOLD_SECONDS="30")  # a join: shards move again
    wait_for(lambda: owns_shards(dsn, third), bool, 60, "the joiner takes its share")
    held_on_joiner = rows(
        dsn,
        "SELECT count(*) FROM smart_triggerer.held_event h "
        "JOIN smart_triggerer.trigger_identity i ON i.trigger_id = h.trigger_id "
        "JOIN smart_triggerer.shard_lease l ON l.shard = i.shard AND l.queues = '' "
        "WHERE l.owner_job_id = %s",
        job_of(third),
    )[0][0]
    assert held_on_joiner > 0, "a held event moved with its shard to the joiner"

    starts = check_each_resumed_once_with_its_message(dsn, seeded.dag_id, keys)
    assert starts == dict.fromkeys(keys, 1), "no trigger was started (and fired) again"


@pytest.mark.parametrize("hold", ["0", "5"])
def test_events_consumed_once_survive_a_rolling_restart_of_the_fleet(
    audited: AirflowStack, hold: str
) -> None:
    """Two instances, each stopped (SIGTERM) and replaced in turn while messages keep arriving: events
    in flight, queued in a stopping runner, held (``hold`` > 0) or handed over on each join are all
    stored once."""
    dsn = audited.config.database_dsn
    keys = [f"r{i}" for i in range(24)]
    seeded = seed(audited, len(keys), CONSUME_ONCE, lambda i: {"dsn": dsn, "key": keys[i]})
    fleet = [start(audited, name, RESUME_HOLD_SECONDS=hold) for name in ("smart-a", "smart-b")]
    wait_for(
        lambda: rows(dsn, "SELECT count(DISTINCT key) FROM consume_start")[0][0],
        lambda n: n == len(keys),
        60,
        "every coroutine started",
    )
    for instance in fleet:  # one may have taken every shard while the other was still starting
        wait_for(lambda: owns_shards(dsn, instance), bool, 60, f"{instance.name} takes its share")  # noqa: B023
    done = threading.Event()

    def publish() -> None:
        for key in keys:
            if done.wait(0.4):
                return
            rows(dsn, "INSERT INTO consumable VALUES (%s, %s) RETURNING 1", key, f"message {key}")

    publisher = threading.Thread(target=publish, daemon=True)
    publisher.start()
    try:
        for index, name in enumerate(("smart-a2", "smart-b2")):
            stop_gracefully(fleet[index])
            fleet[index] = start(audited, name, RESUME_HOLD_SECONDS=hold)
            wait_for(lambda: owns_shards(dsn, fleet[index]), bool, 60, f"{name} takes its share")  # noqa: B023
        publisher.join(timeout=30)
    finally:
        done.set()
    assert not publisher.is_alive()
    check_each_resumed_once_with_its_message(dsn, seeded.dag_id, keys)
