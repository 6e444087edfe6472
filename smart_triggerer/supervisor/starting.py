"""Starting groups: one coroutine per group in Airflow's runner, most urgent first, a batch at a time while
a call's time budget lasts, the runner asked for what changed (its coroutines to start and to cancel), and
the collector's older generations held during a big start. Building the workloads and answering the
runner's requests are Airflow's contract, overridden by the conductor (``runner_comms.py``).

The part owns the order in which the waiting groups start, whether started groups wait for their
workloads, what the runner was last asked for and the collector's hold; it asks the rest of the instance
through ``Instance`` (the conductor answers)."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import structlog

from smart_triggerer.placement.groups import Group
from smart_triggerer.runner.collector import OlderHeld
from smart_triggerer.supervisor.deadlines import MemberDeadlines
from smart_triggerer.supervisor.feed import Feed
from smart_triggerer.supervisor.handover import Handover
from smart_triggerer.supervisor.log_files import LogFiles
from smart_triggerer.supervisor.shared import Shared

log = structlog.get_logger(logger_name=__name__)

# a group whose poll interval no kwarg names is started after those due within this many seconds
UNKNOWN_INTERVAL_SECONDS = 60.0


def start_under_way(hash_xmin: str | None, sweep_after: int, to_read: set[int], owned: set[int]) -> bool:
    """A start or a takeover has more to hand out than the groups waiting now: a sweep's pass hashes on
    (its groups wait to be read), or shards of a phased takeover are still to be read. Between two loops
    of a cold start the groups read so far may all be running: making their files then took the
    supervisor's CPU from the rest of the start (docs/design.md, Measurements behind the code)."""
    return (hash_xmin is None and sweep_after != 0) or bool(to_read & owned)


class RowCannotBeBuilt(Exception):
    """A database error building one row's workload that is not an outage nor a lock: that row cannot
    lead its group, and the build's transaction is lost (the others are built again)."""

    def __init__(self, trigger_id: int) -> None:
        super().__init__(trigger_id)
        self.trigger_id = trigger_id


class Instance(Protocol):
    """What starting asks of the rest of the instance (the conductor answers)."""

    def stopping(self) -> bool: ...
    def send_to_runner(self) -> None: ...  # hand what was started to the runner, read its messages
    def runner_version(self) -> int: ...  # moves on whenever what the runner runs changed
    def running(self) -> set[int]: ...  # the coroutines the runner runs (Airflow's set: read, never changed)
    def not_to_start(self) -> Iterable[Iterable[int]]: ...  # ended, ending, failed or being handed over
    def cancel(self, runners: set[int]) -> None: ...  # the runner is told to end these
    def build(self, trigger_ids: set[int]) -> list[Any]: ...  # workloads (RowCannotBeBuilt: a row refused)
    def hand_out(self, workloads: Sequence[Any]) -> None: ...  # to the runner with its next answer


class Starting:
    def __init__(
        self,
        shared: Shared,
        instance: Instance,
        *,
        feed: Feed,
        deadlines: MemberDeadlines,
        handover: Handover,
        log_files: LogFiles,
    ) -> None:
        self.shared = shared
        self.settings = shared.settings
        self.feed = feed
        self.deadlines = deadlines
        self.handover = handover
        self.log_files = log_files
        self.instance = instance
        # started groups whose workloads are left to build (a build is a batch at most)
        self.build_backlog = False
        self.requested: tuple[int, int] = (-1, -1)  # (groups' version, runner's) when the runner was asked
        # the waiting groups, most urgent first, as sorted when ``groups.arrivals`` was the next field
        self.start_order: list[Group] = []
        self.start_order_arrivals = -1
        self.collector = OlderHeld()  # its older generations, in a start

    def start_groups(self) -> None:
        """Start waiting groups, most urgent first, a batch at a time while this call's time budget lasts
        (the rest in the next call, right after the runner's messages were handled): every loop stays short
        and renews its leases in time, and a takeover of thousands starts in seconds. A build is a batch at
        most, also for groups started while the database was away (``build_backlog``)."""
        groups = self.shared.groups
        groups.wake(time.monotonic())  # failed watchers whose backoff is over
        self.hold_collector()
        self.log_files.pace()  # before the first batch goes out: its lines come back between batches
        deadline = time.monotonic() + self.shared.busy_budget()
        while not self.instance.stopping():
            for group in self._next_to_start(min(self.settings.max_new_per_loop, self.shared.room())):
                groups.start(group)
            self.build_backlog = self.request_started()
            if not self.backlog() or time.monotonic() >= deadline:
                return
            # hand this batch to the runner (it asks, we answer) and read its log lines while building
            # the next: a runner left unanswered stalls on its full log socket
            self.instance.send_to_runner()

    def under_way(self) -> bool:
        return start_under_way(
            self.feed.hash_xmin, self.feed.sweep_after, self.feed.to_read, self.shared.owned
        )

    def hold_collector(self) -> None:
        """No collection of the older generations while a big start runs (``collector.OlderHeld``): groups
        wait to start or to be built, shards of a phased takeover are still to be read, or the first log
        lines of a big hand-out are still held. The last is the runner's own sign: the lines are held
        until none of a new coroutine came for a moment (``LogFiles.pace``), and Airflow counts a
        coroutine running as soon as the runner takes its pile, which it then creates for seconds. The
        collection that fell due ran while it did, on the same two cores (docs/design.md, Measurements
        behind the code)."""
        starting = (
            self.backlog() or bool(self.feed.to_read & self.shared.owned) or self.log_files.pool.holding
        )
        self.collector.update(len(self.shared.groups.unstarted), starting)

    def backlog(self) -> bool:
        """Groups wait for a coroutine (with room for one), or started groups for their workload."""
        return (bool(self.shared.groups.unstarted) and self.shared.room() > 0) or self.build_backlog

    def _next_to_start(self, count: int) -> list[Group]:
        """Up to ``count`` waiting groups, most urgent first. The order is sorted again only when a group
        came to wait since (``Groups.arrivals``) or it ran out: a takeover of tens of thousands starts
        them over many calls, and sorting them all again in each was a sixteenth of the supervisor's
        CPU. Groups started or gone meanwhile are passed over."""
        if count <= 0:
            return []
        groups = self.shared.groups
        if self.start_order_arrivals != groups.arrivals or not self.start_order:
            self.start_order = self._by_urgency() if groups.unstarted else []
            self.start_order_arrivals = groups.arrivals
        batch: list[Group] = []
        taken = 0
        for group in self.start_order:
            taken += 1
            if groups.unstarted.get(group.identity_hash) is group:
                batch.append(group)
                if len(batch) == count:
                    break
        del self.start_order[:taken]
        return batch

    def _by_urgency(self) -> list[Group]:
        """The waiting groups, those whose next poll or earliest member timeout is due soonest first (a
        group just taken over may be due at once; its last poll is not known): asset watchers first, then
        by poll interval or timeout, whichever comes sooner."""
        now = self.shared.db_now()
        timeouts = self.deadlines.soonest()

        def due_in(group: Group) -> float:
            if not all(self.shared.is_task(m) for m in group.members):
                return -math.inf  # an asset watcher: its events come whenever its source has them
            soonest = min((timeouts[m] - now for m in group.members if m in timeouts), default=math.inf)
            return min(soonest, group.poll_interval or UNKNOWN_INTERVAL_SECONDS)

        return sorted(self.shared.groups.unstarted.values(), key=due_in)

    def request_started(self) -> bool:
        """Ask the runner for what changed (idle loops cost nothing); a leader that cannot start hands over
        to the next member at once (bounded passes). True when coroutines are left to build next batch."""
        for _ in range(3):
            state = (self.shared.groups.version, self.instance.runner_version())
            if state == self.requested:
                return False
            retry, more = self._request_runners()
            if more:
                return True  # not recorded as requested: the next call builds the next batch
            self.requested = state
            if not retry:
                return False
        return False

    def _request_runners(self) -> tuple[bool, bool]:
        """Ask the runner for the groups' coroutines, a batch at most (a pile of groups started while the
        database was away is built over several calls, each short). Returns (some leader could not
        start, coroutines were left to build)."""
        requested = self.shared.groups.runners  # read, never changed here
        if self.handover.runners:
            requested = requested - self.handover.runners  # shards being given up: their coroutines end
        running = self.instance.running()
        # the groups' ids the runner neither runs nor has been handed, nor is ending: the running ones
        # first, between two sets kept as they are (a takeover compares tens of thousands of ids once per
        # batch; building their union first cost twice as much), then the few of the others
        new_ids = requested - running
        if new_ids:
            new_ids.difference_update(*self.instance.not_to_start())
        cancel_ids = running - requested
        if cancel_ids:
            self.instance.cancel(cancel_ids)
        more = len(new_ids) > self.settings.max_new_per_loop
        if more:
            new_ids = set(sorted(new_ids)[: self.settings.max_new_per_loop])
        if not new_ids:
            return False, False
        try:
            workloads = self.instance.build(new_ids)
        except RowCannotBeBuilt as err:
            # the build's transaction is aborted: the others are built again in the next pass
            self.next_leader(err.trigger_id)
            return True, more
        self.instance.hand_out(workloads)
        not_started = new_ids - {w.id for w in workloads}
        for trigger_id in not_started:
            self.next_leader(trigger_id)
        return bool(not_started), more

    def next_leader(self, trigger_id: int) -> None:
        """A group's leader row could not start (its task was cleared or timed out between load and start,
        its workload cannot be built): let another member lead, or the group would never run."""
        groups = self.shared.groups
        group = groups.by_runner(trigger_id)
        if group is None:
            return
        group.unstartable.add(trigger_id)
        groups.stop_runner(group)
        leader = groups.start(group)
        log.warning(
            "a group's leader could not start",
            trigger_id=trigger_id,
            next_leader=leader,
            members=len(group.members),
        )
