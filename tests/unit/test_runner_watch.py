"""The runner watch (``smart_triggerer/supervisor/stall.py``) as itself, built from a shared context and
a stand-in for the instance it asks: out of the fleet past ``runner_stall_seconds`` of silence, back in
once the runner answers and the coroutines it ran then have ended; a supervisor that itself did not look
counts the silence from when it looks again."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from smart_triggerer.config import Settings
from smart_triggerer.supervisor.shared import Shared
from smart_triggerer.supervisor.stall import RunnerWatch


class Instance:
    """What the watch asks of the instance, recorded; the runner's last message is set by the test."""

    health_url: str | None = None

    def __init__(self) -> None:
        self.last_message = time.monotonic()
        self.alive: set[int] = {11, 12}
        self.calls: list[str] = []

    def runner_last_message(self) -> float:
        return self.last_message

    def runner_exited(self) -> bool:
        return False

    def runner_pid(self) -> int:
        return 0

    def alive_runners(self) -> set[int]:
        return self.alive

    def hand_every_shard_over(self) -> None:
        self.calls.append("hand every shard over")

    def take_shards_again(self) -> None:
        self.calls.append("take shards again")

    def db_step(self, name: str, step: Callable[[], None]) -> bool:
        self.calls.append(name)  # the step's statements need a database: recorded, not run
        return True

    def publish_snapshot(self) -> None:
        self.calls.append("publish")


@pytest.fixture
def watch() -> tuple[RunnerWatch, Instance]:
    instance = Instance()
    settings = Settings(runner_stall_seconds=5.0, loop_seconds=1.0)
    part = RunnerWatch(Shared(settings=settings, capacity=10), instance)
    part.look()  # the first look starts the count: as if that was a minute ago, and the loop looks often
    part.silence_from -= 60
    return part, instance


def look(part: RunnerWatch) -> None:
    part.watched_at = time.monotonic()  # the loop's last look was a moment ago
    part.look()


def test_silence_past_the_threshold_steps_out_and_hands_every_shard_over(
    watch: tuple[RunnerWatch, Instance],
) -> None:
    part, instance = watch
    instance.last_message = time.monotonic() - 3
    look(part)
    assert part.stall is None and instance.calls == []
    instance.last_message = time.monotonic() - 6
    look(part)
    assert part.stall is not None and "has not answered for 6 s" in part.stall.cause
    assert part.stall.stale_runners == {11, 12}
    assert instance.calls == ["hand every shard over", "step out", "publish"]


def test_back_in_once_the_runner_answers_and_its_old_coroutines_ended(
    watch: tuple[RunnerWatch, Instance],
) -> None:
    part, instance = watch
    instance.last_message = time.monotonic() - 6
    look(part)
    assert part.stall is not None
    part.stall.left = True  # the step out's statements committed
    instance.calls.clear()
    instance.last_message = time.monotonic()  # it answers, but a coroutine of before still runs
    look(part)
    assert instance.calls == []
    instance.alive = {13}  # those ended; a new one runs
    look(part)
    assert instance.calls == ["step in"]


def test_a_supervisor_that_did_not_look_counts_the_silence_from_now(
    watch: tuple[RunnerWatch, Instance],
) -> None:
    part, instance = watch
    instance.last_message = time.monotonic() - 60  # the whole host was frozen: nothing was read
    part.watched_at = time.monotonic() - 60
    part.look()
    assert part.stall is None and instance.calls == []
