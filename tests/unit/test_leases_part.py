"""The leases part (``smart_triggerer/supervisor/leases.py``) as itself, built from a shared context, the
parts it works with and a stand-in for the instance: what it does between its statements (the statements
themselves run against PostgreSQL in the integration tests): group counts published per shard only when
they moved enough, the next load brought forward to a peer's lapse, shards dropped with every waiter and
held event of theirs, and every shard stopped when a renewal falls due and fails."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from airflow.triggers.base import TriggerEvent

from smart_triggerer.config import Settings
from smart_triggerer.supervisor.deadlines import MemberDeadlines
from smart_triggerer.supervisor.feed import Feed
from smart_triggerer.supervisor.handover import Handover
from smart_triggerer.supervisor.leases import LAPSE_MARGIN_SECONDS, LOAD_STEP, Leases
from smart_triggerer.supervisor.load import LoadFilters
from smart_triggerer.supervisor.shared import Held, MemberInfo, Shared
from tests.helpers.parts import QuietInstance


class Instance(QuietInstance):
    """The conductor's answers to the leases and the parts they work with; a renewal's step recorded."""

    def __init__(self, renewal_fails: bool = False) -> None:
        super().__init__()
        self.renewal_fails = renewal_fails
        self.steps: list[str] = []

    def step_error(self) -> str | None:
        return "the database is away" if self.renewal_fails else None

    def db_step(self, name: str, step: Callable[[], None]) -> bool:
        self.steps.append(name)
        return not self.renewal_fails  # the renewal's statements are the integration tests'


def leases(instance: Instance, members: dict[int, int]) -> Leases:
    """A part over ``members`` (trigger id -> shard), each its own group, every shard of theirs owned."""
    shared = Shared(settings=Settings(lease_seconds=8.0), capacity=1000)
    for trigger_id, shard in members.items():
        shared.member_info[trigger_id] = MemberInfo(shard, has_task=True, dedupable=False)
        shared.groups.join(trigger_id, identity_hash=trigger_id)
    shared.owned = set(members.values())
    feed = Feed(shared, MemberDeadlines(shared), instance)
    handover = Handover(shared, instance)
    return Leases(shared, feed, handover, LoadFilters(shared, starting=lambda: False), instance)


def test_group_counts_are_published_per_shard_only_when_they_moved_enough() -> None:
    part = leases(Instance(), {t: t % 2 for t in range(10)})  # shards 0 and 1, five groups each
    part.feed.to_read = {1}  # not read in full yet: its count would say less than it holds
    assert part._loads_to_publish() == {0: 5}
    part.published_loads = {0: 5}
    assert part._loads_to_publish() == {}, "counted again within LOADS_EVERY_SECONDS"
    part.loads_counted_at = -math.inf
    part.feed.to_read = set()
    assert part._loads_to_publish() == {1: 5}, "shard 0 did not move"
    for trigger_id in range(10, 10 + LOAD_STEP):
        part.shared.member_info[trigger_id] = MemberInfo(0, has_task=True, dedupable=False)
        part.shared.groups.join(trigger_id, identity_hash=trigger_id)
    part.loads_counted_at = -math.inf
    assert part._loads_to_publish()[0] == 5 + LOAD_STEP


def test_the_next_load_is_brought_forward_to_a_peers_lapse_within_a_loop() -> None:
    instance = Instance()
    part = leases(instance, {})
    part._wake_at_lapse([5.0, part.settings.loop_seconds + 1])  # none lapses within a loop
    assert instance.load_due == math.inf
    before = time.monotonic()
    part._wake_at_lapse([0.4, 0.7, -1.0])  # one lapsed already: at once
    assert before + LAPSE_MARGIN_SECONDS <= instance.load_due <= time.monotonic() + LAPSE_MARGIN_SECONDS


def test_dropped_shards_forget_their_waiters_and_held_events_and_end_their_drain() -> None:
    instance = Instance()
    part = leases(instance, {1: 3, 2: 3, 3: 4})
    part.shared.held[2] = Held(TriggerEvent({"fired": True}), release_at=math.inf)
    for trigger_id in (1, 3):  # their coroutines run: the shards drain while those end
        part.shared.groups.start(part.shared.groups.by_hash[trigger_id])
        instance.alive.add(trigger_id)
    part.handover.leave({3, 4}, until=math.inf)
    part.drop({3})
    assert set(part.shared.member_info) == {3} and not part.shared.held
    assert set(part.handover.leaving) == {4}


def test_shards_a_fence_found_lapsed_are_dropped_and_left_unread_until_claimed_again() -> None:
    part = leases(Instance(), {1: 3, 2: 4})
    part.feed.to_read = {3}
    part.shared.lapsed = {3, 9}  # 9 is not ours: nothing to drop
    part.drop_lapsed()
    assert part.shared.owned == {4} and set(part.shared.member_info) == {2}
    assert part.feed.to_read == set() and part.shared.lapsed == set()


def test_every_shard_stops_when_a_renewal_falls_due_and_fails() -> None:
    instance = Instance(renewal_fails=True)
    part = leases(instance, {1: 3, 2: 4})
    part.feed.to_read = {4}  # a phase of a takeover not read yet
    part.last_renewal = time.monotonic()
    part.guard()
    assert instance.steps == [] and part.shared.owned == {3, 4}, "not due: nothing renewed or stopped"
    part.last_renewal -= part.settings.lease_seconds * 0.7
    part.guard()
    assert instance.steps == ["renewal"]
    assert part.shared.owned == set() and part.shared.member_info == {} and part.feed.to_read == set()


def test_the_feed_position_published_is_the_older_of_the_two_and_none_once_lost() -> None:
    part = leases(Instance(), {})
    part.feed.load_xmin, part.feed.hash_xmin = "120", "95"
    assert part._feed_xmin() == "95"
    part.lost_the_feed()
    assert part._feed_xmin() is None
