"""The collector settings every smart triggerer process runs with (triggerer/heap.py)."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from triggerer.heap import FREEZE_FROM, YOUNG_THRESHOLD, StartFreezer, tune_collector


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
    """A container the collector tracks, as a coroutine's objects are."""


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
    freezer = StartFreezer()
    kept: list[Node] = []
    frozen_before = gc.get_freeze_count()

    def start(coroutines: int) -> None:
        with freezer.start(coroutines):
            kept.extend(Node() for _ in range(20 * 1000))  # twenty young collections' worth

    assert 1 in collected_generations(lambda: start(FREEZE_FROM - 1))  # a small start: as before
    assert freezer.frozen == 0 and gc.get_freeze_count() == frozen_before
    assert set(collected_generations(lambda: start(FREEZE_FROM))) == {0}
    assert gc.get_freeze_count() >= frozen_before + len(kept)
    assert gc.get_threshold() == (1000, 2, 10) and freezer.frozen == 1


def test_coroutines_of_a_frozen_start_are_freed_when_they_end(restored_collector: None) -> None:
    """Frozen is not kept: a coroutine of a big start that is cancelled (a handover) or ends is freed by
    reference counting, with no collection of the frozen objects."""

    async def wait() -> None:
        await asyncio.sleep(3600)

    async def start_then_hand_over() -> tuple[list[weakref.ref[Any]], int]:
        freezer = StartFreezer()
        with freezer.start(FREEZE_FROM):
            tasks = [asyncio.create_task(wait()) for _ in range(FREEZE_FROM)]
            await asyncio.sleep(0)  # each took its first step, as a trigger's coroutine does
        assert freezer.frozen == 1
        frozen = gc.get_freeze_count()
        watched = [weakref.ref(task) for task in tasks]
        for task in tasks:
            task.cancel("handover")
        await asyncio.gather(*tasks, return_exceptions=True)
        del tasks
        return watched, frozen - gc.get_freeze_count()

    watched, freed_from_frozen = asyncio.run(start_then_hand_over())
    assert all(ref() is None for ref in watched)
    assert freed_from_frozen >= 2 * FREEZE_FROM  # each task and its coroutine left the frozen heap
