"""The handover part (``smart_triggerer/supervisor/handover.py``) as itself, built from a shared context and
a stand-in for the instance: shards given up drain while their coroutines end, are released once they
ended (or the drain's time is up), and a shard wanted again before that is read in full again, so that a
waiter forgotten when it began to leave (it was waiting for room) is never lost."""

from __future__ import annotations

import time

from smart_triggerer.config import Settings
from smart_triggerer.supervisor.handover import DRAIN_SECONDS, Handover
from smart_triggerer.supervisor.shared import MemberInfo, Shared
from tests.helpers.parts import QuietInstance


class Instance(QuietInstance):
    def __init__(self) -> None:
        super().__init__()
        self.in_flight: list[int] = []

    def events_in_flight(self) -> list[int]:
        return self.in_flight


def fleet_full_instance() -> tuple[Shared, Instance, Handover]:
    """Capacity 1: member 1 (shard 3) runs its coroutine, member 2 (shard 3) waits for room, member 3
    (shard 4) runs."""
    shared = Shared(settings=Settings(lease_seconds=8.0), capacity=1)
    instance = Instance()
    for trigger_id, shard in ((1, 3), (2, 3), (3, 4)):
        shared.member_info[trigger_id] = MemberInfo(shard, has_task=True, dedupable=False)
        shared.groups.join(trigger_id, identity_hash=trigger_id)
    for trigger_id in (1, 3):
        shared.groups.start(shared.groups.by_hash[trigger_id])
        instance.alive.add(trigger_id)
    return shared, instance, Handover(shared, instance)


def test_a_shard_given_up_drains_while_its_coroutines_end_and_is_released_once_they_did() -> None:
    shared, instance, handover = fleet_full_instance()
    assert handover.drained({3}) == set()  # coroutine 1 still runs: the lease is kept
    assert set(handover.leaving) == {3} and handover.runners == {1} and instance.runner_changes == 1
    assert set(shared.member_info) == {1, 3}  # member 2 had no coroutine: nothing in flight, forgotten
    instance.alive.discard(1)
    instance.in_flight.append(1)  # it ended, but its event is not stored yet
    assert handover.drained({3}) == set()
    instance.in_flight.clear()
    assert handover.drained({3}) == {3}


def test_a_drain_ends_when_its_time_is_up_even_with_coroutines_running() -> None:
    _shared, _instance, handover = fleet_full_instance()
    assert handover.drain_seconds() == min(DRAIN_SECONDS, 8.0 / 4)
    handover.leave({3}, until=time.monotonic() - 0.01)
    assert handover.over() == {3}


def test_a_shard_wanted_again_while_draining_is_read_in_full_again() -> None:
    """The placement changed its mind before the drain ended (a fleet settling): member 2, forgotten when
    its shard began to leave, must be read again, or nobody would run it while the shard stays here."""
    _shared, instance, handover = fleet_full_instance()
    handover.drained({3})
    changes = instance.runner_changes
    assert handover.drained(set()) == set()  # shard 3 is wanted again
    assert not handover.leaving and not handover.runners and instance.runner_changes == changes + 1
    assert instance.to_read_in_full == {3}


def test_forgetting_dropped_shards_ends_their_drain() -> None:
    _shared, instance, handover = fleet_full_instance()
    handover.drained({3, 4})
    assert handover.runners == {1, 3}
    handover.forget({4})
    assert set(handover.leaving) == {3} and handover.runners == {1}
    changes = instance.runner_changes
    handover.forget({7})  # not leaving: nothing changes, the runner is not asked again
    assert instance.runner_changes == changes
