"""The collector settings every smart triggerer process runs with (smart_triggerer/runner/collector.py)."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from smart_triggerer.runner import collector
from smart_triggerer.runner.collector import (
    BURST_WINDOW_SECONDS,
    FREEZE_FROM,
    HOLD_AT_MOST_SECONDS,
    YOUNG_THRESHOLD,
    OlderHeld,
    StartFreezer,
    collect_young_while_idle,
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
    """A container the collector tracks, as a coroutine's objects are."""


def collected_generations(during: Callable[[], object]) -> list[int]:
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
    restored_collector: None,
) -> None:
    gc.set_threshold(1000, 2, 10)  # a middle collection every two young ones, to see them
    freezer = StartFreezer()
    kept: list[Node] = []
    frozen_before = gc.get_freeze_count()

    def start(coroutines: int) -> None:
        with freezer.start(coroutines):
            kept.extend(Node() for _ in range(20 * 1000))  # twenty young collections' worth

    assert 1 in collected_generations(lambda: start(FREEZE_FROM - 1))  # a small start: as before
    assert freezer.frozen == 0 and gc.get_freeze_count() == frozen_before
    assert set(collected_generations(lambda: start(FREEZE_FROM))) == {0}  # a big one: young ones only
    assert gc.get_freeze_count() >= frozen_before + len(kept)
    assert gc.get_threshold() == (1000, 2, 10) and freezer.frozen == 1


def test_what_waited_before_a_big_start_is_frozen_before_it_runs(restored_collector: None) -> None:
    """The waiting coroutines' young objects (their sleeps, their last responses) are frozen as a big
    pass begins: its collections would have scanned them all (260-280 ms of the runner's loop at the
    first one of a takeover of 25,000 waits)."""
    gc.set_threshold(1_000_000, 10, 10)  # they piled up in the young generation, as between collections
    waiting = [Node() for _ in range(10 * 1000)]
    frozen_before = gc.get_freeze_count()
    with StartFreezer().start(FREEZE_FROM):
        frozen_at_start = gc.get_freeze_count()
        assert gc.get_count()[0] == 0  # nothing young left to scan
    assert frozen_at_start >= frozen_before + len(waiting)


def test_an_idle_loop_collects_the_young_generation_half_way_so_a_start_begins_with_room(
    restored_collector: None,
) -> None:
    gc.set_threshold(20 * 1000, 10, 10)
    gc.collect(0)
    kept = [Node() for _ in range(9 * 1000)]
    assert not collect_young_while_idle() and gc.get_count()[0] >= len(kept)  # under half: left alone
    kept.extend(Node() for _ in range(2 * 1000))
    assert collected_generations(collect_young_while_idle) == [0]  # past half: the young one, now
    assert gc.get_count()[0] < 100
    gc.disable()
    try:
        kept.extend(Node() for _ in range(15 * 1000))
        assert not collect_young_while_idle()  # a collector turned off stays off
    finally:
        gc.enable()


def test_a_full_collection_due_when_a_big_start_begins_waits_until_it_ends(restored_collector: None) -> None:
    """CPython decides a full collection at the next young one after it fell due: one due as a big start
    begins (the last middle collection before it made it so) must not run inside it, over every coroutine
    made so far. (In CI, a pass's state left by earlier tests did exactly that.)"""
    gc.freeze()
    gc.collect()  # the old generation is empty: the "a quarter of it is new" condition always holds
    gc.collect(1)  # a middle collection counts towards the old generation's threshold
    gc.set_threshold(1000, 2, 0)  # so a full collection is due now
    frozen_before = gc.get_freeze_count()
    freezer = StartFreezer()
    kept: list[Node] = []

    def start() -> None:
        with freezer.start(FREEZE_FROM):
            kept.extend(Node() for _ in range(20 * 1000))

    assert set(collected_generations(start)) == {0} and freezer.frozen == 1
    assert gc.get_threshold() == (1000, 2, 0)
    assert gc.get_freeze_count() >= frozen_before + len(kept)  # what it made is frozen: never scanned


def test_a_start_handed_over_in_small_passes_is_frozen_once_it_is_big(
    restored_collector: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A takeover comes in passes of a few hundred (the supervisor reads and builds in batches): the pass
    that makes it big is frozen, and those after it; new waits at a steady trickle never are."""
    gc.set_threshold(1000, 2, 10)  # a middle collection every two young ones, to see them
    clock = [1000.0]
    monkeypatch.setattr(collector.time, "monotonic", lambda: clock[0])  # type: ignore[attr-defined]
    freezer = StartFreezer()
    kept: list[Node] = []
    quarter = FREEZE_FROM // 4

    def a_pass(coroutines: int = quarter) -> list[int]:
        clock[0] += 0.05

        def create() -> None:
            with freezer.start(coroutines):
                kept.extend(Node() for _ in range(20 * 1000))

        return collected_generations(create)

    assert 1 in a_pass() and 1 in a_pass() and 1 in a_pass(0)  # small so far (nothing created: no count)
    assert a_pass() and freezer.frozen == 0  # three quarters
    assert set(a_pass()) == {0} and freezer.frozen == 1  # the fourth makes the start big: frozen
    assert set(a_pass()) == {0} and freezer.frozen == 2  # and so are the passes after it
    assert gc.get_threshold() == (1000, 2, 10)

    clock[0] += BURST_WINDOW_SECONDS + 1  # later: a pass of a few is a small start again
    assert 1 in a_pass() and freezer.frozen == 2
    for _ in range(2 * FREEZE_FROM):  # one new wait a second, for over half an hour: never frozen
        clock[0] += 1.0
        with freezer.start(1):
            pass
    assert freezer.frozen == 2


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


def test_the_supervisor_holds_older_collections_while_a_big_start_runs_then_collects_as_before(
    restored_collector: None,
) -> None:
    """A takeover's groups are scanned by no middle collection while it starts (``OlderHeld``); the
    collection falls due and runs once it is over. Nothing is frozen: cycles made meanwhile are freed."""
    gc.set_threshold(1000, 2, 10)  # a middle collection every two young ones, to see them
    held = OlderHeld()
    kept: list[Node] = []

    def load() -> None:
        kept.extend(Node() for _ in range(20 * 1000))  # twenty young collections' worth

    held.update(FREEZE_FROM - 1, starting=True)  # a small start: collected as before
    assert 1 in collected_generations(load)
    held.update(FREEZE_FROM, starting=True)  # a big one: young collections only
    assert set(collected_generations(load)) == {0}
    held.update(0, starting=True)  # all started, some still to build: still held
    assert set(collected_generations(load)) == {0}
    frozen = gc.get_freeze_count()

    held.update(0, starting=False)  # over: the thresholds are back, and the due collection runs
    assert gc.get_threshold() == (1000, 2, 10)
    assert 1 in collected_generations(lambda: kept.extend(Node() for _ in range(2 * 1000)))
    assert gc.get_freeze_count() == frozen

    cycle = [Node()]
    cycle[0].me = cycle  # type: ignore[attr-defined]
    watched = weakref.ref(cycle[0])
    held.update(FREEZE_FROM, starting=True)
    del cycle
    held.update(0, starting=False)
    gc.collect(1)
    assert watched() is None  # a cycle let go during a hold is collected after it (nothing was frozen)


def test_a_start_that_lasts_is_held_only_for_so_long_and_not_again_until_it_ends(
    restored_collector: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A start stalled by a database outage (groups wait for minutes) must not keep the older generations
    uncollected for as long: released after ``HOLD_AT_MOST_SECONDS``, held again only by the next start."""
    gc.set_threshold(1000, 2, 10)
    clock = [1000.0]
    monkeypatch.setattr(collector.time, "monotonic", lambda: clock[0])  # type: ignore[attr-defined]
    held = OlderHeld()
    held.update(FREEZE_FROM, starting=True)
    assert gc.get_threshold()[1:] == (collector.NO_OLDER_COLLECTIONS, collector.NO_OLDER_COLLECTIONS)
    clock[0] += HOLD_AT_MOST_SECONDS
    held.update(FREEZE_FROM, starting=True)
    assert gc.get_threshold() == (1000, 2, 10)
    clock[0] += 1
    held.update(FREEZE_FROM, starting=True)  # the same start, still running: not held again
    assert gc.get_threshold() == (1000, 2, 10)
    held.update(0, starting=False)
    held.update(FREEZE_FROM, starting=True)  # the next start
    assert gc.get_threshold()[1] == collector.NO_OLDER_COLLECTIONS


def test_a_leaving_instance_collects_nothing_more(restored_collector: None) -> None:
    """Once its leases are released (smart_triggerer/supervisor/service.py), the heap is frozen and the
    collector off: the exit scans nothing of the groups it drops."""
    from smart_triggerer.supervisor.service import leave_the_heap

    alive = [Node() for _ in range(1000)]
    try:
        leave_the_heap()
        assert not gc.isenabled() and gc.get_freeze_count() >= len(alive)
        assert collected_generations(lambda: alive.extend(Node() for _ in range(20 * 1000))) == []
    finally:
        gc.enable()
