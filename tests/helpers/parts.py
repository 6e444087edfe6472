"""A quiet stand-in for the instance the supervisor's parts ask (each part's ``Instance`` protocol): every
answer a part may ask for, each the answer of an idle instance with nothing running. A part's unit test
subclasses it and overrides, or records, what that test is about."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any


class QuietInstance:
    health_url: str | None = None

    def __init__(self) -> None:
        self.alive: set[int] = set()  # coroutines the runner runs or has been handed
        self.load_due = float("inf")  # the latest time.monotonic() the next load was asked for
        self.runner_changes = 0
        self.to_read_in_full: set[int] = set()

    # the conductor's ways
    def stopping(self) -> bool:
        return False

    def db_step(self, name: str, step: Callable[[], None]) -> bool:
        step()
        return True

    # the feed's
    def runner_exited(self) -> bool:
        return False

    def renewed_at(self) -> float:
        return 0.0

    def renew_now(self) -> None: ...

    def drop_lapsed(self) -> None: ...

    def leaving_shards(self) -> Collection[int]:
        return ()

    def published_groups(self) -> Mapping[int, int]:
        return {}

    def start_groups(self) -> None: ...

    def send_to_runner(self) -> None: ...

    # the handover's
    def alive_runners(self) -> set[int]:
        return set(self.alive)

    def events_in_flight(self) -> Collection[int]:
        return ()

    def runner_changed(self) -> None:
        self.runner_changes += 1

    def read_in_full(self, shards: set[int]) -> None:
        self.to_read_in_full |= shards

    # the leases'
    def stalled(self) -> bool:
        return False

    def counters(self) -> dict[str, Any]:
        return {}

    def counters_published(self, counters: dict[str, Any]) -> None: ...

    def publish_snapshot(self) -> None: ...

    def load_by(self, due: float) -> None:
        self.load_due = min(self.load_due, due)

    def step_error(self) -> str | None:
        return None

    # starting's
    def runner_version(self) -> int:
        return self.runner_changes

    def running(self) -> set[int]:
        return self.alive

    def not_to_start(self) -> Iterable[Iterable[int]]:
        return ()

    def cancel(self, runners: set[int]) -> None: ...

    def build(self, trigger_ids: set[int]) -> list[Any]:
        return []

    def hand_out(self, workloads: Sequence[Any]) -> None: ...
