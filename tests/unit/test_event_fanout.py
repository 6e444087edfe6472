"""The events part (``smart_triggerer/supervisor/events.py``) as itself, built from a shared context and a
stand-in for the instance (Airflow's queues of the runner's events): transactions bounded by the members
they resume, young members told apart, and orphaned events put back in front once their group is back."""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from airflow.jobs.triggerer_job_runner import TriggerEventEntry
from airflow.triggers.base import TriggerEvent

from smart_triggerer.config import Settings
from smart_triggerer.supervisor.events import EventFanout
from smart_triggerer.supervisor.shared import MemberInfo, Shared


class Instance:
    def __init__(self) -> None:
        self.events: deque[TriggerEventEntry] = deque()
        self.failed_triggers: deque[Any] = deque()
        self.persisted_event_seqs: deque[int] = deque()
        self.alive: set[int] = set()
        self.changes = 0

    def alive_coroutines(self) -> set[int]:
        return self.alive

    def runner_changed(self) -> None:
        self.changes += 1

    def guard_leases(self) -> None: ...

    def step_failed(self, name: str, err: Exception) -> None: ...


def entry(runner_id: int) -> TriggerEventEntry:
    return TriggerEventEntry(
        trigger_id=runner_id, event=TriggerEvent({"n": runner_id}), persist_seq=runner_id
    )


def part(groups: dict[int, int]) -> tuple[EventFanout, Instance]:
    """Groups of ``members`` each, run by coroutine ``runner``: {runner: members}."""
    shared = Shared(settings=Settings(max_resumes_per_transaction=10), capacity=1000)
    for runner, members in groups.items():
        for m in range(members):
            trigger_id = runner * 1000 + m
            shared.member_info[trigger_id] = MemberInfo(shard=0, has_task=True, dedupable=True)
            shared.groups.join(trigger_id, runner)
        group = shared.groups.by_hash[runner]
        shared.groups.start(group)
    instance = Instance()
    return EventFanout(shared, instance), instance


def runner_of(fanout: EventFanout, identity: int) -> int:
    runner = fanout.shared.groups.by_hash[identity].runner_id
    assert runner is not None
    return runner


def test_a_transaction_resumes_at_most_its_share_of_members_but_at_least_one_event() -> None:
    fanout, instance = part({1: 6, 2: 6, 3: 30})
    instance.events.extend(entry(runner_of(fanout, h)) for h in (1, 2, 3))
    assert [e.trigger_id for e in fanout._front_chunk()] == [runner_of(fanout, 1)]  # 6 + 6 > 10
    instance.events.popleft()
    instance.events.popleft()
    assert [e.trigger_id for e in fanout._front_chunk()] == [runner_of(fanout, 3)]  # alone, though 30


def test_young_members_are_told_apart_from_those_ready() -> None:
    fanout, _ = part({1: 3})
    now = time.monotonic()
    fanout.shared.young_until[1001] = now + 5
    ready, young = fanout._split_by_age([1000, 1001, 1002], now)
    assert (ready, young) == ([1000, 1002], [1001])


def test_orphans_go_back_in_front_when_their_group_is_back_and_are_dropped_when_their_coroutine_is_gone() -> (
    None
):
    fanout, instance = part({1: 2})
    back = entry(runner_of(fanout, 1))
    waiting, gone = entry(99_001), entry(99_002)
    instance.alive = {99_001}
    fanout.orphans = [back, waiting, gone]
    instance.events.append(entry(runner_of(fanout, 1)))
    fanout._adopt_orphans()
    assert instance.events[0] is back and len(instance.events) == 2
    assert fanout.orphans == [waiting] and instance.changes == 1
