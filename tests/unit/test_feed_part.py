"""The feed part (``smart_triggerer/supervisor/feed.py``) as itself, built from a shared context and a
stand-in for the instance: a takeover's shards read in phases by the loads their last owners published,
and a snapshot older than what was read means the database went back (everything is read again)."""

from __future__ import annotations

from collections.abc import Mapping

from smart_triggerer.config import Settings
from smart_triggerer.supervisor.deadlines import MemberDeadlines
from smart_triggerer.supervisor.feed import FIRST_READ_GROUPS, Feed
from smart_triggerer.supervisor.shared import Shared
from tests.helpers.parts import QuietInstance


class Instance(QuietInstance):
    def __init__(self, loads: dict[int, int]) -> None:
        super().__init__()
        self.loads = loads

    def published_groups(self) -> Mapping[int, int]:
        return self.loads


def feed(loads: dict[int, int]) -> Feed:
    shared = Shared(settings=Settings(), capacity=100_000)
    return Feed(shared, MemberDeadlines(shared), Instance(loads))


def test_a_big_takeover_is_read_in_phases_of_growing_size() -> None:
    part = feed({shard: 500 for shard in range(16)})  # 8,000 groups
    phases = part._read_phases(set(range(16)))
    assert set().union(*phases) == set(range(16)) and sum(len(p) for p in phases) == 16
    sizes = [500 * len(phase) for phase in phases]
    assert sizes[0] >= FIRST_READ_GROUPS and sizes[1] >= 2 * FIRST_READ_GROUPS  # then twice as many
    assert phases == sorted(phases, key=min)  # in shard order


def test_a_small_takeover_or_an_unknown_load_is_one_read() -> None:
    assert feed({0: 10, 1: 10})._read_phases({0, 1}) == [{0, 1}]
    assert feed({0: 5000})._read_phases({0, 1}) == [{0, 1}]  # shard 1's load was never published


def test_a_snapshot_older_than_what_was_read_means_reading_everything_again() -> None:
    part = feed({})
    part.load_xmin, part.hash_xmin = "1000", "990"
    assert not part._went_back("1000")
    assert part.load_xmin == "1000"
    assert part._went_back("900")
    assert part.load_xmin is None and part.hash_xmin is None
