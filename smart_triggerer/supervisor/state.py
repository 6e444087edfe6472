"""The conductor's fields (one attrs class over Airflow's ``TriggerRunnerSupervisor``): the context the
parts share and the parts, built in order, each handed what it works with; what the conductor itself
keeps between loops (its loop's timing, the runner's comms, the step that failed last); the way a step
runs (``_db_step``); and, named at the end, what the reports mixin implements for the overrides."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import attrs
import structlog
from airflow.jobs.triggerer_job_runner import (
    TriggerEventEntry,
    TriggerRunnerSupervisor,
)

from smart_triggerer.config import Settings
from smart_triggerer.db.errors import cause, is_outage
from smart_triggerer.db.store import multi_team_enabled
from smart_triggerer.placement.groups import Groups
from smart_triggerer.supervisor.dagbag import DagCache, OneBuildDagBag
from smart_triggerer.supervisor.dead_letters import DeadLetters
from smart_triggerer.supervisor.deadlines import MemberDeadlines
from smart_triggerer.supervisor.events import EventFanout
from smart_triggerer.supervisor.feed import Feed
from smart_triggerer.supervisor.handover import Handover
from smart_triggerer.supervisor.housekeeping import Housekeeping
from smart_triggerer.supervisor.leases import Leases
from smart_triggerer.supervisor.load import LoadFilters
from smart_triggerer.supervisor.log_files import LogFiles
from smart_triggerer.supervisor.shared import Held, MemberInfo, Shared
from smart_triggerer.supervisor.stall import RunnerWatch
from smart_triggerer.supervisor.starting import Starting
from smart_triggerer.waker import Waker

log = structlog.get_logger(logger_name=__name__)


@attrs.define(kw_only=True)
class SupervisorState(TriggerRunnerSupervisor):
    settings: Settings = attrs.field(factory=Settings.from_airflow)
    multi_team: bool = attrs.field(factory=multi_team_enabled)
    health_url: str | None = None
    # what the parts share, and the parts, each owning its state
    shared: Shared = attrs.field(
        init=False,
        default=attrs.Factory(
            lambda self: Shared(
                settings=self.settings,
                capacity=self.capacity,
                job=self.job,
                queues=self.queues,
                team_name=self.team_name,
                multi_team=self.multi_team,
            ),
            takes_self=True,
        ),
    )
    load_filters: LoadFilters = attrs.field(
        init=False,
        default=attrs.Factory(
            # bound late: the starting part is built after this one
            lambda self: LoadFilters(self.shared, starting=lambda: self.starting.backlog()),  # noqa: PLW0108
            takes_self=True,
        ),
    )
    deadlines: MemberDeadlines = attrs.field(
        init=False, default=attrs.Factory(lambda self: MemberDeadlines(self.shared), takes_self=True)
    )
    watch: RunnerWatch = attrs.field(
        init=False, default=attrs.Factory(lambda self: RunnerWatch(self.shared, self), takes_self=True)
    )
    feed: Feed = attrs.field(
        init=False,
        default=attrs.Factory(lambda self: Feed(self.shared, self.deadlines, self), takes_self=True),
    )
    event_fanout: EventFanout = attrs.field(
        init=False, default=attrs.Factory(lambda self: EventFanout(self.shared, self), takes_self=True)
    )
    housekeeping: Housekeeping = attrs.field(
        init=False, default=attrs.Factory(lambda self: Housekeeping(self.shared, self), takes_self=True)
    )
    handover: Handover = attrs.field(
        init=False, default=attrs.Factory(lambda self: Handover(self.shared, self), takes_self=True)
    )
    leases: Leases = attrs.field(
        init=False,
        default=attrs.Factory(
            lambda self: Leases(self.shared, self.feed, self.handover, self.load_filters, self),
            takes_self=True,
        ),
    )
    log_files: LogFiles = attrs.field(
        init=False, default=attrs.Factory(lambda self: self._log_files(), takes_self=True)
    )
    starting: Starting = attrs.field(
        init=False,
        default=attrs.Factory(
            lambda self: Starting(
                self.shared,
                self,
                feed=self.feed,
                deadlines=self.deadlines,
                handover=self.handover,
                log_files=self.log_files,
            ),
            takes_self=True,
        ),
    )

    last_error: str | None = attrs.field(default=None, init=False)
    failed_step: tuple[str, str | None] | None = attrs.field(default=None, init=False)
    runner_changes: int = attrs.field(default=0, init=False)
    nudged: bool = attrs.field(default=False, init=False)  # the runner was nudged and has not asked since
    build_bag: OneBuildDagBag | None = attrs.field(default=None, init=False)
    dag_cache: DagCache = attrs.field(factory=DagCache, init=False)  # between the builds of one start
    published_counters: dict[str, Any] = attrs.field(factory=dict, init=False)
    loops: int = attrs.field(default=0, init=False)
    waker: Waker = attrs.field(factory=Waker, init=False)  # a stop ends the wait in select at once
    last_load: float = attrs.field(default=-math.inf, init=False)
    pending_since: float | None = attrs.field(default=None, init=False)
    db_ok: bool = attrs.field(default=True, init=False)
    # task-state questions the runner's triggers asked (GetTaskStates, GetDRCount): coalesced checks ask
    # one per tick for every wait on one DAG run, not one per wait
    task_state_requests_total: int = attrs.field(default=0, init=False)
    published: dict[str, Any] = attrs.field(factory=dict, init=False)
    stop_code: int = attrs.field(default=0, init=False)  # the exit code of a stop the instance decided on

    def _log_files(self) -> LogFiles:
        return LogFiles(
            self.shared,
            running=lambda: self.running_triggers,
            start_under_way=lambda: self.starting.under_way(),  # noqa: PLW0108  (built after this part)
            logger_cache=self.logger_cache,
        )

    # --- the shared state, read and written through the context the parts share ---

    @property
    def groups(self) -> Groups:
        return self.shared.groups

    @property
    def member_info(self) -> dict[int, MemberInfo]:
        return self.shared.member_info

    @property
    def young_until(self) -> dict[int, float]:
        return self.shared.young_until

    @property
    def held(self) -> dict[int, Held]:
        return self.shared.held

    # what the events part keeps (events.py), for the reports and Airflow's overrides

    @property
    def orphans(self) -> list[TriggerEventEntry]:
        return self.event_fanout.orphans

    @property
    def dead_letters(self) -> DeadLetters:
        return self.event_fanout.dead_letters

    @property
    def watcher_failures(self) -> dict[int, int]:
        return self.event_fanout.watcher_failures

    @property
    def watcher_restarts_total(self) -> int:
        return self.event_fanout.watcher_restarts_total

    @property
    def last_watcher_error(self) -> str | None:
        return self.event_fanout.last_watcher_error

    # the feed's positions and the shards it has still to read (feed.py), for the conductor and the tests

    @property
    def to_read(self) -> set[int]:
        return self.feed.to_read

    @to_read.setter
    def to_read(self, shards: set[int]) -> None:
        self.feed.to_read = shards

    @property
    def load_xmin(self) -> str | None:
        return self.feed.load_xmin

    @load_xmin.setter
    def load_xmin(self, xmin: str | None) -> None:
        self.feed.load_xmin = xmin

    @property
    def hash_xmin(self) -> str | None:
        return self.feed.hash_xmin

    @hash_xmin.setter
    def hash_xmin(self, xmin: str | None) -> None:
        self.feed.hash_xmin = xmin

    @property
    def sweep_after(self) -> int:
        return self.feed.sweep_after

    @sweep_after.setter
    def sweep_after(self, after: int) -> None:
        self.feed.sweep_after = after

    @property
    def user_cancels(self) -> set[int]:
        return self.shared.user_cancels

    @property
    def owned(self) -> set[int]:
        return self.shared.owned

    @owned.setter
    def owned(self, shards: set[int]) -> None:
        self.shared.owned = shards

    @property
    def events_total(self) -> int:
        return self.shared.counters.events

    @events_total.setter
    def events_total(self, total: int) -> None:
        self.shared.counters.events = total

    @property
    def resumed_total(self) -> int:
        return self.shared.counters.resumed

    @resumed_total.setter
    def resumed_total(self, total: int) -> None:
        self.shared.counters.resumed = total

    @property
    def failures_total(self) -> int:
        return self.shared.counters.failures

    @failures_total.setter
    def failures_total(self, total: int) -> None:
        self.shared.counters.failures = total

    @property
    def job_id(self) -> int:
        return self.shared.job_id

    def _db_step(self, name: str, step: Callable[[], None]) -> bool:
        """A step that fails must not stop the service: an outage is logged once, any other error when
        its cause changes; the loop goes on and the step runs again. True when the step succeeded."""
        started = time.monotonic()
        try:
            step()
        except Exception as err:
            self._step_failed(name, err)  # logged there, once per cause: not again as slow
            return False
        else:
            self._note_slow_step(name, time.monotonic() - started)
            if not self.db_ok and name == "load":
                log.info("database reachable again")
                self.db_ok = True
            return True
        finally:
            self.leases.drop_lapsed()

    def _note_slow_step(self, name: str, seconds: float) -> None:
        """A step that succeeded after more than a quarter of a lease delayed every wait of this instance
        (timeouts, events, takeovers wait for the next loop): say so, as Airflow does of a blocked trigger
        loop. The load step runs the timeouts, unreadable, start and heartbeat steps: a slow one of those is
        named before it."""
        if seconds > self.settings.lease_seconds / 4:
            log.warning("a loop step was slow", step=name, seconds=round(seconds, 1))

    def _step_failed(self, name: str, err: Exception) -> None:
        self.last_error = cause(err)
        if is_outage(err):
            if self.db_ok:
                log.warning("database unavailable; retrying every loop", step=name, error=self.last_error)
            self.db_ok = False
        elif self.failed_step != (name, self.last_error):
            # not the database being away: a statement it refused, a lock, or a bug (named, not hidden)
            log.error("a loop step failed; retrying it every loop", step=name, error=self.last_error)
        self.failed_step = (name, self.last_error)

    # --- what the parts call of each other: each is implemented by its part, the conductor has them all ---

    def _counters(self) -> dict[str, Any]:
        raise NotImplementedError  # implemented by a part

    def publish_snapshot(self) -> None:
        raise NotImplementedError  # implemented by a part
