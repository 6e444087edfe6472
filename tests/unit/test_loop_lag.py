"""The runner's event-loop lag (``smart_triggerer/runner/loop_lag.py``): measured in one process, read in
another."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from smart_triggerer.runner import loop_lag
from smart_triggerer.runner.loop_lag import BlockSpotter, LagBoard, LagMeter, p99


def test_the_board_is_shared_with_a_forked_child() -> None:
    board = LagBoard()
    assert board.read() is None  # nothing written yet
    child = os.fork()
    if child == 0:  # the runner's side
        board.write(1234.0, 56.0)
        os._exit(0)
    _, status = os.waitpid(child, 0)
    assert status == 0
    reading = board.read()
    assert reading is not None
    assert reading == (1234.0, 56.0)


def test_a_runner_that_stopped_writing_is_lagging_by_its_silence(monkeypatch: pytest.MonkeyPatch) -> None:
    board = LagBoard()
    board.write(10.0, 10.0)
    written = time.monotonic()
    monkeypatch.setattr(loop_lag.time, "monotonic", lambda: written + 6.0)  # type: ignore[attr-defined]
    reading = board.read()
    assert reading is not None
    assert reading[1] >= 4900  # 6 s silent, less the second it may take between two writes


def test_percentiles_over_the_minute_and_the_recent_window() -> None:
    board = LagBoard()
    meter = LagMeter(board)
    now = 1000.0
    for i in range(600):  # a minute of ticks: late by 500 ms in its first half only
        meter.note(now - 60 + i * 0.1, 500.0 if i < 300 else 5.0)
    meter.publish(now)
    reading = board.read()
    assert reading is not None
    minute, recent = reading
    assert minute == 500.0  # the minute still holds the slow half
    assert recent == 5.0  # the last 10 s do not: an instance that shed is judged by now


def test_a_big_start_is_not_counted_as_load() -> None:
    meter = LagMeter(LagBoard())
    meter.started(loop_lag.BIG_START)
    meter.note(time.monotonic(), 3000.0)  # its first polls
    assert not meter.samples
    meter.started(loop_lag.BIG_START - 1)  # a few new coroutines are ordinary work
    meter.quiet_from = 0.0
    meter.note(time.monotonic(), 20.0)
    assert [delay for _, delay in meter.samples] == [20.0]


@pytest.mark.parametrize(
    ("values", "expected"), [([], 0.0), ([1.0], 1.0), (list(map(float, range(1, 101))), 99.0)]
)
def test_p99(values: list[float], expected: float) -> None:
    assert p99(values) == expected


def test_the_spotter_names_the_trigger_whose_coroutine_blocks_the_loop() -> None:
    """A coroutine that calls time.sleep holds the whole loop: the spotter's thread reads the loop's
    current task and writes its trigger id and name to the board; once the loop ticks again, none."""
    board = LagBoard()
    meter = LagMeter(board)
    name = "dag/run/task/-1/1 (ID 42)"
    seen: list[tuple[int, str] | None] = []

    async def blocking() -> None:
        deadline = time.monotonic() + 10
        while board.read_holder() is None and time.monotonic() < deadline:
            time.sleep(0.05)  # the whole loop waits here, as a blocking client's call would
        seen.append(board.read_holder())

    async def main() -> None:
        ticking = asyncio.create_task(meter.run())
        BlockSpotter(asyncio.get_running_loop(), meter).start()
        await asyncio.sleep(0.3)
        await asyncio.create_task(blocking(), name=name)
        deadline = time.monotonic() + 10
        while board.read_holder() is not None and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        seen.append(board.read_holder())
        ticking.cancel()

    asyncio.run(main())
    assert seen == [(42, name), None]
