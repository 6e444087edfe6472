"""What every part of the supervisor shares: its fields (one attrs class) and the few helpers
more than one part calls; the calls parts make into each other are named at the end (each part
implements its own, the conductor inherits them all)."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import attrs
import structlog
from airflow.jobs.triggerer_job_runner import (
    TriggerEventEntry,
    TriggerRunnerSupervisor,
)
from airflow.triggers.base import TriggerEvent
from sqlalchemy.orm import Session

from smart_triggerer.config import Settings
from smart_triggerer.db.errors import cause, is_outage
from smart_triggerer.db.notices import MembershipNotices
from smart_triggerer.db.store import RowScope, Store, multi_team_enabled, space_key
from smart_triggerer.placement.groups import Group, Groups
from smart_triggerer.runner.collector import OlderHeld
from smart_triggerer.supervisor.dagbag import DagCache, OneBuildDagBag
from smart_triggerer.supervisor.dead_letters import DeadLetters
from smart_triggerer.supervisor.log_uploads import LogUploads
from smart_triggerer.supervisor.trigger_logs import LogFilePool, open_files_allowed
from smart_triggerer.waker import Waker

log = structlog.get_logger(logger_name=__name__)

SAMPLE_SECONDS = 60.0  # a point of the page's last-hour chart

FIRST_SAMPLE_SECONDS = 10.0  # after start: once the first loads have grouped the waiters

WATCHER_BACKOFF_MAX_SECONDS = 60.0

@dataclass(frozen=True, slots=True)
class MemberInfo:
    """What the loop needs to know of a member (its row's other fields are not kept)."""

    shard: int
    has_task: bool
    dedupable: bool

@dataclass
class Held:
    """An event kept back for a member whose deferral is too recent to resume safely."""

    event: TriggerEvent
    release_at: float  # time.monotonic()


@dataclass
class Stall:
    """This instance stepped out of the fleet: its runner stopped answering (supervisor/stall.py)."""

    since: float  # time.monotonic() of the runner's last message
    cause: str
    stale_runners: set[int] = field(default_factory=set)  # coroutines running when the instance stepped out
    left: bool = False  # the membership and leases are released (retried every loop until they are)


@attrs.define(kw_only=True)
class SupervisorState(TriggerRunnerSupervisor):
    settings: Settings = attrs.field(factory=Settings.from_airflow)
    multi_team: bool = attrs.field(factory=multi_team_enabled)
    health_url: str | None = None

    groups: Groups = attrs.field(factory=Groups, init=False)
    owned: set[int] = attrs.field(factory=set, init=False)
    member_info: dict[int, MemberInfo] = attrs.field(factory=dict, init=False)
    young_until: dict[int, float] = attrs.field(factory=dict, init=False)
    held: dict[int, Held] = attrs.field(factory=dict, init=False)  # also stored: 0013_held_events.sql
    # shards being given up (leases.py, _leave): shard -> (drained by, time.monotonic(); its coroutines)
    leaving: dict[int, tuple[float, set[int]]] = attrs.field(factory=dict, init=False)
    leaving_runners: set[int] = attrs.field(factory=set, init=False)  # their coroutines, being cancelled
    user_cancels: set[int] = attrs.field(factory=set, init=False)
    # shards taken whose waiters have not been read in full yet: a shard leaves this set only when that
    # read commits (a statement failing later in the loop that took it must not leave it unread)
    to_read: set[int] = attrs.field(factory=set, init=False)
    # owned shards whose lease a write transaction found lapsed by the database clock: dropped after it
    lapsed: set[int] = attrs.field(factory=set, init=False)
    last_error: str | None = attrs.field(default=None, init=False)
    failed_step: tuple[str, str | None] | None = attrs.field(default=None, init=False)
    # how far the change feed has been read (snapshot xmins); None: read everything (start, lost track)
    load_xmin: str | None = attrs.field(default=None, init=False)
    hash_xmin: str | None = attrs.field(default=None, init=False)
    sweep_after: int = attrs.field(default=0, init=False)  # a sweep's pass: the last trigger id it read
    # members' trigger_timeout as (database clock in epoch seconds, trigger id), soonest first
    deadlines: list[tuple[float, int]] = attrs.field(factory=list, init=False)
    # the database clock's last reading (epoch seconds) and time.monotonic() then: between two renewals the
    # database's time is estimated from it, so a step of the database's clock is followed within a loop
    db_clock: tuple[float, float] | None = attrs.field(default=None, init=False)
    # started groups whose workloads are left to build (a build is a batch at most)
    build_backlog: bool = attrs.field(default=False, init=False)
    unreadable: dict[int, tuple[int, str]] = attrs.field(factory=dict, init=False)  # id -> (shard, cause)
    requested: tuple[int, int] = attrs.field(default=(-1, -1), init=False)
    runner_changes: int = attrs.field(default=0, init=False)
    nudged: bool = attrs.field(default=False, init=False)  # the runner was nudged and has not asked since
    build_bag: OneBuildDagBag | None = attrs.field(default=None, init=False)
    dag_cache: DagCache = attrs.field(factory=DagCache, init=False)  # between the builds of one start
    collector: OlderHeld = attrs.field(factory=OlderHeld, init=False)  # its older generations, in a start
    last_cleanup: float = attrs.field(default=-math.inf, init=False)
    last_sweep: float = attrs.field(default=-math.inf, init=False)  # Airflow's full clean_unused
    # the partial index release_left_waits reads (see housekeeping.py): its state, when last looked at, and
    # the thread building it
    left_index: str = attrs.field(default="missing", init=False)
    left_index_checked: float = attrs.field(default=-math.inf, init=False)
    left_index_builder: threading.Thread | None = attrs.field(default=None, init=False)
    left_index_outcome: str | None = attrs.field(default=None, init=False)  # of the last build
    left_pending: set[int] = attrs.field(factory=set, init=False)  # released, trigger row not deleted yet
    last_prune: float = attrs.field(default=-math.inf, init=False)
    last_lingering: float = attrs.field(factory=time.monotonic, init=False)
    last_watcher_check: float = attrs.field(factory=time.monotonic, init=False)
    last_sample: float = attrs.field(factory=lambda: time.monotonic() - SAMPLE_SECONDS + FIRST_SAMPLE_SECONDS,
                                     init=False)
    # the waiters and groups of the latest sample, and when it was recorded: the page's "polls saved" card
    # comes from it, next to groups from the heartbeat, so a change is sampled within FIRST_SAMPLE_SECONDS
    sampled: tuple[int, int] | None = attrs.field(default=None, init=False)
    sampled_at: float = attrs.field(factory=time.monotonic, init=False)
    published_counters: dict[str, Any] = attrs.field(factory=dict, init=False)
    loops: int = attrs.field(default=0, init=False)
    last_renewal: float = attrs.field(default=-math.inf, init=False)
    notices: MembershipNotices | None = attrs.field(default=None, init=False)  # peers' joins and stops
    waker: Waker = attrs.field(factory=Waker, init=False)  # a stop ends the wait in select at once
    last_load: float = attrs.field(default=-math.inf, init=False)
    pending_since: float | None = attrs.field(default=None, init=False)
    # events of coroutines still running whose group this instance forgot (its shards were dropped and may
    # be re-claimed without restarting the coroutine): kept until the group is back or the coroutine ends
    orphans: list[TriggerEventEntry] = attrs.field(factory=list, init=False)
    db_ok: bool = attrs.field(default=True, init=False)
    events_total: int = attrs.field(default=0, init=False)
    resumed_total: int = attrs.field(default=0, init=False)
    failures_total: int = attrs.field(default=0, init=False)
    # identity hash -> failures in a row of a group with asset watchers (reset by its next stored event)
    watcher_failures: dict[int, int] = attrs.field(factory=dict, init=False)
    watcher_restarts_total: int = attrs.field(default=0, init=False)
    # task-state questions the runner's triggers asked (GetTaskStates, GetDRCount): coalesced checks ask
    # one per tick for every wait on one DAG run, not one per wait
    task_state_requests_total: int = attrs.field(default=0, init=False)
    outage_strikes: dict[int, int] = attrs.field(factory=dict, init=False)  # runner id -> in a row
    dead_letters: DeadLetters = attrs.field(factory=DeadLetters, init=False)
    watcher_failed_at: dict[int, float] = attrs.field(factory=dict, init=False)  # time.monotonic()
    last_watcher_error: str | None = attrs.field(default=None, init=False)
    published: dict[str, Any] = attrs.field(factory=dict, init=False)
    log_pool: LogFilePool = attrs.field(factory=lambda: LogFilePool(open_files_allowed()), init=False)
    # the waiting groups, most urgent first, as sorted when ``groups.arrivals`` was ``start_order_arrivals``
    start_order: list[Group] = attrs.field(factory=list, init=False)
    start_order_arrivals: int = attrs.field(default=-1, init=False)
    handing_out_until: float = attrs.field(default=-math.inf, init=False)  # a big start, plus the grace
    holding_since: float = attrs.field(default=-math.inf, init=False)
    # ``groups.arrivals`` when the cap ended a hold: that hand-out begins no new one (None: none ended)
    hold_capped_at: int | None = attrs.field(default=None, init=False)
    held_written_at: float = attrs.field(default=-math.inf, init=False)
    # ended coroutines' log files, closed a time budget per loop (starting.py, ``_close_ended``)
    ended_logs: dict[int, Any] = attrs.field(factory=dict, init=False)
    log_uploads: LogUploads = attrs.field(factory=LogUploads, init=False)  # remote uploads, off the loop
    last_schema_check: float = attrs.field(default=-math.inf, init=False)
    stop_code: int = attrs.field(default=0, init=False)  # the exit code of a stop the instance decided on
    # load and filters (load.py)
    lag_p99_ms: float = attrs.field(default=0.0, init=False)
    lag_recent_ms: float = attrs.field(default=0.0, init=False)
    rss_mb: int = attrs.field(default=0, init=False)
    rss_read_at: float = attrs.field(default=-math.inf, init=False)
    shedding: str | None = attrs.field(default=None, init=False)  # why it takes no new shards
    limit_groups: int | None = attrs.field(default=None, init=False)
    shed_step_at: float = attrs.field(default=-math.inf, init=False)
    calm_since: float | None = attrs.field(default=None, init=False)
    rss_at_step: int = attrs.field(default=0, init=False)  # memory when the last shed step began
    memory_held: bool = attrs.field(default=False, init=False)  # shedding stopped: memory did not fall
    fleet_full: bool = attrs.field(default=False, init=False)
    stall: Stall | None = attrs.field(default=None, init=False)  # out of the fleet: the runner is wedged
    watched_at: float = attrs.field(default=-math.inf, init=False)  # the runner watch's last look
    silence_from: float = attrs.field(default=-math.inf, init=False)  # the watch counts silence from here
    # groups per owned shard as last published with the leases (published again when it changes enough)
    published_loads: dict[int, int] = attrs.field(factory=dict, init=False)
    # groups per shard as their owners last published them (read with each renewal): a takeover reads
    # its first shards, about FIRST_READ_GROUPS groups, before the rest (feed.py)
    shard_groups: dict[int, int] = attrs.field(factory=dict, init=False)
    loads_counted_at: float = attrs.field(default=-math.inf, init=False)
    shards_moved_in: int = attrs.field(default=0, init=False)  # shards taken since start
    shards_moved_out: int = attrs.field(default=0, init=False)  # shards handed over (or dropped) since start

    @property
    def job_id(self) -> int:
        assert self.job is not None, "the smart triggerer always runs under a TriggererJob"
        return int(self.job.id)

    @property
    def queues_key(self) -> str | None:
        """This instance's shard space: its queue set, and its team (each team its own space, as each
        queue set)."""
        return space_key(self.queues, self.team_name)

    @property
    def queue_list(self) -> RowScope:
        """Which trigger rows it runs (Airflow's filters: queues, and the team with ``[core] multi_team``)."""
        return RowScope(tuple(sorted(self.queues)) if self.queues else None, self.team_name, self.multi_team)

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
            self._drop_lapsed()

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

    def _fence(self, session: Session) -> set[int]:
        """The owned shards whose lease still holds, share-locked until this transaction ends. Owned shards
        whose lease lapsed by the database clock are dropped once the caller is done (``_drop_lapsed``)."""
        if not self.owned:
            return set()
        fenced = Store(session).fence(self.job_id, self.owned, self.queues_key)
        self.lapsed |= self.owned - fenced
        return fenced

    def _shard_of(self, trigger_id: int) -> int | None:
        info = self.member_info.get(trigger_id)
        return None if info is None else info.shard

    def _db_now(self) -> float:
        """The database clock now (epoch seconds), from its last reading and the host's monotonic clock."""
        if self.db_clock is None:
            return time.time()
        reading, at = self.db_clock
        return reading + (time.monotonic() - at)

    def _forget_member(self, trigger_id: int, *, user_action: bool) -> None:
        info = self.member_info.pop(trigger_id, None)
        self.young_until.pop(trigger_id, None)
        group = self.groups.leave(trigger_id)
        if group is None or not group.empty:
            return
        # A lone task's trigger left by user action gets on_kill, as in stock Airflow;
        # a shared coroutine never does (its other waiters may still need it).
        lone_task = info is not None and not info.dedupable and info.has_task
        if group.runner_id is not None and user_action and lone_task:
            self.user_cancels.add(group.runner_id)
        self.groups.finish(group)

    def _is_task(self, trigger_id: int) -> bool:
        info = self.member_info.get(trigger_id)
        return info is None or info.has_task

    def _task_members(self, members: Iterable[int]) -> list[int]:
        return [m for m in members if self._is_task(m)]

    def _room(self) -> int:
        """Coroutines this instance may still start: capacity is a cap, as in Airflow's triggerer, also
        when the whole fleet is full (then the rest wait, deferred, most urgent first, for room)."""
        return max(0, self.capacity - len(self.groups.runners))

    def _waiting_for_room(self) -> int:
        """Groups held but not run: the instance is at its capacity."""
        return len(self.groups.unstarted) if self._room() == 0 else 0

    def _busy_budget(self) -> float:
        """Seconds one call may spend starting groups or hashing rows before the loop goes on."""
        return max(0.25, self.settings.lease_seconds * 0.1)

    # --- what the parts call of each other: each is implemented by its part, the conductor has them all ---

    def _counters(self) -> dict[str, Any]:
        raise NotImplementedError  # implemented by a part

    def publish_snapshot(self) -> None:
        raise NotImplementedError  # implemented by a part

    def _heartbeat_counters(self) -> None:
        raise NotImplementedError  # implemented by a part

    def _renew_leases(self) -> None:
        raise NotImplementedError  # implemented by a part

    def _renew_now(self) -> None:
        raise NotImplementedError  # implemented by a part

    def _update_filters(self) -> None:
        raise NotImplementedError  # implemented by a part

    def _note_fleet(self, full: bool) -> None:
        raise NotImplementedError  # implemented by a part

    def _load_counters(self) -> dict[str, object]:
        raise NotImplementedError  # implemented by a part

    def listen_for_peers(self) -> None:
        raise NotImplementedError  # implemented by a part

    def _guard_leases(self) -> None:
        raise NotImplementedError  # implemented by a part

    def _fail_unreadable(self) -> None:
        raise NotImplementedError  # implemented by a part

    def _timeout_members(self) -> None:
        raise NotImplementedError  # implemented by a part

    def _start_groups(self) -> None:
        raise NotImplementedError  # implemented by a part

    def _start_backlog(self) -> bool:
        raise NotImplementedError  # implemented by a part

    def _drop_lapsed(self) -> None:
        raise NotImplementedError  # implemented by a part

    def _request_started(self) -> bool:
        raise NotImplementedError  # implemented by a part

    def _finish_leaving(self) -> None:
        raise NotImplementedError  # implemented by a part

