"""The runner's event-loop lag, measured in the runner and read by its supervisor.

The runner wakes every ``TICK`` seconds and notes how late it woke: a loop busy with more coroutines than
its core can serve wakes late, whatever the coroutines are. The 99th percentile of those delays over the
last minute is the instance's reported lag; over the last ``RECENT_SECONDS``, what its filters judge
(placement.py): a minute-long window would keep an instance that already shed its load marked lagging
for a minute. Delays while the runner starts coroutines (a takeover, a start) are not counted: that work
is the reason shards just moved here, not a sign of too many.

The figures go through a page of memory shared with the runner subprocess (made before Airflow forks it,
so the child inherits it), under a sequence counter: the supervisor never reads half a write. Beside them, a
thread of the runner (``BlockSpotter``) notes which trigger holds the loop while it has not ticked for a
while (a blocking call with no timeout), so that the supervisor can name it when it hands its shards over
(``supervisor/stall.py``).
"""

from __future__ import annotations

import asyncio
import math
import mmap
import re
import struct
import threading
import time
from collections import deque

TICK = 0.1
WINDOW_SECONDS = 60.0
RECENT_SECONDS = 10.0
# after the runner started this many coroutines in one pass, their first steps are start-up, not load
BIG_START = 100
AFTER_START_SECONDS = 5.0

_SEQUENCE = struct.Struct("<Q")  # odd while a write is under way
_FIGURES = struct.Struct("<ddd")  # p99 last minute, p99 recent (ms), written at (time.monotonic())
# the trigger holding a blocked loop (0: none, or not a trigger's task), under a sequence of its own: its
# writer is another thread than the figures' one
_HOLDER_AT = 64
_HOLDER = struct.Struct("<Qq240s")  # sequence, trigger id, the task's name (dag/run/task/map/try (ID n))
BLOCKED_AFTER = 1.0  # a loop that has not ticked for this long is held by whatever task runs in it
SPOT_EVERY = 0.5
_TRIGGER_ID = re.compile(r"\(?ID (-?\d+)\)?$")  # the end of the runner's task names (runner.py)


class LagBoard:
    """Shared between a supervisor and its runner: the runner writes, the supervisor reads (a sequence
    lock: the writer makes the sequence odd, writes, makes it even; a reader keeps a copy only when the
    sequence was even and the same before and after it)."""

    def __init__(self) -> None:
        self._page = mmap.mmap(-1, mmap.PAGESIZE)  # anonymous and shared: inherited by a forked child
        self._sequence = 0

    def write(self, minute_ms: float, recent_ms: float) -> None:
        self._sequence += 1
        self._page[: _SEQUENCE.size] = _SEQUENCE.pack(self._sequence)
        self._page[_SEQUENCE.size : _SEQUENCE.size + _FIGURES.size] = _FIGURES.pack(
            minute_ms, recent_ms, time.monotonic()
        )
        self._sequence += 1
        self._page[: _SEQUENCE.size] = _SEQUENCE.pack(self._sequence)

    def read(self) -> tuple[float, float] | None:
        """(p99 over the last minute, p99 recently) in ms; None before the first write. A runner that has
        not written for a while is lagging by that while (a loop stuck in one callback writes nothing)."""
        for _ in range(100):
            (before,) = _SEQUENCE.unpack(self._page[: _SEQUENCE.size])
            minute_ms, recent_ms, written_at = _FIGURES.unpack(
                self._page[_SEQUENCE.size : _SEQUENCE.size + _FIGURES.size]
            )
            (after,) = _SEQUENCE.unpack(self._page[: _SEQUENCE.size])
            if before == after and before % 2 == 0:
                if before == 0:
                    return None
                silent_ms = max(0.0, (time.monotonic() - written_at - 1.0) * 1000)
                return max(minute_ms, silent_ms), max(recent_ms, silent_ms)
        return None  # a writer in the middle of a write for a hundred reads: take the next reading

    def write_holder(self, trigger_id: int, name: str) -> None:
        sequence = _HOLDER.unpack(self._page[_HOLDER_AT : _HOLDER_AT + _HOLDER.size])[0]
        self._page[_HOLDER_AT : _HOLDER_AT + _HOLDER.size] = _HOLDER.pack(
            sequence + 1, trigger_id, name.encode()[:240]
        )

    def read_holder(self) -> tuple[int, str] | None:
        """(trigger id, task name) the runner's spotter last saw holding its blocked loop; None: none."""
        _, trigger_id, name = _HOLDER.unpack(self._page[_HOLDER_AT : _HOLDER_AT + _HOLDER.size])
        return (trigger_id, name.rstrip(b"\0").decode(errors="replace")) if trigger_id else None


def p99(values: list[float]) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


class LagMeter:
    """The runner's side: a task that samples its own wake-up delay and publishes the percentiles."""

    def __init__(self, board: LagBoard) -> None:
        self.board = board
        self.samples: deque[tuple[float, float]] = deque()  # (time.monotonic(), delay in ms)
        self.quiet_from = -math.inf  # delays before this are start-up, not load
        self.last_tick = time.monotonic()  # read by the spotter's thread

    async def run(self) -> None:
        published = time.monotonic()
        while True:
            before = time.monotonic()
            await asyncio.sleep(TICK)
            now = self.last_tick = time.monotonic()
            self.note(now, (now - before - TICK) * 1000)
            if now - published >= 1.0:
                self.publish(now)
                published = now

    def started(self, coroutines: int) -> None:
        """The runner just created this many coroutines: a big start's first steps are not load."""
        if coroutines >= BIG_START:
            self.quiet_from = time.monotonic() + AFTER_START_SECONDS

    def note(self, now: float, delay_ms: float) -> None:
        if now >= self.quiet_from:
            self.samples.append((now, max(delay_ms, 0.0)))
        while self.samples and self.samples[0][0] < now - WINDOW_SECONDS:
            self.samples.popleft()

    def publish(self, now: float) -> None:
        minute = [delay for _, delay in self.samples]
        recent = [delay for at, delay in self.samples if at >= now - RECENT_SECONDS]
        self.board.write(p99(minute), p99(recent))


class BlockSpotter:
    """A thread beside the runner's event loop. While the loop has not ticked for ``BLOCKED_AFTER`` seconds,
    the task running in it holds it (a trigger that calls ``time.sleep`` or a blocking client with no
    timeout in its coroutine): the spotter writes that task's trigger id to the board. It reads only the
    loop's current task (one dictionary lookup under the GIL), never the runner's own structures. A process
    stopped as a whole (SIGSTOP) spots nothing: the supervisor says so from the process state."""

    def __init__(self, loop: asyncio.AbstractEventLoop, meter: LagMeter) -> None:
        self.loop = loop
        self.meter = meter

    def start(self) -> None:
        threading.Thread(target=self._watch, name="block-spotter", daemon=True).start()

    def _watch(self) -> None:
        noted: tuple[int, str] = (0, "")
        while not self.loop.is_closed():
            time.sleep(SPOT_EVERY)
            holder = self.holder() if time.monotonic() - self.meter.last_tick > BLOCKED_AFTER else (0, "")
            if holder != noted:
                self.meter.board.write_holder(*holder)
                noted = holder

    def holder(self) -> tuple[int, str]:
        task = asyncio.current_task(self.loop)
        name = "" if task is None else task.get_name()
        match = _TRIGGER_ID.search(name)
        return (int(match.group(1)), name) if match else (0, "")
