"""The deadlines part (``smart_triggerer/supervisor/deadlines.py``) as itself, built from a shared context
as the supervisor builds it: members' timeouts by the database clock, and the heap kept to the members."""

from __future__ import annotations

import time

from smart_triggerer.config import Settings
from smart_triggerer.supervisor.deadlines import MemberDeadlines
from smart_triggerer.supervisor.shared import MemberInfo, Shared


def part(members: range) -> MemberDeadlines:
    shared = Shared(settings=Settings(), capacity=1000)
    shared.member_info.update({m: MemberInfo(shard=0, has_task=True, dedupable=True) for m in members})
    shared.db_clock = (1_000_000.0, time.monotonic())  # the database's clock, as a renewal read it
    return MemberDeadlines(shared)


def test_deadlines_are_kept_by_the_database_clock_soonest_per_member() -> None:
    deadlines = part(range(1, 4))
    deadlines.add(1, 60)
    deadlines.add(1, 30)
    deadlines.add(2, 90)
    soonest = deadlines.soonest()
    assert set(soonest) == {1, 2}
    assert 1_000_030 <= soonest[1] < 1_000_031 and 1_000_090 <= soonest[2] < 1_000_091


def test_nothing_due_opens_no_session() -> None:
    """No deadline has come: the part returns before it would open a database session (there is none)."""
    deadlines = part(range(1, 3))
    deadlines.add(1, 3600)
    deadlines.timeout_members()
    assert [t for _due, t in deadlines.deadlines] == [1]


def test_deadlines_of_members_that_left_are_dropped_and_the_heap_rebuilt() -> None:
    deadlines = part(range(1, 11))
    for trigger_id in range(1, 3000):
        deadlines.add(trigger_id, 3600 + trigger_id)  # 2,989 of them for members that left
    deadlines.timeout_members()  # nothing due: only the heap's upkeep
    assert sorted(t for _due, t in deadlines.deadlines) == list(range(1, 11))


def test_unreadable_rows_are_kept_until_failed() -> None:
    deadlines = part(range(0))
    deadlines.add_unreadable(7, 3, "could not read the kwargs of trigger 7 (x.Y): KeyError")
    assert deadlines.unreadable == {7: (3, "could not read the kwargs of trigger 7 (x.Y): KeyError")}
