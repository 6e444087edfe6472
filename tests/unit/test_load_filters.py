"""The load filters' steps (``smart_triggerer/supervisor/load.py``): shedding by lag and by memory, holding
when memory does not come back, easing back, on a stand-in supervisor whose clock and readings the test
sets: the part is built as the supervisor builds it, from a shared context."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import pytest

from smart_triggerer.config import Settings
from smart_triggerer.supervisor.load import LoadFilters
from smart_triggerer.supervisor.shared import Shared


# stands in for the supervisor's groups (typed as those: setting `count` needs an ignore)
@dataclass
class Groups:
    count: int = 0

    def group_count(self) -> int:
        return self.count


class Readings(LoadFilters):
    """The filters themselves, with readings the test sets instead of measuring them."""

    def _measure_load(self) -> None:
        """Readings are set by the test."""


def Instance(
    settings: Settings,
    *,
    capacity: int = 1000,
    groups: Groups | None = None,
    lag_recent_ms: float = 0.0,
    rss_mb: int = 100,
) -> Readings:
    shared = Shared(settings=settings, capacity=capacity, groups=cast("Any", groups or Groups()))
    filters = Readings(shared, starting=lambda: False)
    filters.lag_recent_ms, filters.rss_mb = lag_recent_ms, rss_mb
    return filters


class Said:
    """The filters' log, recorded (structlog's loggers are cached by whichever test logged first: capsys
    cannot be relied on to see their lines)."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def warning(self, message: str, **_: object) -> None:
        self.lines.append(message)

    info = warning


@pytest.fixture
def said(monkeypatch: pytest.MonkeyPatch) -> Said:
    recorder = Said()
    monkeypatch.setattr("smart_triggerer.supervisor.load.log", recorder)
    return recorder


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [1000.0]
    monkeypatch.setattr("smart_triggerer.supervisor.load.time.monotonic", lambda: now[0])
    return now


def tick(instance: Readings, clock: list[float], seconds: float = 10.0) -> None:
    clock[0] += seconds
    instance.update()


def test_lag_sheds_a_quarter_per_step_and_eases_back_after_calm(clock: list[float]) -> None:
    instance = Instance(Settings(max_loop_lag_ms=1000), groups=Groups(400), lag_recent_ms=1500)
    tick(instance, clock)
    assert instance.shedding is not None and instance.limit_groups == 300
    instance.groups.count = 300  # type: ignore[attr-defined]  # the handover took effect
    tick(instance, clock)
    assert instance.limit_groups == 225
    instance.groups.count, instance.lag_recent_ms = 225, 100  # type: ignore[attr-defined]  # calm
    for _ in range(3):  # 30 s of calm before anything changes
        tick(instance, clock)
        assert instance.shedding is not None and instance.limit_groups == 225
    tick(instance, clock)
    assert instance.shedding is None and instance.limit_groups is not None and instance.limit_groups > 225
    for _ in range(30):
        tick(instance, clock)
    assert instance.limit_groups is None  # back to its capacity, a step at a time


def test_memory_that_does_not_come_back_stops_the_steps_and_holds(clock: list[float], said: Said) -> None:
    instance = Instance(Settings(max_rss_mb=500), groups=Groups(400), rss_mb=600)
    tick(instance, clock)
    assert instance.limit_groups == 300
    instance.groups.count = 300  # type: ignore[attr-defined]  # handed over, but the RSS stays (CPython keeps the arenas)
    for _ in range(5):
        tick(instance, clock)
    assert instance.limit_groups == 300 and instance.memory_held
    assert instance.shedding is not None and "holding" in instance.shedding
    assert sum("memory not given back" in line for line in said.lines) == 1


def test_memory_back_under_its_limit_takes_shards_again(clock: list[float]) -> None:
    """Held at 600 MB against 500, then 470 MB (under the limit, not under 90% of it): RSS seldom falls
    far, so under the limit for the calm time is calm enough; it eases back a step at a time."""
    instance = Instance(Settings(max_rss_mb=500), groups=Groups(400), rss_mb=600)
    tick(instance, clock)
    instance.groups.count = 300  # type: ignore[attr-defined]
    for _ in range(3):
        tick(instance, clock)
    assert instance.memory_held
    instance.rss_mb = 470
    for _ in range(5):
        tick(instance, clock)
    assert instance.shedding is None and not instance.memory_held
    assert instance.limit_groups is not None and instance.limit_groups > 300


def test_memory_that_comes_back_takes_the_next_step(clock: list[float]) -> None:
    instance = Instance(Settings(max_rss_mb=500), groups=Groups(400), rss_mb=800)
    tick(instance, clock)
    instance.groups.count, instance.rss_mb = 300, 700  # type: ignore[attr-defined]  # 12% down: the step helped, still over
    tick(instance, clock)
    assert instance.limit_groups == 225 and not instance.memory_held


def test_over_a_limit_while_holding_nothing_takes_no_shards_and_says_so_once(
    clock: list[float], said: Said
) -> None:
    instance = Instance(Settings(max_rss_mb=50), groups=Groups(0), rss_mb=300)
    for _ in range(10):
        tick(instance, clock)
    assert instance.shedding is not None and instance.limit_groups is None  # not accepting, no limit of 0
    assert len(said.lines) == 1 and "over a limit" in said.lines[0], said.lines
    instance.groups.count = 40  # type: ignore[attr-defined]  # alone, the fleet full: it took every shard anyway
    tick(instance, clock)
    assert instance.limit_groups == 30  # the first real step


def test_a_limit_never_sinks_to_zero_and_eases_back_within_twenty_steps(clock: list[float]) -> None:
    instance = Instance(Settings(max_loop_lag_ms=1000), capacity=30000, groups=Groups(1), lag_recent_ms=5000)
    tick(instance, clock)
    assert instance.limit_groups == 1
    instance.lag_recent_ms = 0
    steps = 0
    while instance.limit_groups is not None:
        tick(instance, clock)
        steps += 1
        assert steps < 40
    assert steps <= 3 + 20  # 30 s of calm, then at most twenty raises
