"""Shards being given up (a handover, a graceful stop) drain before their leases are released: their
coroutines are cancelled (no on_kill) while the leases are kept, so that an event a coroutine sent before it
ended (a consumed message, a status row the source hands out once) is stored under the lease, not dropped
with the shard. A drain lasts until those coroutines ended or its time is up.

The part owns the shards being given up and their coroutines; it asks the rest of the instance through
``Instance`` (the conductor answers)."""

from __future__ import annotations

import time
from collections.abc import Collection
from typing import Protocol

from smart_triggerer.supervisor.shared import Shared

# a shard given up keeps its lease at most this long (a quarter of a lease at most) while the runner ends
# its coroutines: their events in flight are stored first
DRAIN_SECONDS = 2.0


class Instance(Protocol):
    """What the handover asks of the rest of the instance (the conductor answers)."""

    def alive_runners(self) -> set[int]: ...  # coroutines the runner runs or has been handed
    def events_in_flight(self) -> Collection[int]: ...  # runners whose events wait to be stored
    def runner_changed(self) -> None: ...  # what the runner should run changed: ask it again
    def read_in_full(self, shards: set[int]) -> None: ...  # the next load reads every waiter of these


class Handover:
    def __init__(self, shared: Shared, instance: Instance) -> None:
        self.shared = shared
        self.instance = instance
        # shard -> (drained by, time.monotonic(); the coroutines it ran when it began to leave)
        self.leaving: dict[int, tuple[float, set[int]]] = {}
        self.runners: set[int] = set()  # the coroutines of every shard leaving: the runner ends them

    def drain_seconds(self) -> float:
        return min(DRAIN_SECONDS, self.shared.settings.lease_seconds / 4)

    def drained(self, giving_up: set[int]) -> set[int]:
        """Of the shards this instance gives up, those it may release now: their coroutines are known to
        have ended (each event they sent before is stored by then, under the lease), or their drain took
        its time. The others are being drained (``leave``).

        A shard wanted again stops draining and is read in full by the next load: its waiters without a
        coroutine were forgotten when it began to leave, and nobody else will read them while it stays."""
        if wanted := set(self.leaving) - giving_up:
            for shard in wanted:
                self.leaving.pop(shard)
            self._changed()
            self.instance.read_in_full(wanted)
        if begin := giving_up - set(self.leaving):
            self.leave(begin, time.monotonic() + self.drain_seconds())
        return self.over()  # every shard given up is leaving by now

    def leave(self, shards: set[int], until: float) -> None:
        """Begin giving these shards up: their coroutines end while the leases are kept. Members without a
        running coroutine (waiting for room, or whose coroutine ended) have nothing in flight: they are
        forgotten at once."""
        running = self.instance.alive_runners()
        runners: dict[int, set[int]] = {shard: set() for shard in shards}
        groups = self.shared.groups
        for trigger_id, info in list(self.shared.member_info.items()):
            if info.shard not in shards or trigger_id in self.shared.held:
                continue
            identity_hash = groups.hash_of_member.get(trigger_id)
            group = None if identity_hash is None else groups.by_hash.get(identity_hash)
            runner = None if group is None else group.runner_id
            if runner is not None and runner in running:
                runners[info.shard].add(runner)
            else:
                self.shared.forget_member(trigger_id, user_action=False)
        for shard, ids in runners.items():
            self.leaving[shard] = (until, ids)
        self._changed()

    def over(self) -> set[int]:
        """The shards being given up whose coroutines ended with no event of theirs left to store, or
        whose drain took its time."""
        if not self.leaving:
            return set()
        now = time.monotonic()
        busy = self.instance.alive_runners() | set(self.instance.events_in_flight())
        return {
            shard for shard, (until, runners) in self.leaving.items() if now >= until or not runners & busy
        }

    def forget(self, shards: Collection[int]) -> None:
        """These shards are dropped (released, lapsed, or the instance steps out): no drain is left."""
        if not self.leaving.keys() & set(shards):
            return
        for shard in shards:
            self.leaving.pop(shard, None)
        self._changed()

    def _changed(self) -> None:
        self.runners = set().union(*(ids for _until, ids in self.leaving.values()))
        self.instance.runner_changed()
