"""This instance's load and its filters: what it reports with each heartbeat (groups, waiters, event-loop
lag, memory, capacity) and whether it takes new shards (placement.py reads both from every instance).

An instance whose runner lags over ``max_loop_lag_ms`` (p99 over the last 10 s) or whose memory is over
``max_rss_mb`` stops taking new shards and asks to come down to three quarters of its groups, then another
quarter every ``SHED_STEP_SECONDS`` while it is still over (once the last step took effect; for memory,
only while each step brought it down: see ``_shedding_helps``). It takes
shards again only once it has been under half the lag limit and under the memory limit for
``CALM_SECONDS``, and then a step at a time (its limit raised a third, at least a twentieth of its
capacity, every ``SHED_STEP_SECONDS`` while
calm, up to its capacity): the hysteresis that keeps shards from flapping between an instance on the
edge and the others. Capacity needs no state here: placement gives no instance more groups than its
capacity while another has room under its own.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import psutil
import structlog

from smart_triggerer.runner.trigger_runner import LAG_BOARD
from smart_triggerer.supervisor.shared import Shared

log = structlog.get_logger(logger_name=__name__)

SHED_STEP = 0.75  # each step keeps this much of the groups
SHED_STEP_SECONDS = 10.0  # the lag window's length: a step shows in the lag after that
CALM_SECONDS = 30.0
RSS_EVERY_SECONDS = 5.0
EASE_STEPS_AT_LEAST = 20  # easing back from a small limit reaches the capacity within this many steps
MEMORY_STEP_FALL = 0.95  # a memory step helped if the RSS fell at least 5% (a few MB is noise)


class LoadFilters:
    """Owns the instance's load readings and its shedding state; the leases ask it, before each renewal,
    whether the instance takes new shards (``accepting``) and how many groups it asks to come down to
    (``limit_groups``)."""

    def __init__(self, shared: Shared, starting: Callable[[], bool]) -> None:
        self.shared = shared
        self.settings = shared.settings
        self.groups = shared.groups
        self._start_backlog = starting  # a start is under way: work that just arrived, not load to shed
        self.lag_p99_ms = 0.0
        self.lag_recent_ms = 0.0
        self.rss_mb = 0
        self.rss_read_at = -math.inf
        self.shedding: str | None = None  # why it takes no new shards
        self.limit_groups: int | None = None
        self.shed_step_at = -math.inf
        self.calm_since: float | None = None
        self.rss_at_step = 0  # memory when the last shed step began
        self.memory_held = False  # shedding stopped: memory did not fall
        self.fleet_full = False

    @property
    def accepting(self) -> bool:
        return self.shedding is None

    def _measure_load(self) -> None:
        reading = LAG_BOARD.read()
        if reading is not None:
            self.lag_p99_ms, self.lag_recent_ms = reading
        now = time.monotonic()
        if now - self.rss_read_at >= RSS_EVERY_SECONDS:
            self.rss_read_at = now
            self.rss_mb = _tree_rss_mb()

    def update(self) -> None:
        """Start, deepen, ease or end shedding by this instance's lag and memory (before each renewal)."""
        self._measure_load()
        now = time.monotonic()
        over = self._over_limits()
        if over and self._start_backlog():
            over = None  # starting a takeover is work that just arrived here, not a reason to send it away
        if over:
            self.calm_since = None
            if self.shedding is None:  # accepting until now (also while easing back): stop at once
                self._shed(over, now, "over a limit: taking no new shards and handing shards over")
            elif self._step_due(now) and self._shedding_helps(over):
                self._shed(over, now, "still over a limit: handing more shards over")
        elif self.limit_groups is not None or self.shedding is not None:
            self._ease(now)

    def _step_due(self, now: float) -> bool:
        """Another step down once the last one took effect (the groups came down to the limit) and had a
        lag window to show in: while shards cannot move (no room elsewhere), the limit does not sink to 0.
        Holding nothing, there is nothing to step down from."""
        held = self.groups.group_count()
        return (
            held > 0
            and now - self.shed_step_at >= SHED_STEP_SECONDS
            and (self.limit_groups is None or held <= self.limit_groups)
        )

    def _shedding_helps(self, over: str) -> bool:
        """Another step only if the last one brought the memory down. CPython seldom gives freed memory
        back to the system (an arena is returned only once every object in it is gone): an instance whose
        memory stays at its high-water mark after handing groups over would otherwise hand over every
        shard and then sit idle, still over. It keeps what it holds and takes nothing new instead."""
        if not over.startswith("memory") or self.limit_groups is None:  # lag, or no step taken yet
            return True
        if self.rss_mb <= MEMORY_STEP_FALL * self.rss_at_step:  # more than noise: groups gave memory back
            return True
        if not self.memory_held:
            log.warning(
                "memory not given back after handing shards over: keeping the groups held and "
                "taking no new shards (restart the instance to return its memory)",
                rss_mb=self.rss_mb,
                max_rss_mb=self.settings.max_rss_mb,
                groups=self.groups.group_count(),
            )
            self.memory_held = True
            self.shedding = f"{over}, not given back by handing shards over: holding"
        return False

    def _ease(self, now: float) -> None:
        """Under the limits: after ``CALM_SECONDS`` of calm take new shards again, but raise the limit a
        third per step (the load that made the runner lag would make it lag again), and drop it once it
        reaches the capacity."""
        if not self._calm():
            self.calm_since = None
            return
        if self.calm_since is None:
            self.calm_since = now
        if now - self.calm_since < CALM_SECONDS or now - self.shed_step_at < SHED_STEP_SECONDS:
            return
        if self.shedding is not None:
            log.info("back under the limits: taking shards again, a step at a time", was=self.shedding)
            self.shedding = None
            self.memory_held = False
        if self.limit_groups is None:  # it never held groups while over: nothing to raise
            return
        self.shed_step_at = now
        # raised until it cannot bind (a shard's size makes "the raise was not taken up" no sign of that),
        # by a third, and by a twentieth of the capacity at least (from a small limit, a third is nothing)
        self.limit_groups = max(
            int(self.limit_groups / SHED_STEP),
            self.limit_groups + max(1, self.shared.capacity // EASE_STEPS_AT_LEAST),
        )
        if self.limit_groups >= self.shared.capacity:
            self.limit_groups = None

    def _over_limits(self) -> str | None:
        limits = self.settings
        if limits.max_loop_lag_ms and self.lag_recent_ms > limits.max_loop_lag_ms:
            return (
                f"event-loop lag p99 {self.lag_recent_ms:.0f} ms > "
                f"max_loop_lag_ms {limits.max_loop_lag_ms:.0f}"
            )
        if limits.max_rss_mb and self.rss_mb > limits.max_rss_mb:
            return f"memory {self.rss_mb} MB > max_rss_mb {limits.max_rss_mb}"
        return None

    def _calm(self) -> bool:
        limits = self.settings
        # memory: under the limit itself. CPython seldom gives memory back, so an instance that came down
        # to 95% of it would never reach a lower band and never take a shard again; the calm time and the
        # easing steps are the hysteresis
        return (not limits.max_loop_lag_ms or self.lag_recent_ms < limits.max_loop_lag_ms / 2) and (
            not limits.max_rss_mb or self.rss_mb < limits.max_rss_mb
        )

    def _shed(self, reason: str, now: float, message: str) -> None:
        groups = self.groups.group_count()
        self.shedding, self.shed_step_at = reason, now
        self.calm_since = None
        self.memory_held = False  # a new step: whether it gives memory back is judged after it
        if groups == 0:
            # over already with nothing held (a start whose memory alone passes max_rss_mb): take no new
            # shards, but a limit of 0 would say nothing; the first step comes once it holds groups
            log.warning(message, reason=reason, groups=groups, limit=self.limit_groups)
            return
        base = groups if self.limit_groups is None else min(groups, self.limit_groups)
        self.limit_groups = max(int(base * SHED_STEP), 1)  # 0 would take ages to raise again
        self.rss_at_step = self.rss_mb
        log.warning(message, reason=reason, groups=groups, limit=self.limit_groups)

    def note_fleet(self, full: bool) -> None:
        """Say once when the fleet became full (every instance at its capacity or limits, or this one has
        waits beyond its capacity) and once when it no longer is; while full, shards stay where they run,
        none is left without an instance, and no instance runs more than its capacity: the waits beyond
        it stay deferred and start, most urgent first, as room frees or an instance joins."""
        full = full or self.shared.waiting_for_room() > 0
        if full and not self.fleet_full:
            log.warning(
                "the fleet is full: every instance is at its capacity or limits; waits beyond "
                "capacity stay deferred and start, most urgent first, as room frees or an instance "
                "joins (add an instance or raise --capacity)",
                waiting_for_room=self.shared.waiting_for_room(),
            )
        elif self.fleet_full and not full:
            log.info("the fleet has room again")
        self.fleet_full = full

    def counters(self) -> dict[str, object]:
        return {
            "lag_p99_ms": round(self.lag_p99_ms, 1),
            "rss_mb": self.rss_mb,
            "accepting": self.shedding is None,
            "limit_groups": self.limit_groups,
            "shedding": self.shedding,
            "fleet_full": self.fleet_full,
            "waiting_for_room": self.shared.waiting_for_room(),
        }


def _tree_rss_mb() -> int:
    """Resident memory of this process and its children (the runner), in MB."""
    try:
        me = psutil.Process()
        processes = [me, *me.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for process in processes:
        try:
            total += process.memory_info().rss
        except psutil.Error:
            continue  # ended meanwhile
    return total // 2**20
