"""The trigger log files of the instance's coroutines: written through a bounded pool of open descriptors
(``trigger_logs.py``: an instance may run more coroutines than it may open files), their first lines held
in memory while a big start or takeover hands coroutines out, then made in the background a time budget
at a time; ended coroutines' files closed (and uploaded, off the loop: ``log_uploads.py``) a budget per
pass, not while Airflow handles the runner's message; and on the way out, what is left written within
the exit's budget. The part owns the pool, the ended files, the uploads and the pacing; the starting part
hands it new files, the conductor its loop's passes."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection
from typing import Any

import structlog

from smart_triggerer.supervisor.log_uploads import LogUploads
from smart_triggerer.supervisor.shared import Shared
from smart_triggerer.supervisor.trigger_logs import LogFilePool, close_ended, open_files_allowed

log = structlog.get_logger(logger_name=__name__)

# a takeover or start of at least this many coroutines holds their first log lines until they all run,
# and their log files are made this long after the runner reported the last one running (trigger_logs.py)
HOLD_LOG_LINES_FROM = 100

HELD_LOG_LINES_SECONDS = 2.0

HOLD_LOG_LINES_MAX_SECONDS = 60.0  # a group that never reports running must not hold lines for ever

# then held files are made in the background: at most this long per pass and one pass per this interval
# (a quarter of a core; making and processing them all at once took a core for seconds, from the runner
# still making its first polls)
WRITE_HELD_SECONDS = 0.05

WRITE_HELD_EVERY_SECONDS = 0.2

# on the way out (the leases already released, at the lowest CPU priority): log files still to write, up
# to this long after the stop signal. Made in the background at a quarter of a core, a big takeover's held
# first lines take a long time to write; a rolling restart stops the instance that took them over within
# that time, and with a second for them thousands of those files lost their lines (measured:
# docs/design.md). Inside a grace period of 30 s (Kubernetes' default), with a few seconds to spare.
EXIT_LOG_SECONDS = 25.0
EXIT_REFUSED_AT_MOST = 100  # writes the file system refuses at exit before the rest are given up on
EXIT_SAY_FILES_FROM = 1000  # so many files to write at exit: said before, as the exit takes seconds


class LogFiles:
    def __init__(
        self,
        shared: Shared,
        *,
        running: Callable[[], Collection[int]],
        start_under_way: Callable[[], bool],
        logger_cache: dict[int, Any],
    ) -> None:
        self.shared = shared
        self.running = running  # the coroutines the runner reports running (Airflow's running_triggers)
        self.start_under_way = start_under_way  # a start or takeover has more to hand out (starting.py)
        self.logger_cache = logger_cache  # Airflow's: each running coroutine's log file factory
        self.pool = LogFilePool(open_files_allowed())
        self.uploads = LogUploads()  # remote uploads, off the loop
        # ended coroutines' log files, closed a time budget per pass (``close_ended``)
        self.ended: dict[int, Any] = {}
        self.handing_out_until = -math.inf  # a big start, plus the grace
        self.holding_since = -math.inf
        # ``groups.arrivals`` when the cap ended a hold: that hand-out begins no new one (None: none ended)
        self.hold_capped_at: int | None = None
        self.written_at = -math.inf

    def pace(self) -> None:
        """While a takeover or a start hands out coroutines (and for a moment after), their first log lines
        are held in memory; then their files are made in the background, ``WRITE_HELD_SECONDS`` per
        ``WRITE_HELD_EVERY_SECONDS`` (trigger_logs.py): making tens of thousands of files would otherwise be
        most of the supervisor's work while waits wait."""
        self.uploads.check()  # an upload past its timeout is given up, a new worker takes the queue
        now = time.monotonic()
        groups = self.shared.groups
        # groups without a coroutine yet: not started, started but not built, or not yet taken by the
        # runner (Airflow counts them running once taken; the runner then creates a pile for seconds)
        to_run = len(groups.unstarted) + len(groups.hash_of_runner) - len(self.running())
        if not self.pool.holding:
            self.holding_since = now
        if to_run < HOLD_LOG_LINES_FROM:
            self.hold_capped_at = None
        if now - self.holding_since >= HOLD_LOG_LINES_MAX_SECONDS:
            # held long enough: groups that never report running (a database away while they are built)
            # begin no new hold for the same hand-out; a new arrival, or a new pile once under the mark, does
            self.hold_capped_at = groups.arrivals
        elif (
            (to_run >= HOLD_LOG_LINES_FROM and self.hold_capped_at != groups.arrivals)
            # a start under way extends a hold a big hand-out began, never begins one
            or (self.pool.holding and (to_run > 0 or self.start_under_way()))
        ):
            self.handing_out_until = now + HELD_LOG_LINES_SECONDS
        elif self.pool.holding:
            # reported running is not started yet: a runner given thousands at once runs their first
            # steps (and their first lines) for seconds after; hold while new files' lines still come
            self.handing_out_until = max(
                self.handing_out_until, self.pool.new_file_held_at + HELD_LOG_LINES_SECONDS
            )
        self.pool.holding = now < self.handing_out_until
        if now - self.written_at < WRITE_HELD_EVERY_SECONDS:
            return
        if self.ended or (not self.pool.holding and self.pool.held):
            self.written_at = now
            # ended coroutines' files first: they are complete, and closing one may upload it
            left = self.close_ended(WRITE_HELD_SECONDS)
            if not self.pool.holding:
                self.pool.write_held(left)

    def pending(self) -> bool:
        """Log files wait to be made (held first lines) or closed (ended coroutines): the loop comes back
        every ``WRITE_HELD_EVERY_SECONDS`` for them, not once per loop (a loop of a second made only a
        fifth of them in the time meant for all)."""
        return bool(self.ended or self.pool.held)

    def write_at_exit(self, budget_seconds: float) -> None:
        """On the way out, for up to ``budget_seconds``: the held lines of every file first (a recent
        start's or takeover's first lines, ended coroutines' last ones), written locally, then ended
        coroutines' files closed (and uploaded, where remote logging is set: a slow remote must not cost
        the local lines; an upload under way is not cut short). A file system that refuses
        ``EXIT_REFUSED_AT_MOST`` writes ends it early. What is left is said, not silently lost."""
        deadline = time.monotonic() + budget_seconds
        self.pool.holding = False
        held, ended = len(self.pool.held), len(self.ended)
        if held + ended >= EXIT_SAY_FILES_FROM:
            log.info(
                "writing trigger log files before exit",
                held=held,
                ended=ended,
                at_most_seconds=round(budget_seconds, 1),
            )
        refused = self.pool.refused_writes
        if self.pool.write_held(budget_seconds, refused_at_most=EXIT_REFUSED_AT_MOST):
            log.warning(
                "trigger log lines not written at exit",
                files=len(self.pool.held),
                refused_writes=self.pool.refused_writes - refused,
            )
        if self.ended and self.pool.refused_writes - refused < EXIT_REFUSED_AT_MOST:
            self.close_ended(max(deadline - time.monotonic(), 0.0))
        if self.ended:
            log.warning("ended triggers' log files not closed at exit", files=len(self.ended))

    def close_later(self, finished: Any) -> None:
        """Airflow closes (and uploads) an ended coroutine's log file while it handles the runner's
        message. A handover of thousands ends thousands at once, each file made then if its lines were
        still held: the loop stood for seconds, past the lease (docs/design.md, Measurements behind the
        code). Their files are taken out of Airflow's way here and closed a time budget per loop
        (``close_ended``)."""
        for trigger_id in finished:
            if (factory := self.logger_cache.pop(trigger_id, None)) is not None:
                self.close_now(trigger_id)  # an older file of the same id first (it ended before)
                self.ended[trigger_id] = factory

    def close_ended(self, budget_seconds: float) -> float:
        """Close ended coroutines' log files, oldest first, for up to ``budget_seconds`` (one at least);
        returns the budget left."""
        deadline = time.monotonic() + budget_seconds
        while self.ended:
            self.close_now(next(iter(self.ended)))  # one at least: every pass makes progress
            if time.monotonic() >= deadline:
                break
        return max(deadline - time.monotonic(), 0.0)

    def close_now(self, trigger_id: int) -> None:
        """As Airflow does when a coroutine ends: close its file and upload it (when remote logging is set),
        the upload off this loop (log_uploads.py): a hanging remote store must not hold the leases."""
        factory = self.ended.pop(trigger_id, None)
        if factory is not None:
            close_ended(trigger_id, factory, self.uploads)
