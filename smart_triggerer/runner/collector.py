"""Python's cyclic garbage collector, set for processes that hold tens of thousands of live objects:
a young threshold of ``YOUNG_THRESHOLD`` (the defaults scan those objects again and again at a takeover),
and ``StartFreezer``/``OlderHeld`` around a big start, so that coroutines that wait are never scanned
again while they wait. Frozen objects are never given back to the collector (a full collection over them
would copy the pages the runner shares with its supervisor). Why, and what each setting was measured to
save: docs/design.md, "The collector at a big start"."""

from __future__ import annotations

import gc
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

YOUNG_THRESHOLD = 50_000
FREEZE_FROM = 1_000  # coroutines started in one go: a start this big is frozen as it goes
BURST_WINDOW_SECONDS = 10.0  # FREEZE_FROM coroutines created within this long: a big start
# Collections of the younger generation before an older one is collected: never, within a big start. The
# old generation is held too: a full collection falls due at a middle one (CPython counts them) but runs
# at the next young collection, which may be inside the start (a unit test caught one in CI).
NO_OLDER_COLLECTIONS = 1 << 30


def tune_collector() -> None:
    """Freeze what start-up loaded (Airflow, providers, DAG parsing: never garbage, never scanned again)
    and collect the young generation every ``YOUNG_THRESHOLD`` allocations instead of every 700."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)


def collect_young_while_idle() -> bool:
    """Collect the young generation now if it is half way to its threshold; for a loop with nothing to
    do. Between collections the young generation gathers what waiting coroutines keep (their current
    sleeps, their last responses: a young collection scanning them stops the runner's loop), and the
    allocations of a takeover's first piles, before ``StartFreezer`` sees a big start, made that
    collection fall inside the takeover (docs/design.md, Measurements behind the code).
    Collected while idle, a takeover begins with half a threshold of room: its first piles collect
    nothing, and its big passes freeze the rest unscanned. Returns whether it collected."""
    if not gc.isenabled() or gc.get_count()[0] < max(gc.get_threshold()[0] // 2, 1):
        return False
    gc.collect(0)
    return True


def hold_older_generations() -> tuple[int, int, int]:
    """From now on, collect the young generation only; returns the thresholds to restore."""
    thresholds = gc.get_threshold()
    gc.set_threshold(thresholds[0], NO_OLDER_COLLECTIONS, NO_OLDER_COLLECTIONS)
    return thresholds


class StartFreezer:
    """The runner's big starts, frozen as they go (see the module's docstring).

    A start is counted over the runner's passes: the supervisor hands a takeover over in batches (a few
    hundred coroutines a pass while it reads its shards in phases), so a takeover of 15,000 is made of
    dozens of passes below ``FREEZE_FROM``. A pass that brings the coroutines created in the last
    ``BURST_WINDOW_SECONDS`` to ``FREEZE_FROM`` or more is frozen at its end. (Counted per pass, a
    takeover handed over 250 at a time was never frozen, and middle and full collections paused the loop;
    docs/design.md, Measurements behind the code.) New waits arriving at a steady pace below that rate
    (100 a second) are never frozen: their cycles are collected as before."""

    def __init__(self) -> None:
        self.frozen = 0  # passes frozen so far
        self.recent: deque[tuple[float, int]] = deque()  # (time.monotonic(), coroutines) of recent passes

    @contextmanager
    def start(self, coroutines: int) -> Iterator[None]:
        """Around the creation of ``coroutines`` coroutines: nothing within a small start; within a big
        one, everything alive frozen before the pass and after it, and no collection of the middle or old
        generation while it runs."""
        if not coroutines or self._recently_created(coroutines) < FREEZE_FROM:
            yield
            return
        gc.freeze()  # what the waiting coroutines made since the last collection: never scanned by the pass
        thresholds = hold_older_generations()
        try:
            yield
        finally:
            gc.freeze()
            gc.set_threshold(*thresholds)
            self.frozen += 1

    def _recently_created(self, coroutines: int) -> int:
        now = time.monotonic()
        self.recent.append((now, coroutines))
        while now - self.recent[0][0] > BURST_WINDOW_SECONDS:
            self.recent.popleft()
        return sum(count for _, count in self.recent)


HOLD_AT_MOST_SECONDS = 30.0  # a start stalled this long (a database outage) collects as usual again


class OlderHeld:
    """The supervisor's big starts: no collection of the middle or old generation while one runs.

    A takeover of 15,000 groups makes hundreds of thousands of objects that live as long as their waits
    (groups, member records, deadlines), and each collection of the middle generation during it scans all
    of those made so far and frees next to nothing, in one go in the middle of a takeover, while the
    runner waits for its next pile (docs/design.md, Measurements behind the code). Held from the moment
    ``FREEZE_FROM`` groups wait to start until the start is over (or ``HOLD_AT_MOST_SECONDS`` passed),
    the thresholds are then restored and the collection that fell due runs at the next young collection,
    after the start. Nothing is frozen (unlike the runner's ``StartFreezer``): the supervisor's cycles
    (sessions, results, rows) are collected as before, a few seconds later."""

    def __init__(self) -> None:
        # while held: (time.monotonic() of the hold's start, the thresholds to restore)
        self.held: tuple[float, tuple[int, int, int]] | None = None
        self.spent = False  # held for its longest within the start still running: not again before it ends

    def update(self, waiting: int, starting: bool) -> None:
        """``waiting``: groups waiting to start now; ``starting``: a start is still under way (groups
        to start or to build, shards still to read)."""
        now = time.monotonic()
        if self.held is not None:
            since, thresholds = self.held
            if not starting or now - since >= HOLD_AT_MOST_SECONDS:
                gc.set_threshold(*thresholds)
                self.held = None
                self.spent = starting
            return
        if not starting:
            self.spent = False
        elif waiting >= FREEZE_FROM and not self.spent:
            self.held = (now, hold_older_generations())
