"""The starting part (``smart_triggerer/supervisor/starting.py``) as itself, built from a shared context,
the parts it works with and a stand-in for the instance (the runner's side recorded): groups start most
urgent first within the instance's room, the runner is asked for a batch at most, coroutines of shards
being given up are cancelled, and a leader whose workload is refused hands over to another member."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest

from smart_triggerer.config import Settings
from smart_triggerer.supervisor.deadlines import MemberDeadlines
from smart_triggerer.supervisor.feed import Feed
from smart_triggerer.supervisor.handover import Handover
from smart_triggerer.supervisor.log_files import LogFiles
from smart_triggerer.supervisor.shared import MemberInfo, Shared
from smart_triggerer.supervisor.starting import RowCannotBeBuilt, Starting
from tests.helpers.parts import QuietInstance


@dataclass
class Workload:
    id: int


class Runner(QuietInstance):
    """The conductor's answers for the runner's side: what it runs (``alive``), and what it was handed
    or told."""

    def __init__(self, refuse: Collection[int] = ()) -> None:
        super().__init__()
        self.refuse = set(refuse)  # rows whose workload the build refuses (RowCannotBeBuilt)
        self.handed: list[int] = []
        self.cancelled: set[int] = set()
        self.builds: list[set[int]] = []

    def send_to_runner(self) -> None:
        self.alive |= set(self.handed)  # it took what it was handed

    def not_to_start(self) -> Iterable[Iterable[int]]:
        return (self.handed, self.cancelled)

    def cancel(self, runners: set[int]) -> None:
        self.cancelled |= runners

    def build(self, trigger_ids: set[int]) -> list[Any]:
        self.builds.append(set(trigger_ids))
        if refused := self.refuse & trigger_ids:
            raise RowCannotBeBuilt(min(refused))
        return [Workload(t) for t in sorted(trigger_ids)]

    def hand_out(self, workloads: Sequence[Any]) -> None:
        self.handed.extend(w.id for w in workloads)


def starting(runner: Runner, *, capacity: int = 100, max_new_per_loop: int = 100) -> Starting:
    shared = Shared(settings=Settings(max_new_per_loop=max_new_per_loop), capacity=capacity, owned={0, 1})
    deadlines = MemberDeadlines(shared)
    return Starting(
        shared,
        runner,
        feed=Feed(shared, deadlines, runner),
        deadlines=deadlines,
        handover=Handover(shared, runner),
        log_files=LogFiles(shared, running=set, start_under_way=lambda: False, logger_cache={}),
    )


def join(
    part: Starting, trigger_id: int, identity_hash: int, *, shard: int = 0, interval: float = 60
) -> None:
    part.shared.member_info[trigger_id] = MemberInfo(shard, has_task=True, dedupable=True)
    part.shared.groups.join(trigger_id, identity_hash, {"poll_interval": ("min", interval)})


def test_groups_start_most_urgent_first_within_the_room_and_a_batch_at_a_time() -> None:
    runner = Runner()
    part = starting(runner, capacity=3, max_new_per_loop=2)
    for trigger_id, interval in ((1, 300.0), (2, 5.0), (3, 60.0), (4, 1.0)):
        join(part, trigger_id, identity_hash=trigger_id, interval=interval)
    part.start_groups()
    assert runner.builds == [{4, 2}, {3}], "two at a time, the shortest intervals first, three in all"
    assert runner.handed == [2, 4, 3] and set(part.shared.groups.unstarted) == {1}
    assert not part.backlog(), "no room left: nothing waits to be built"


def test_a_refused_leader_hands_over_to_another_member_of_its_group() -> None:
    runner = Runner(refuse={10})
    part = starting(runner)
    join(part, 10, identity_hash=7)
    join(part, 11, identity_hash=7)  # a duplicate wait: same group
    part.start_groups()
    group = part.shared.groups.by_hash[7]
    assert group.runner_id == 11 and 10 in group.unstartable
    assert runner.handed == [11]


def test_coroutines_no_group_wants_and_those_of_shards_leaving_are_cancelled() -> None:
    runner = Runner()
    part = starting(runner)
    join(part, 1, identity_hash=1, shard=0)
    join(part, 2, identity_hash=2, shard=1)
    part.start_groups()
    runner.send_to_runner()
    runner.alive.add(99)  # a coroutine of a group this instance forgot
    part.handover.leave({1}, until=float("inf"))  # shard 1 is being given up: its coroutine ends
    part.request_started()
    assert runner.cancelled == {99, 2}
    assert not part.request_started(), "nothing changed since: the runner is not asked again"


@pytest.mark.parametrize("backlog", [True, False])
def test_a_start_has_a_backlog_while_groups_wait_with_room_or_workloads_wait(backlog: bool) -> None:
    part = starting(Runner(), capacity=0)
    join(part, 1, identity_hash=1)
    part.build_backlog = backlog
    assert part.backlog() is backlog, "no room: waiting groups alone are no backlog"
