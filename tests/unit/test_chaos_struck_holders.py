"""The chaos checker's allowance for stacked faults: a lease and a loop per other instance that took a
wait's shard while the wait waited (``tests/helpers/chaos/checker.py``, ``other_shard_holders``), read
from the instances' "took shards" log lines (``run.took_shards``)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from tests.helpers.chaos.checker import other_shard_holders
from tests.helpers.chaos.run import took_shards

T0 = dt.datetime(2026, 11, 26, 12, 31, tzinfo=dt.UTC)


def at(seconds: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=seconds)


def resumed(seconds: float, writer: str = "smart-1", shard: int = 9) -> list[dict[str, object]]:
    return [
        {"op": "deferred", "at": at(0)},
        {"op": "resolved", "at": at(seconds), "writer": writer, "shard": shard},
    ]


def test_a_shard_retaken_by_an_instance_struck_before_it_stored_counts_once() -> None:
    # the CI run's case: the condition held at 16 s, PostgreSQL restarted, smart-2 took the shard at 21.9 s
    # and was killed, smart-1 took it again at 29.1 s and resumed the wait at 31.6 s
    took: dict[tuple[str | None, int], list[tuple[dt.datetime, str]]] = {
        (None, 9): [(at(11.5), "smart-1"), (at(21.9), "smart-2"), (at(29.1), "smart-1")]
    }
    assert other_shard_holders(resumed(31.6), at(16), took) == 1


def test_no_other_taker_inside_the_wait_allows_nothing_more() -> None:
    took = {
        (None, 9): [(at(11.5), "smart-2"), (at(40), "smart-3")],
        (None, 3): [(at(20), "smart-2")],
        ("alpha", 9): [(at(20), "alpha-1")],
    }
    assert other_shard_holders(resumed(31.6), at(16), took) == 0  # before the condition, after, other shard
    assert other_shard_holders(resumed(31.6), None, took) == 0
    assert other_shard_holders([{"op": "deferred", "at": at(0)}], at(16), took) == 0  # never resumed
    # shard 9 of team alpha is another lease than shard 9 of no team: it counts for alpha's waits only
    assert other_shard_holders(resumed(31.6, writer="alpha-2"), at(16), took, "alpha") == 1


def test_took_lines_are_read_per_instance_process(tmp_path: Path) -> None:
    (tmp_path / "smart-2.2.log").write_text(
        "2026-11-26T12:31:21.921546Z [info     ] took shards                    "
        "[smart_triggerer.supervisor.leases] loc=leases.py:147 shards=[1, 9]\n"
        "2026-11-26T12:31:22.000000Z [info     ] handing over shards  shards=[9]\n"
    )
    (tmp_path / "alpha-1.log").write_text(
        "2026-11-26T12:31:21.921546Z [info     ] took shards   [smart_triggerer.supervisor.leases] "
        "shards=[9]\n"
    )
    (tmp_path / "relay.log").write_text(
        "2026-11-26T12:31:21.921546Z [info     ] took shards   [smart_triggerer.supervisor.leases] "
        "shards=[4]\n"
    )
    assert took_shards(tmp_path) == {
        (None, 1): [(at(21.921546), "smart-2.2")],
        (None, 9): [(at(21.921546), "smart-2.2")],
        ("alpha", 9): [(at(21.921546), "alpha-1")],
    }
