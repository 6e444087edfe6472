from __future__ import annotations

from collections import Counter

from smart_triggerer.placement.rendezvous import Member, assign, owner, shards_of

SHARDS = 3000


def test_balance_within_ten_percent_over_three_instances() -> None:
    members = [Member(11, 100), Member(12, 100), Member(13, 100)]
    counts = Counter(assign(SHARDS, members).values())
    for job_id in (11, 12, 13):
        assert abs(counts[job_id] - SHARDS / 3) <= 0.10 * SHARDS / 3, counts


def test_weights_are_respected() -> None:
    counts = Counter(assign(SHARDS, [Member(1, 100), Member(2, 300)]).values())
    assert 0.9 * 2250 <= counts[2] <= 1.1 * 2250, counts


def test_join_moves_only_shards_to_the_newcomer() -> None:
    before = assign(SHARDS, [Member(1, 100), Member(2, 100), Member(3, 100)])
    after = assign(SHARDS, [Member(1, 100), Member(2, 100), Member(3, 100), Member(4, 100)])
    moved = [s for s in range(SHARDS) if before[s] != after[s]]
    assert all(after[s] == 4 for s in moved)
    assert abs(len(moved) - SHARDS / 4) <= 0.10 * SHARDS / 4


def test_leave_moves_only_the_leavers_shards() -> None:
    before = assign(SHARDS, [Member(1, 100), Member(2, 100), Member(3, 100)])
    after = assign(SHARDS, [Member(1, 100), Member(3, 100)])
    moved = {s for s in range(SHARDS) if before[s] != after[s]}
    assert moved == shards_of(2, before)


def test_every_instance_computes_the_same_map() -> None:
    members = [Member(7, 50), Member(3, 50), Member(5, 80)]
    assert assign(64, members) == assign(64, list(reversed(members)))
    assert owner(0, []) is None
    assert assign(64, []) == {}
