"""The collector settings every smart triggerer process runs with (triggerer/heap.py)."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterator

import pytest

from triggerer.heap import (
    FREEZE_FROM,
    THAW_AFTER_SECONDS,
    THAW_AT_LEAST_EVERY_SECONDS,
    YOUNG_THRESHOLD,
    StartFreezer,
    tune_collector,
)


@pytest.fixture
def restored_collector() -> Iterator[None]:
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


def test_start_up_objects_are_frozen_and_young_collections_are_rare(restored_collector: None) -> None:
    gc.unfreeze()
    _, middle, old = gc.get_threshold()
    loaded_at_start = [{"module": n} for n in range(1000)]  # containers, as imports leave behind
    tune_collector()
    assert gc.get_freeze_count() >= len(loaded_at_start)
    # young collections every YOUNG_THRESHOLD allocations; the older generations keep their cadence
    assert gc.get_threshold() == (YOUNG_THRESHOLD, middle, old)


class Node:
    """A container that can be part of a reference cycle."""

    def __init__(self) -> None:
        self.other: Node | None = None


def collected_generations(during: Callable[[], None]) -> list[int]:
    seen: list[int] = []

    def note(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            seen.append(info["generation"])

    gc.callbacks.append(note)
    try:
        during()
    finally:
        gc.callbacks.remove(note)
    return seen


def test_a_big_start_is_never_scanned_by_the_middle_generation_and_is_frozen_after(
        restored_collector: None) -> None:
    gc.set_threshold(1000, 2, 10)  # a middle collection every two young ones, to see them
    freezer = StartFreezer(clock=lambda: 0.0)
    kept: list[Node] = []
    frozen_before = gc.get_freeze_count()

    def start(coroutines: int) -> None:
        with freezer.start(coroutines):
            kept.extend(Node() for _ in range(20 * 1000))  # twenty young collections' worth

    assert 1 in collected_generations(lambda: start(FREEZE_FROM - 1))  # a small start: as before
    assert freezer.frozen_at is None and gc.get_freeze_count() == frozen_before
    assert set(collected_generations(lambda: start(FREEZE_FROM))) == {0}
    assert gc.get_freeze_count() >= frozen_before + len(kept)
    assert gc.get_threshold() == (1000, 2, 10) and freezer.frozen_at == 0.0


def test_cycles_that_ended_among_frozen_objects_are_freed_once_calm(restored_collector: None) -> None:
    now = [0.0]
    freezer = StartFreezer(clock=lambda: now[0])
    with freezer.start(FREEZE_FROM):
        a, b = Node(), Node()
        a.other, b.other = b, a  # a coroutine and its task, say: a cycle
        ended = weakref.ref(a)
    del a, b  # the coroutine ended: its cycle is garbage, frozen
    gc.collect()
    assert ended() is not None  # a frozen cycle is not scanned
    now[0] = THAW_AFTER_SECONDS - 1
    assert not freezer.thaw_when_calm() and ended() is not None
    now[0] = THAW_AFTER_SECONDS
    assert freezer.thaw_when_calm()
    assert ended() is None and gc.get_freeze_count() > 0  # freed; what lives is frozen again
    assert not freezer.thaw_when_calm()  # once per frozen start


def test_big_starts_one_after_another_are_thawed_at_least_hourly(restored_collector: None) -> None:
    now = [0.0]
    freezer = StartFreezer(clock=lambda: now[0])
    while now[0] < THAW_AT_LEAST_EVERY_SECONDS:
        with freezer.start(FREEZE_FROM):
            pass
        assert not freezer.thaw_when_calm()  # never calm for long: a start every 5 minutes
        now[0] += THAW_AFTER_SECONDS / 2
    assert freezer.thaw_when_calm()
