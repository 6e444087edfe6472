"""``status`` totals: every shard space a live instance serves counts, so shards_owned == shards means every
shard is owned, with or without ``--queues``."""

from __future__ import annotations

from typing import Any

from smart_triggerer.db.status import totals


def live(queues: str | None, shards_owned: int, healthy: bool = True) -> dict[str, Any]:
    return {
        "healthy": healthy,
        "queues": queues,
        "shards_owned": shards_owned,
        "waiters": 1,
        "groups": 1,
        "events_total": 0,
        "resumed_total": 0,
        "failures_total": 0,
        "watchers_failing": 0,
        "fleet_full": False,
    }


def test_one_shard_space_without_queues() -> None:
    found = totals([live(None, 10), live(None, 6)], 16)
    assert (found["shards"], found["shards_owned"]) == (16, 16)


def test_each_queue_set_has_a_shard_space_of_its_own() -> None:
    found = totals([live("etl", 16), live("gpu,ml", 10), live("gpu,ml", 6), live(None, 16)], 16)
    assert (found["shards"], found["shards_owned"]) == (48, 48)


def test_a_space_whose_only_instance_is_unhealthy_shows_its_shards_unowned() -> None:
    found = totals([live(None, 16), live("etl", 16, healthy=False)], 16)
    assert (found["shards"], found["shards_owned"]) == (32, 16)
