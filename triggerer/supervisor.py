"""The smart supervisor: Airflow's ``TriggerRunnerSupervisor`` with identity groups and shard leases.

Each loop it (1) renews its membership and the leases of the shards rendezvous hashing gives it,
(2) computes the identity of new trigger rows once, (3) reads the waiters that arrived or left since the
last loop from the change feed (``sql/0005_change_feed.sql``; every waiter only of a shard just taken),
keeps them in identity groups and asks Airflow's runner subprocess for one coroutine per group (so a loop
in which nothing changed reads no rows and costs nothing per waiter), (4) fans every event out to all
members of the group in one transaction, holding it back for members that deferred too recently, and
(5) fails every member when the group's trigger fails. Everything else (the runner, trigger logs,
connections, the task-SDK comms) is Airflow's; trigger log files are written through a bounded pool of
open descriptors (``trigger_logs.py``), as an instance may run more coroutines than it may open files.

Every write for a member runs in a transaction that first share-locks the member's shard lease and
checks it by the database clock (``Store.fence``): a process paused past its lease writes nothing for
shards another instance took over. An event is acknowledged to the runner (``persisted_event_seqs``)
only after it was stored; an event that cannot be stored fails its own members, never the whole loop.
"""

from __future__ import annotations

import heapq
import math
import select as io_select
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import attrs
import structlog
from airflow.jobs.triggerer_job_runner import (
    TriggerEventEntry,
    TriggerLoggingFactory,
    TriggerRunnerSupervisor,
    messages,
)
from airflow.models.taskinstance import TaskInstance
from airflow.models.trigger import Trigger
from airflow.triggers.base import TriggerEvent
from airflow.utils.net import get_hostname
from airflow.utils.session import create_session
from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, selectinload

from triggerer import fanout
from triggerer.config import ConfigError, Settings
from triggerer.dagbag import DagCache, OneBuildDagBag
from triggerer.db_errors import blames_event, cause, is_outage, is_transient
from triggerer.dead_letters import DEAD_AFTER, DeadLetters, payload_text
from triggerer.groups import Group, Groups
from triggerer.identities import compute_identities, group_key
from triggerer.rendezvous import Member, assign, shards_of
from triggerer.runner import SmartTriggerRunner
from triggerer.store import Store, WaitingTrigger
from triggerer.trigger_logs import LogFilePool, PooledTriggerLoggingFactory, open_files_allowed

if TYPE_CHECKING:
    from airflow.models.dagbag import DBDagBag

log = structlog.get_logger(logger_name=__name__)

# after a member's membership lapses, its leases (renewed just before its heartbeat) have expired too
LAPSE_MARGIN_SECONDS = 0.05
# Airflow's clean_unused (how departures reach the change feed: it deletes unused trigger rows) and feed
# pruning run this often, not every loop: a departed waiter's coroutine may poll a few seconds longer,
# but a resume or timeout never reaches a task that is not deferred any more
CLEANUP_SECONDS = 5.0
PRUNE_SECONDS = 30.0
LINGERING_SECONDS = 60.0
SAMPLE_SECONDS = 60.0  # a point of the page's last-hour chart
FIRST_SAMPLE_SECONDS = 10.0  # after start: once the first loads have grouped the waiters
# a failed asset watcher starts again after 1 s, then 2, 4... up to a minute while it keeps failing
WATCHER_BACKOFF_SECONDS = 1.0
MIGRATE_WAIT_SECONDS = 60.0  # start-up: how long migrations are tried again while their locks are busy
WATCHER_BACKOFF_MAX_SECONDS = 60.0
# an event whose transaction the server ends this many times in a row while the database answers (a
# listener slower than the idle-in-transaction limit) is failed as its own fault
OUTAGE_STRIKES = 3
# a group whose poll interval no kwarg names is started after those due within this many seconds
UNKNOWN_INTERVAL_SECONDS = 60.0
# a takeover or start of at least this many coroutines holds their first log lines until they all run,
# and their log files are made this long after the runner reported the last one running (trigger_logs.py)
HOLD_LOG_LINES_FROM = 100
LOG_READS_BEFORE_FINISHING = 1024  # reads of Airflow's 4 KB each: the runner's biggest batch is 256 KB
HELD_LOG_LINES_SECONDS = 2.0
HOLD_LOG_LINES_MAX_SECONDS = 60.0  # a group that never reports running must not hold lines for ever
# then held files are made in the background: at most this long per pass and one pass per this interval
# (a quarter of a core; making and processing them all at once took a core for seconds, from the runner
# still making its first polls)
WRITE_HELD_SECONDS = 0.05
WRITE_HELD_EVERY_SECONDS = 0.2


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


def _failure_cause(exc: Any) -> str:
    """A runner-reported failure in one line: an exception, the traceback lines it was sent as, or none."""
    if isinstance(exc, BaseException):
        return cause(exc)
    lines = [line.strip() for line in exc or () if isinstance(line, str) and line.strip()]
    return lines[-1].splitlines()[-1] if lines else "the trigger exited without sending an event"


class _RowCannotBeBuilt(Exception):
    """A database error building one row's workload that is not an outage nor a lock: that row cannot
    lead its group, and the build's transaction is lost (the others are built again)."""

    def __init__(self, trigger_id: int) -> None:
        super().__init__(trigger_id)
        self.trigger_id = trigger_id


@attrs.define(kw_only=True)
class SmartTriggerRunnerSupervisor(TriggerRunnerSupervisor):
    settings: Settings = attrs.field(factory=Settings.from_airflow)
    health_url: str | None = None

    groups: Groups = attrs.field(factory=Groups, init=False)
    owned: set[int] = attrs.field(factory=set, init=False)
    member_info: dict[int, MemberInfo] = attrs.field(factory=dict, init=False)
    young_until: dict[int, float] = attrs.field(factory=dict, init=False)
    held: dict[int, Held] = attrs.field(factory=dict, init=False)
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
    build_bag: OneBuildDagBag | None = attrs.field(default=None, init=False)
    dag_cache: DagCache = attrs.field(factory=DagCache, init=False)  # between the builds of one start
    last_cleanup: float = attrs.field(default=-math.inf, init=False)
    last_prune: float = attrs.field(default=-math.inf, init=False)
    last_lingering: float = attrs.field(factory=time.monotonic, init=False)
    last_sample: float = attrs.field(factory=lambda: time.monotonic() - SAMPLE_SECONDS + FIRST_SAMPLE_SECONDS,
                                     init=False)
    # the waiters and groups of the latest sample, and when it was recorded: the page's "polls saved" card
    # comes from it, next to groups from the heartbeat, so a change is sampled within FIRST_SAMPLE_SECONDS
    sampled: tuple[int, int] | None = attrs.field(default=None, init=False)
    sampled_at: float = attrs.field(factory=time.monotonic, init=False)
    published_counters: dict[str, Any] = attrs.field(factory=dict, init=False)
    loops: int = attrs.field(default=0, init=False)
    last_renewal: float = attrs.field(default=-math.inf, init=False)
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
    outage_strikes: dict[int, int] = attrs.field(factory=dict, init=False)  # runner id -> in a row
    dead_letters: DeadLetters = attrs.field(factory=DeadLetters, init=False)
    watcher_failed_at: dict[int, float] = attrs.field(factory=dict, init=False)  # time.monotonic()
    last_watcher_error: str | None = attrs.field(default=None, init=False)
    published: dict[str, Any] = attrs.field(factory=dict, init=False)
    log_pool: LogFilePool = attrs.field(factory=lambda: LogFilePool(open_files_allowed()), init=False)
    handing_out_until: float = attrs.field(default=-math.inf, init=False)  # a big start, plus the grace
    holding_since: float = attrs.field(default=-math.inf, init=False)
    held_written_at: float = attrs.field(default=-math.inf, init=False)

    @classmethod
    def run_in_process(cls) -> None:
        SmartTriggerRunner().run()

    @property
    def job_id(self) -> int:
        assert self.job is not None, "the smart triggerer always runs under a TriggererJob"
        return int(self.job.id)

    @property
    def queues_key(self) -> str | None:
        return ",".join(sorted(self.queues)) if self.queues else None

    @property
    def queue_list(self) -> list[str] | None:
        return sorted(self.queues) if self.queues else None

    # --- the loop ---

    def register(self) -> None:
        """Migrate the schema (each lock waited for briefly, the whole tried again for up to a minute:
        a migration queued behind a reader must not hold up the running instances' heartbeats behind
        it) and join the membership."""
        deadline = time.monotonic() + MIGRATE_WAIT_SECONDS
        delay = 0.2
        while True:
            try:
                self._migrate_and_join()
                break
            except SQLAlchemyError as err:
                if not is_transient(err) or time.monotonic() + delay > deadline:
                    raise
                log.info("the schema is busy (another instance migrating, or a reader); trying again",
                         error=cause(err), retry_in=delay)
                time.sleep(delay)
                delay = min(delay * 2, 2.0)
        self.publish_snapshot()

    def _migrate_and_join(self) -> None:
        with create_session() as session:
            store = Store(session)
            store.migrate(self.settings.shards)
            self._refuse_overlapping_queues(store)
            store.register(self.job_id, get_hostname(), self.capacity, self.queues_key,
                           health_url=self.health_url, shards=self.settings.shards)

    def _refuse_overlapping_queues(self, store: Store) -> None:
        """Queue sets own separate shard spaces: two sets that share a queue would both run its triggers."""
        mine = set(self.queues or ())
        for other in store.live_queue_sets(self.settings.lease_seconds):
            theirs = {q for q in other.split(",") if q}
            if theirs != mine and theirs & mine:
                raise ConfigError(
                    f"--queues {','.join(sorted(mine))} overlaps a live instance's --queues {other}: "
                    "instances must serve either the same queue set or disjoint ones"
                )

    def run_once(self) -> None:
        """Load once per ``loop_seconds``; in between, handle runner messages (events) as they come."""
        self._guard_leases()
        since_load = time.monotonic() - self.last_load
        if since_load >= self.settings.loop_seconds:
            self.loops += 1
            self.last_load = time.monotonic()
            self._db_step("load", self.load_triggers)
            self._db_step("cleanup", self._housekeeping)
        elif self._start_backlog():
            # a takeover or a start: keep starting coroutines between loads, a time budget at a time
            self._db_step("start", self._start_groups)
        if not self._start_backlog():
            self.dag_cache.clear()  # the start is over
        self._pace_log_files()
        # until the next load: a loop after the last one, or sooner when a member's membership lapses; at
        # once while groups still wait for a coroutine (events are handled between batches)
        wait = max(self.settings.loop_seconds - (time.monotonic() - self.last_load), 0.0)
        self._service_subprocess(0.0 if self._start_backlog() else wait)
        # lease checks run before writes: shards that may have lapsed while we waited stop first
        self._guard_leases()
        self._db_step("events", self.handle_events)
        self._db_step("failures", self.handle_failed_triggers)
        self._db_step("held events", self.release_held)
        self._db_step("heartbeat", self.heartbeat)
        self._track_pending()
        self.emit_metrics()
        self.publish_snapshot()

    def _track_pending(self) -> None:
        """Since when events have waited to be stored (/health fails once that exceeds a lease)."""
        self.pending_since = (self.pending_since or time.monotonic()) if self.events else None

    def _db_step(self, name: str, step: Callable[[], None]) -> bool:
        """A step that fails must not stop the service: an outage is logged once, any other error when
        its cause changes; the loop goes on and the step runs again. True when the step succeeded."""
        try:
            step()
        except Exception as err:
            self._step_failed(name, err)
            return False
        else:
            if not self.db_ok and name == "load":
                log.info("database reachable again")
                self.db_ok = True
            return True
        finally:
            self._drop_lapsed()

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

    def _guard_leases(self) -> None:
        """Stop running shards before their leases can expire when they cannot be renewed.

        A slow loop (a busy host, a long burst) is not a reason: the leases are renewed now, and those
        still valid by the database clock keep their groups running (stopping and restarting coroutines
        is itself a stall). Only when that renewal fails are all shards stopped.
        """
        if not self.owned or not self._renewal_overdue():
            return
        if self._db_step("renewal", self._renew_leases) or not self.owned:
            return
        log.warning("cannot renew shard leases; stopping all shards before they expire",
                    shards=len(self.owned), cause=self.last_error)
        self._drop_shards(set(self.owned))
        self.owned = set()

    def _renewal_overdue(self) -> bool:
        return time.monotonic() - self.last_renewal > self.settings.lease_seconds * 0.6

    def _fence(self, session: Session) -> set[int]:
        """The owned shards whose lease still holds, share-locked until this transaction ends. Owned shards
        whose lease lapsed by the database clock are dropped once the caller is done (``_drop_lapsed``)."""
        if not self.owned:
            return set()
        fenced = Store(session).fence(self.job_id, self.owned, self.queues_key)
        self.lapsed |= self.owned - fenced
        return fenced

    def _drop_lapsed(self) -> None:
        """Shards whose lease lapsed while this instance thought it held them (the database clock stepped,
        a loop was slow): their members are dropped, not kept without a coroutine, and the shards leave
        ``owned``, so whoever claims them next (this instance too) reads them in full."""
        lapsed, self.lapsed = self.lapsed & self.owned, set()
        if not lapsed:
            return
        log.warning("shard leases lapsed by the database clock; dropping them until claimed again",
                    shards=sorted(lapsed))
        self._drop_shards(lapsed)
        self.owned -= lapsed
        self.to_read -= lapsed

    def _shard_of(self, trigger_id: int) -> int | None:
        info = self.member_info.get(trigger_id)
        return None if info is None else info.shard

    # --- leases ---

    def load_triggers(self) -> None:
        """What changed since the last loop, read from the change feed: nothing changed, nothing read.
        Timeouts, unreadable rows and starting groups are steps of their own: one failing (a lock, a row
        that cannot be built) never keeps the others, nor the next loop's read, from running."""
        try:
            self.read_changes()
        finally:
            self._db_step("timeouts", self._timeout_members)
            self._db_step("unreadable", self._fail_unreadable)
            self._db_step("start", self._start_groups)
            # publish this loop's counters when they changed, so `status` agrees with /metrics
            if self._counters() != self.published_counters:
                self._db_step("heartbeat", self._heartbeat_counters)

    def read_changes(self) -> None:
        """Renew the leases, then read the waiters that arrived or left (and those of shards to read)."""
        self._renew_leases()
        if not self._nothing_changed():
            self._hash_new_triggers()
            self._load_waiters()

    def _nothing_changed(self) -> bool:
        """One statement: True (and both feed positions moved on) when no waiter arrived or left since
        the last read and no shard was taken: the common loop of a waiting deployment."""
        if self.load_xmin is None or self.hash_xmin is None or self.to_read:
            return False
        with create_session() as session:
            xmin, changed = Store(session).feed_probe(self.load_xmin, self.hash_xmin)
        if self._went_back(xmin) or changed:
            return False
        self.load_xmin = self.hash_xmin = xmin
        return True

    def _went_back(self, xmin: str) -> bool:
        """A snapshot older than a position already read means the database went back in time (a
        failover to a replica that had not received the last transactions, crash recovery): transaction
        ids may be handed out again below what was read. Read everything again."""
        read = [int(x) for x in (self.load_xmin, self.hash_xmin) if x is not None]
        if not read or int(xmin) >= max(read):
            return False
        log.warning("the database's transaction ids went back; reading every waiter again",
                    position=max(read), now=int(xmin))
        self.load_xmin = self.hash_xmin = None
        return True

    def _heartbeat_counters(self) -> None:
        counters = self._counters()
        with create_session() as session:
            store = Store(session)
            self._renew_membership(store, counters)
        self.published_counters = counters

    def _renew_membership(self, store: Store, counters: dict[str, Any]) -> None:
        """Heartbeat our instance row; note the database clock it read, and re-read the feed if our
        membership had lapsed before this renewal."""
        was_live, db_now = store.heartbeat(self.job_id, self.settings.lease_seconds,
                                           feed_xmin=self._feed_xmin(), **counters)
        self.db_clock = (db_now, time.monotonic())
        if not was_live:
            self._lost_the_feed()

    def _feed_xmin(self) -> str | None:
        """How far this instance has read the change feed (rows before it may be pruned)."""
        if self.load_xmin is None or self.hash_xmin is None:
            return None
        return min(self.load_xmin, self.hash_xmin, key=int)

    def _housekeeping(self) -> None:
        """Airflow's clean_unused (its deletions are how waiters leave) and pruning the change feed, each
        every few seconds rather than every loop, and clean_unused by one instance only: neither is
        urgent, and clean_unused scans."""
        now = time.monotonic()
        # one instance per queue set is enough (Airflow's clean_unused scans every trigger and task row):
        # the one holding shard 0
        if now - self.last_cleanup >= CLEANUP_SECONDS and 0 in self.owned:
            self.clean_unused()
            self.last_cleanup = now
        if now - self.last_prune >= PRUNE_SECONDS:
            with create_session() as session:
                store = Store(session)
                store.prune_feed(self.settings.lease_seconds)
                present = store.feed_present()
            if not present:
                self.load_xmin = self.hash_xmin = None  # the next loop installs it and reads everything
            self.last_prune = now
        if now - self.last_lingering >= LINGERING_SECONDS:
            self._forget_watcher_failures(now)
            self._forget_lingering()
            self.last_lingering = now
        counts = (len(self.member_info), self.groups.group_count())
        due = now - self.last_sample >= SAMPLE_SECONDS
        if due or (counts != self.sampled and now - self.sampled_at >= FIRST_SAMPLE_SECONDS):
            self._record_sample(counts, now)
        if due:
            # a minute apart, not a minute after the last (which would drift and skip a minute), unless
            # this loop fell behind
            self.last_sample = max(self.last_sample + SAMPLE_SECONDS, now - SAMPLE_SECONDS / 2)

    def _record_sample(self, counts: tuple[int, int], now: float) -> None:
        """A point of the page's chart: once a minute, and when the waiters or groups changed since the
        last one (else the page would show that sample's polls saved beside groups formed after it)."""
        with create_session() as session:
            Store(session).record_sample(self.job_id, *counts, self.groups.polls_saved_per_minute(),
                                         prune=0 in self.owned)
        self.sampled, self.sampled_at = counts, now

    def _forget_watcher_failures(self, now: float) -> None:
        """A watcher group that has run a while since its last failure counts as working again (one that
        rarely fires would otherwise stay 'failing'); groups that left are forgotten."""
        for identity_hash in list(self.watcher_failures):
            group = self.groups.by_hash.get(identity_hash)
            failed_at = self.watcher_failed_at.get(identity_hash, now)
            working = group is not None and group.runner_id is not None and (
                now - failed_at > WATCHER_BACKOFF_MAX_SECONDS)
            if group is None or working:
                self.watcher_failures.pop(identity_hash, None)
                self.watcher_failed_at.pop(identity_hash, None)

    def _forget_lingering(self) -> None:
        """Members whose trigger row Airflow keeps although nothing waits on it (a task cleared while
        deferred): their coroutines stop, as the stock triggerer's do once the row is deleted."""
        with create_session() as session:
            lingering = Store(session).not_waited_on(self.owned)
        for trigger_id in lingering & set(self.member_info):
            self.held.pop(trigger_id, None)
            self._forget_member(trigger_id, user_action=True)

    def _renew_leases(self) -> None:
        started = time.monotonic()
        with create_session() as session:
            store = Store(session)
            counters = self._counters()
            self._renew_membership(store, counters)
            self.published_counters = counters
            lapsing = store.live_members_lapsing(self.settings.lease_seconds, self.queues_key)
            members = [member for member, _ in lapsing]
            self._wake_at_lapse([left for member, left in lapsing if member.job_id != self.job_id])
            if all(m.job_id != self.job_id for m in members):
                members.append(Member(self.job_id, self.capacity))
            desired = shards_of(self.job_id, assign(self.settings.shards, members))
            released = self.owned - desired
            if released:
                store.release_shards(self.job_id, released, self.queues_key)
            claimed = store.claim_shards(self.job_id, desired, self.settings.lease_seconds, self.queues_key)
            if skipped := (desired - claimed) & self.owned:
                # still ours, locked by a session of ours whose client is gone: kept, renewed later
                claimed |= store.held_shards(self.job_id, skipped, self.queues_key)
        self.last_renewal = started
        lost, gained = self.owned - claimed, claimed - self.owned
        if lost:
            log.info("handing over shards", shards=sorted(lost))
            self._drop_shards(lost)
        if gained:
            log.info("took shards", count=len(gained))
        self.owned = claimed
        self.to_read = (self.to_read | gained) & claimed

    def _db_now(self) -> float:
        """The database clock now (epoch seconds), from its last reading and the host's monotonic clock."""
        if self.db_clock is None:
            return time.time()
        reading, at = self.db_clock
        return reading + (time.monotonic() - at)

    def _lost_the_feed(self) -> None:
        """Our membership lapsed by the database clock (a pause, a very slow loop), and with it our claim on
        the change feed (peers prune what every live instance has read): read everything again, once. A
        slow loop whose membership held reads on from where it was."""
        self.load_xmin = self.hash_xmin = None

    def _wake_at_lapse(self, lapses_in: list[float]) -> None:
        """Load again right when another member's membership lapses (it stopped renewing: crashed or
        paused), not up to a loop later: its shards, whose leases expire with it, are taken at once."""
        soonest = min((left for left in lapses_in if left < self.settings.loop_seconds), default=None)
        if soonest is not None:
            # the next load runs once loop_seconds have passed since last_load: move last_load back
            due = time.monotonic() + max(soonest, 0.0) + LAPSE_MARGIN_SECONDS
            self.last_load = min(self.last_load, due - self.settings.loop_seconds)

    def _drop_shards(self, shards: set[int]) -> None:
        """Forget every waiter of these shards and cancel their coroutines without on_kill."""
        dropped = [t for t, info in self.member_info.items() if info.shard in shards]
        for trigger_id in dropped:
            # held events first: their shard is known only while the member's info is kept
            self.held.pop(trigger_id, None)
            self._forget_member(trigger_id, user_action=False)

    def release_all(self) -> None:
        """Graceful stop: release every lease and leave the membership at once; the last instance also
        takes the change feed off Airflow's tables (best effort: the next start prunes what is left)."""
        with create_session() as session:
            Store(session).stop_instance(self.job_id)
        self.owned = set()
        try:
            with create_session() as session:
                removed = Store(session).remove_feed_if_last(self.job_id, self.settings.lease_seconds)
        except SQLAlchemyError as err:
            log.warning("could not remove the change feed's triggers; the next instance to start uses them",
                        error=cause(err))
            return
        if removed:
            log.info("last instance stopped: removed the change feed's triggers from Airflow's tables")

    # --- identities and membership ---

    def _hash_new_triggers(self) -> None:
        """Store the identity of every trigger row the change feed reports as new (of every row without
        one, in a sweep); the feed position moves on only once nothing before it is left unhashed (a row
        another instance is hashing, a row beyond this loop's limit)."""
        after = self.hash_xmin  # None: a sweep over every trigger row
        if after is None:
            self._ensure_feed()
        with create_session() as session:
            store = Store(session)
            if after is None:
                position = store.sweep_position(self.queue_list)
            else:
                position = store.feed_position(after, self.queue_list)
            if self._went_back(position.xmin):
                return
            if position.unhashed == 0:
                self.hash_xmin = position.xmin
                return
        hashed = self._hash_batches(after)
        if after is None:
            log.info("hashing trigger rows the change feed does not cover", rows=hashed)

    def _hash_batches(self, after: str | None) -> int:
        """Hash rows without an identity, a committed batch at a time (peers share the work: SKIP LOCKED),
        while this loop's time budget lasts; returns how many."""
        batch = self.settings.max_new_per_loop * 4
        deadline = time.monotonic() + self._busy_budget()
        hashed = 0
        while True:
            with create_session() as session:
                store = Store(session)
                rows = store.unhashed_triggers(self.queue_list, limit=batch, after_xid=after)
                if rows:
                    store.insert_identities(compute_identities(rows, self.settings))
            hashed += len(rows)
            if len(rows) < batch or time.monotonic() >= deadline or self.stop:
                return hashed

    def _ensure_feed(self) -> None:
        """Before reading everything again: the last instance to stop removes the feed's triggers, and
        this one may have been taken for stopped while it was paused."""
        with create_session() as session:
            if Store(session).ensure_feed_locked():
                log.warning("installed the change feed's triggers again (an instance stopped while this one "
                            "was paused, or a table of Airflow's was recreated)")

    def _load_waiters(self) -> None:
        """Arrivals and departures since the last read, from the change feed; every waiter of shards just
        taken (or of all owned shards when the feed position was lost) in full."""
        full = set(self.owned) if self.load_xmin is None else self.to_read & self.owned
        hold = self.settings.resume_hold_seconds
        gone: set[int] = set()
        with create_session() as session:
            store = Store(session)
            xmin = store.snapshot_xmin()
            rows = store.waiting_triggers(full, self.queue_list, hold_seconds=hold)
            if self.load_xmin is not None:
                rows += store.waiting_triggers(self.owned - full, self.queue_list, after_xid=self.load_xmin,
                                               hold_seconds=hold)
                gone = store.deleted_triggers(self.load_xmin)
            new = [r for r in rows if r.trigger_id not in self.member_info and not r.error]
            if new:
                fenced = self._fence(session)
                store.claim_triggers(self.job_id, [r.trigger_id for r in new if r.shard in fenced])
        if self._went_back(xmin):
            return
        self.to_read -= full  # read in full, committed
        reconcile = self.load_xmin is None
        self.load_xmin = xmin
        if reconcile:
            self._reconcile({r.trigger_id for r in rows})
        for trigger_id in gone:
            self.held.pop(trigger_id, None)
            if trigger_id in self.member_info:
                self._forget_member(trigger_id, user_action=True)
        for row in rows:
            self._join(row)

    def _join(self, row: WaitingTrigger) -> None:
        if row.trigger_id in self.member_info or row.trigger_id in self.held:
            return
        if row.shard not in self.owned:
            return
        if row.error is not None:
            self.unreadable[row.trigger_id] = (row.shard, row.error)
            return
        self.member_info[row.trigger_id] = MemberInfo(row.shard, row.has_task, row.dedupable)
        now = time.monotonic()
        if row.hold_left > 0:
            self.young_until[row.trigger_id] = now + row.hold_left
        if row.timeout_in is not None:
            heapq.heappush(self.deadlines, (self._db_now() + row.timeout_in, row.trigger_id))
        dedup = row.dedupable and self.settings.dedup
        key = group_key(row.trigger_id, row.identity_hash, dedup)
        group = self.groups.join(row.trigger_id, key, row.execution if dedup else None)
        if group.stricter_than_running():
            # The newcomer needs more (a shorter poll interval, another NOTIFY channel): run the group from
            # its row with the merged settings; the old coroutine is cancelled without on_kill.
            log.info("restarting a group with more demanding settings", members=len(group.members))
            self.groups.restart(group, runner=row.trigger_id)

    def _reconcile(self, waiting: set[int]) -> None:
        for trigger_id in set(self.member_info) - waiting:
            self._forget_member(trigger_id, user_action=True)
        for trigger_id in set(self.held) - waiting:
            self.held.pop(trigger_id, None)

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

    def _timeout_members(self) -> None:
        """Time out deferred members one by one (as the scheduler does) when one's trigger_timeout is due,
        by the database clock; a member still waiting after that (its row was locked) is looked at again
        next loop."""
        now = self._db_now()
        self._drop_stale_deadlines()
        if not self.deadlines or self.deadlines[0][0] > now:
            return
        with create_session() as session:
            fenced = self._fence(session)
            timed_out = fanout.timeout(session, sorted(fenced), self.queue_list) if fenced else []
        for trigger_id in timed_out:
            if trigger_id in self.member_info:
                self._forget_member(trigger_id, user_action=True)
        while self.deadlines and self.deadlines[0][0] <= now:
            _due, trigger_id = heapq.heappop(self.deadlines)
            if trigger_id in self.member_info:
                heapq.heappush(self.deadlines, (now + self.settings.loop_seconds, trigger_id))

    def _drop_stale_deadlines(self) -> None:
        """Deadlines of members that left (resumed, handed over) stay in the heap until due or rebuilt:
        drop them from its top, and rebuild it when they outnumber the members (a deferrable sensor's
        default timeout is 7 days: a busy deployment would keep every resumed task's for a week)."""
        while self.deadlines and self.deadlines[0][1] not in self.member_info:
            heapq.heappop(self.deadlines)
        if len(self.deadlines) > 2 * len(self.member_info) + 1000:
            soonest: dict[int, float] = {}
            for due, trigger_id in self.deadlines:
                if trigger_id in self.member_info:
                    soonest[trigger_id] = min(due, soonest.get(trigger_id, due))
            self.deadlines = [(due, trigger_id) for trigger_id, due in soonest.items()]
            heapq.heapify(self.deadlines)

    def _fail_unreadable(self) -> None:
        """Tasks whose trigger kwargs could not be read fail at once with the cause, alone."""
        if not self.unreadable:
            return
        with create_session() as session:
            fenced = self._fence(session)
            for trigger_id, (shard, error) in sorted(self.unreadable.items()):
                if shard not in fenced:
                    continue
                log.error("failing the tasks of an unreadable trigger", trigger_id=trigger_id, error=error)
                self.failures_total += fanout.fail(session, [trigger_id], [f"smart-triggerer: {error}\n"])
        # failed, or on a shard another instance holds now (it reads the row when it takes the shard)
        self.unreadable = {}

    def _start_groups(self) -> None:
        """Start waiting groups, most urgent first, a batch at a time while this call's time budget lasts
        (the rest in the next call, right after the runner's messages were handled): every loop stays short
        and renews its leases in time, and a takeover of thousands starts in seconds. A build is a batch at
        most, also for groups started while the database was away (``build_backlog``)."""
        self.groups.wake(time.monotonic())  # failed watchers whose backoff is over
        self._pace_log_files()  # before the first batch goes out: its lines come back between batches
        deadline = time.monotonic() + self._busy_budget()
        order: list[Group] = []
        while not self.stop:
            if not order and self.groups.unstarted:
                order = self._by_urgency()
            batch, order = order[: self.settings.max_new_per_loop], order[self.settings.max_new_per_loop:]
            for group in batch:
                if self.groups.unstarted.get(group.identity_hash) is group:
                    self.groups.start(group)
            self.build_backlog = self._request_started()
            if not self._start_backlog() or time.monotonic() >= deadline:
                return
            # hand this batch to the runner (it asks, we answer) and read its log lines while building
            # the next: a runner left unanswered stalls on its full log socket
            self._service_subprocess(0.0)

    def _pace_log_files(self) -> None:
        """While a takeover or a start hands out coroutines (and for a moment after), their first log lines
        are held in memory; then their files are made, a time budget per loop (trigger_logs.py): making
        tens of thousands of files would otherwise be most of the supervisor's work while waits wait."""
        now = time.monotonic()
        # groups without a coroutine yet: not started, started but not built, or handed to the runner and
        # not yet reported running (the runner may take a whole pile in one sync and create it for seconds)
        to_run = len(self.groups.unstarted) + len(self.groups.hash_of_runner) - len(self.running_triggers)
        if not self.log_pool.holding:
            self.holding_since = now
        if now - self.holding_since < HOLD_LOG_LINES_MAX_SECONDS:
            if to_run >= HOLD_LOG_LINES_FROM or (self.log_pool.holding and to_run > 0):
                self.handing_out_until = now + HELD_LOG_LINES_SECONDS
            elif self.log_pool.holding:
                # reported running is not started yet: a runner given thousands at once runs their first
                # steps (and their first lines) for seconds after; hold while new files' lines still come
                self.handing_out_until = max(self.handing_out_until,
                                             self.log_pool.new_file_held_at + HELD_LOG_LINES_SECONDS)
        self.log_pool.holding = now < self.handing_out_until
        if (not self.log_pool.holding and self.log_pool.held
                and now - self.held_written_at >= WRITE_HELD_EVERY_SECONDS):
            self.held_written_at = now
            self.log_pool.write_held(WRITE_HELD_SECONDS)

    def write_held_log_lines(self) -> None:
        """On the way out: the held first lines of coroutines started in the last seconds, for at most a
        second (an exit must stay prompt); what is left is said, not silently lost."""
        self.log_pool.holding = False
        if self.log_pool.write_held(HELD_LOG_LINES_SECONDS / 2):
            log.warning("trigger log lines not written at exit", files=len(self.log_pool.held))

    def _start_backlog(self) -> bool:
        """Groups wait for a coroutine, or started groups for their workload to be built."""
        return bool(self.groups.unstarted) or self.build_backlog

    def _busy_budget(self) -> float:
        """Seconds one call may spend starting groups or hashing rows before the loop goes on."""
        return max(0.25, self.settings.lease_seconds * 0.1)

    def _by_urgency(self) -> list[Group]:
        """The waiting groups, those whose next poll or earliest member timeout is due soonest first (a
        group just taken over may be due at once; its last poll is not known): asset watchers first, then
        by poll interval or timeout, whichever comes sooner."""
        now = self._db_now()
        timeouts: dict[int, float] = {}
        for due, trigger_id in self.deadlines:
            timeouts[trigger_id] = min(due, timeouts.get(trigger_id, due))

        def due_in(group: Group) -> float:
            if not all(self._is_task(m) for m in group.members):
                return -math.inf  # an asset watcher: its events come whenever its source has them
            soonest = min((timeouts[m] - now for m in group.members if m in timeouts), default=math.inf)
            return min(soonest, group.poll_interval or UNKNOWN_INTERVAL_SECONDS)

        return sorted(self.groups.unstarted.values(), key=due_in)

    def _request_started(self) -> bool:
        """Ask the runner for what changed (idle loops cost nothing); a leader that cannot start hands over
        to the next member at once (bounded passes). True when coroutines are left to build next batch."""
        for _ in range(3):
            state = (self.groups.version, self.runner_changes)
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
        requested = self.groups.runner_ids()
        known = self.running_triggers.union(
            (entry.trigger_id for entry in self.events), (entry.trigger_id for entry in self.orphans),
            self.cancelling_triggers,
            (failure[0] for failure in self.failed_triggers), (w.id for w in self.creating_triggers),
        )
        new_ids = requested - known
        cancel_ids = self.running_triggers - requested
        if cancel_ids:
            self.cancelling_triggers.update(cancel_ids)
        more = len(new_ids) > self.settings.max_new_per_loop
        if more:
            new_ids = set(sorted(new_ids)[: self.settings.max_new_per_loop])
        if not new_ids:
            return False, False
        try:
            workloads = self.build_trigger_workloads(new_ids)
        except _RowCannotBeBuilt as err:
            # the build's transaction is aborted: the others are built again in the next pass
            self._next_leader(err.trigger_id)
            return True, more
        finally:
            self.build_bag = None  # DAGs are shared within one build only
        self.creating_triggers.extend(workloads)
        not_started = new_ids - {w.id for w in workloads}
        for trigger_id in not_started:
            self._next_leader(trigger_id)
        return bool(not_started), more

    def _next_leader(self, trigger_id: int) -> None:
        """A group's leader row could not start (its task was cleared or timed out between load and start,
        its workload cannot be built): let another member lead, or the group would never run."""
        group = self.groups.by_runner(trigger_id)
        if group is None:
            return
        group.unstartable.add(trigger_id)
        self.groups.stop_runner(group)
        leader = self.groups.start(group)
        log.warning("a group's leader could not start", trigger_id=trigger_id, next_leader=leader,
                    members=len(group.members))

    # --- workloads ---

    def fetch_trigger_details(self, trigger_ids: set[int], *, session: Session) -> dict[int, Trigger]:
        """Airflow's ``Trigger.bulk_fetch`` without what a workload never reads: it also joins each task
        instance's trigger (the row just read, again) and that trigger's triggerer job, a sixth of a
        takeover's build time at tens of thousands of triggers."""
        stmt = (select(Trigger).where(Trigger.id.in_(trigger_ids))
                .options(selectinload(Trigger.task_instance).noload(TaskInstance.trigger)))
        return {trigger.id: trigger for trigger in session.scalars(stmt)}

    def _create_workload(self, trigger: Trigger, dag_bag: Any, render_log_fname: Any,
                         session: Session) -> Any:
        if self.build_bag is None or self.build_bag.bag is not dag_bag:
            self.build_bag = OneBuildDagBag(dag_bag, self.dag_cache)
            # Airflow's build transaction locks nothing, and deserializing a big DAG may sit longer than
            # the connection's idle-in-transaction limit (bounded.py) between two statements
            Store(session).unbound_idle()
        try:
            workload = super()._create_workload(trigger, cast("DBDagBag", self.build_bag), render_log_fname,
                                                session)  # a DBDagBag in all Airflow asks of it
        except SQLAlchemyError as err:
            if is_outage(err) or is_transient(err):
                raise
            # this row's own data is refused (e.g. a value its model cannot load): it cannot lead here
            log.error("a trigger's workload cannot be built; another member leads its group",
                      trigger_id=trigger.id, error=cause(err))
            raise _RowCannotBeBuilt(trigger.id) from err
        except Exception as err:
            # e.g. a timetable or a module the task's DAG needs is not installed on this host: this row
            # cannot lead its group here (another member, or another host after a handover, may)
            log.error("a trigger's workload cannot be built on this host", trigger_id=trigger.id,
                      error=cause(err))
            return None
        self._pool_log_file(trigger.id)
        group = self.groups.by_runner(trigger.id)
        if workload is None or group is None:
            return workload
        info = self.member_info.get(trigger.id)
        if info is not None and info.dedupable and self.settings.dedup:
            # Members time out one by one (see _timeout_members); the shared coroutine must not.
            workload = workload.model_copy(update={"timeout_after": None})
            workload = self._with_group_settings(workload, trigger, group)
        return workload

    def _pool_log_file(self, trigger_id: int) -> None:
        """The coroutine's log file through the bounded pool, not one descriptor per coroutine."""
        factory = self.logger_cache.get(trigger_id)
        if type(factory) is TriggerLoggingFactory:
            self.logger_cache[trigger_id] = PooledTriggerLoggingFactory.replacing(factory, self.log_pool)

    def _with_group_settings(self, workload: Any, trigger: Trigger, group: Group) -> Any:
        """Run the group with its members' merged settings (shortest interval, every channel...)."""
        kwargs = trigger.kwargs
        changed = {k: v for k, v in group.settings.items()
                   if k in kwargs and kwargs[k] != v and [kwargs[k]] != v}
        if not changed:
            return workload
        kwargs.update(changed)
        return workload.model_copy(update={"encrypted_kwargs": Trigger.encrypt_kwargs(kwargs)})

    # --- events ---

    def handle_events(self) -> None:
        """Store the runner's events, front first, in bounded transactions; acknowledge what was stored.

        A transaction that fails is retried event by event, unless the database refuses every writer (an
        outage, read-only, a permission): then every event stays queued. Event by event, one that meets a
        lock it may not wait for is tried again next loop, behind the others; one whose own payload or
        listeners are refused fails its own members with the cause.
        """
        self._adopt_orphans()
        if self.events:
            self.runner_changes += 1  # runner ids leave the events queue: what to run may differ now
        later: list[TriggerEventEntry] = []
        try:
            while self.events:
                # a slow chunk (a listener that takes seconds) must not let the leases lapse meanwhile
                self._guard_leases()
                chunk = self._front_chunk()
                try:
                    self._store_events(chunk)
                except Exception as err:
                    if not self._event_may_be_at_fault(err):
                        raise
                    self._store_one_by_one(len(chunk), later)
                    continue
                for entry in chunk:
                    self.events.popleft()
                    self.outage_strikes.pop(entry.trigger_id, None)
        finally:
            # events put off for a lock go back even when a later one met an outage
            self.events.extend(later)

    def _event_may_be_at_fault(self, err: Exception) -> bool:
        """Whether storing the events one by one may find a culprit. Not when the database refuses every
        writer. A lost connection is an outage only when the database does not answer right after it: the
        server also ends a session that sat idle in its transaction longer than half a lease (bounded.py),
        which a slow listener of one event does every time."""
        if is_transient(err) or blames_event(err):
            return True
        return is_outage(err) and self._database_answers()

    def _database_answers(self) -> bool:
        try:
            with create_session() as session:
                Store(session).ping()
        except Exception:
            return False
        return True

    def _adopt_orphans(self) -> None:
        """Put orphaned events whose group is back in front (in order); drop those whose coroutine is
        being cancelled or gone (its shard is another instance's now: the new owner fires its own)."""
        if not self.orphans:
            return
        self.runner_changes += 1
        back, waiting = [], []
        alive = self.running_triggers - self.cancelling_triggers
        for entry in self.orphans:
            if self.groups.by_runner(entry.trigger_id) is not None:
                back.append(entry)
            elif entry.trigger_id in alive:
                waiting.append(entry)
            else:
                log.debug("dropping an event of a coroutine handed over", runner_id=entry.trigger_id)
        self.orphans = waiting
        self.events.extendleft(reversed(back))

    def _front_chunk(self) -> list[TriggerEventEntry]:
        """Events from the front of the queue, up to ``max_resumes_per_transaction`` task members."""
        chunk: list[TriggerEventEntry] = []
        size = 0
        for entry in self.events:
            group = self.groups.by_runner(entry.trigger_id)
            members = len(group.members) if group is not None else 1
            if chunk and size + members > self.settings.max_resumes_per_transaction:
                break
            chunk.append(entry)
            size += members
        return chunk

    def _store_one_by_one(self, count: int, later: list[TriggerEventEntry]) -> None:
        """The front ``count`` events one at a time; those to try again next loop go to ``later`` (as
        they are found, so an outage raised from a later event loses none of them)."""
        for _ in range(count):
            self._guard_leases()
            entry = self.events[0]
            try:
                self._store_events([entry])
            except Exception as err:
                if is_transient(err):
                    log.info("an event met a lock it may not wait for; trying it again next loop",
                             runner_id=entry.trigger_id, error=cause(err))
                    later.append(entry)
                elif blames_event(err):
                    self._poisoned(entry, err)
                elif not self._lost_its_session_again(entry, err):
                    raise  # the database refuses every writer: this and every later event stay queued
                elif self.outage_strikes[entry.trigger_id] >= OUTAGE_STRIKES:
                    self._poisoned(entry, err, why=(
                        f"the server ended its transaction {OUTAGE_STRIKES} times while the database "
                        "answered (a listener or callback slower than half a lease?)"))
                else:
                    later.append(entry)
            else:
                self.outage_strikes.pop(entry.trigger_id, None)
            self.events.popleft()

    def _lost_its_session_again(self, entry: TriggerEventEntry, err: Exception) -> bool:
        """An event stored alone lost its connection while the database answers: count it (a one-off
        network blip is retried; the same event losing its session every time is its own doing)."""
        if not is_outage(err) or not self._database_answers():
            return False
        self.outage_strikes[entry.trigger_id] = self.outage_strikes.get(entry.trigger_id, 0) + 1
        return True

    def _store_events(self, entries: Sequence[TriggerEventEntry]) -> None:
        now = time.monotonic()
        batches: list[fanout.Batch] = []
        outcomes: list[tuple[TriggerEventEntry, Group | None, set[int]]] = []
        with create_session() as session:
            fenced = self._fence(session)
            for entry in entries:
                group = self.groups.by_runner(entry.trigger_id)
                if group is None or self._in_lapsed_shard(group):
                    # not ours any more (handed over, lease lapsed): neither stored nor acknowledged
                    outcomes.append((entry, None, set()))
                    continue
                mine = {m for m in group.members if self._shard_of(m) in fenced}
                ready, _young = self._split_by_age(mine, now)
                batches.append((self._task_members(ready), entry.event))
                for trigger_id in sorted(mine):
                    if not self._is_task(trigger_id):
                        fanout.submit_watcher_event(session, trigger_id, entry.event)
                outcomes.append((entry, group, mine))
            resumed = fanout.resume(session, batches)
        self.resumed_total += resumed
        self.events_total += len(entries)
        for entry, group, mine in outcomes:
            if group is None:
                # not stored, not acknowledged: kept while its coroutine may still be ours
                self.orphans.append(entry)
                continue
            self.watcher_failures.pop(group.identity_hash, None)  # it works again
            self.dead_letters.forget(group.identity_hash)
            stored_all = mine >= {m for m in group.members if not self._is_task(m)}
            if entry.persist_seq is not None and stored_all:
                self.persisted_event_seqs.append(entry.persist_seq)
            self._after_event(group, entry.event, mine, now)

    def _in_lapsed_shard(self, group: Group) -> bool:
        return any(self._shard_of(m) in self.lapsed for m in group.members)

    def _poisoned(self, entry: TriggerEventEntry, err: BaseException, why: str | None = None) -> None:
        """An event that cannot be stored on its own (the database refuses it, a listener or callback
        raises): its task members fail with the cause, its watchers restart with backoff; others go on."""
        self.outage_strikes.pop(entry.trigger_id, None)
        why = why or cause(err)
        group = self.groups.by_runner(entry.trigger_id)
        log.error("an event could not be stored; failing its members", runner_id=entry.trigger_id,
                  members=len(group.members) if group else 0, error=why)
        self.events_total += 1
        if group is None or self._in_lapsed_shard(group):
            return
        if self._set_aside(entry, group, why):
            return
        self._group_failed(group, [f"smart-triggerer: the trigger's event could not be stored: {why}\n"], why)

    def _set_aside(self, entry: TriggerEventEntry, group: Group, why: str) -> bool:
        """A watcher's event that failed ``DEAD_AFTER`` times in a row: written to the dead-event table and
        acknowledged (its source moves on), its task members failed; the watchers run on. False before."""
        watchers = sorted(m for m in group.members if not self._is_task(m))
        if not watchers:
            return False
        tries = self.dead_letters.failed(group.identity_hash, entry.event.payload)
        if tries < DEAD_AFTER:
            return False
        with create_session() as session:
            fenced = self._fence(session)
            store = Store(session)
            for trigger_id in watchers:
                if self._shard_of(trigger_id) in fenced:
                    store.dead_event(trigger_id, payload_text(entry.event.payload), tries, why)
            tasks = [m for m in self._task_members(sorted(group.members)) if self._shard_of(m) in fenced]
            self.failures_total += fanout.fail(
                session, tasks, [f"smart-triggerer: the trigger's event could not be stored: {why}\n"])
        log.error("an asset watcher's event could not be stored; set aside in smart_triggerer.dead_event so "
                  "its source moves on", runner_id=entry.trigger_id, tries=tries, error=why)
        self.dead_letters.forget(group.identity_hash)
        self.dead_letters.total += 1
        if entry.persist_seq is not None:
            self.persisted_event_seqs.append(entry.persist_seq)
        for trigger_id in tasks:
            self.groups.leave(trigger_id)
            self._forget_info(trigger_id)
        return True

    def _after_event(self, group: Group, event: TriggerEvent, mine: set[int], now: float) -> None:
        """Task members are done once the event is stored (young ones held); watchers keep running."""
        tasks = [m for m in group.members if self._is_task(m)]
        _ready, young = self._split_by_age(set(tasks) & mine, now)
        for trigger_id in young:
            self.held[trigger_id] = Held(event, self.young_until.get(trigger_id, now))
        if len(tasks) < len(group.members):
            # mixed task/watcher group: the coroutine keeps running for the watchers
            for trigger_id in tasks:
                self.groups.leave(trigger_id)
                if trigger_id not in self.held:
                    self.member_info.pop(trigger_id, None)
            return
        self._end_group(group)

    def _end_group(self, group: Group) -> None:
        for trigger_id in list(group.members):
            self._forget_info(trigger_id)
        self.groups.finish(group)

    def _forget_info(self, trigger_id: int) -> None:
        """What the loop knows of a member that left its group (kept while an event is held for it)."""
        if trigger_id not in self.held:
            self.member_info.pop(trigger_id, None)
            self.young_until.pop(trigger_id, None)

    def _split_by_age(self, members: Iterable[int], now: float) -> tuple[list[int], list[int]]:
        ready: list[int] = []
        young: list[int] = []
        for trigger_id in members:
            (young if self.young_until.get(trigger_id, 0.0) > now else ready).append(trigger_id)
        return ready, young

    def _is_task(self, trigger_id: int) -> bool:
        info = self.member_info.get(trigger_id)
        return info is None or info.has_task

    def _task_members(self, members: Iterable[int]) -> list[int]:
        return [m for m in members if self._is_task(m)]

    def release_held(self) -> None:
        now = time.monotonic()
        due = [t for t, h in self.held.items() if h.release_at <= now]
        if not due:
            return
        by_event: dict[int, list[int]] = defaultdict(list)
        for trigger_id in due:
            by_event[id(self.held[trigger_id].event)].append(trigger_id)
        with create_session() as session:
            fenced = self._fence(session)
            batches = [([t for t in ids if self._shard_of(t) in fenced], self.held[ids[0]].event)
                       for ids in by_event.values()]
            self.resumed_total += fanout.resume(session, batches)
        for trigger_id in due:
            self.held.pop(trigger_id, None)
            self.member_info.pop(trigger_id, None)
            self.young_until.pop(trigger_id, None)

    # --- failures ---

    def handle_failed_triggers(self) -> None:
        """Fail each failed group's members. A failure that cannot be stored now (a lock, the database
        refusing every writer) keeps its group and goes to the back, so it never holds up those behind it;
        an outage keeps them all."""
        for _ in range(len(self.failed_triggers)):
            runner_id, exc = self.failed_triggers[0]
            group = self.groups.by_runner(runner_id)
            if group is None or self._in_lapsed_shard(group):
                log.debug("failure of a group this instance no longer runs", runner_id=runner_id)
            else:
                try:
                    self._group_failed(group, exc, _failure_cause(exc))
                except Exception as err:
                    if is_outage(err):
                        raise
                    self._step_failed("failures", err)
                    self.failed_triggers.rotate(-1)
                    continue
            self.runner_changes += 1
            self.failed_triggers.popleft()

    def _group_failed(self, group: Group, exc: Any, why: str) -> None:
        """Fail the group's task members (fenced) with ``exc``. Asset watchers and callbacks among its
        members are not failed: the group starts again after a backoff that doubles with each failure in
        a row (stock Airflow restarts a failed watcher every loop), and the failure is reported."""
        try:
            self._fail_tasks(group, exc)
        except Exception as err:
            if not blames_event(err):
                raise  # not the traceback's doing: the group is kept and its failure tried again
            # the database refuses the traceback itself: the tasks fail with a fixed one
            log.error("a failure's traceback could not be stored; failing its tasks without it",
                      error=cause(err))
            self._fail_tasks(group, ["smart-triggerer: the trigger failed, and its error could not be "
                                     "stored; see the triggerer's log\n"])
        watchers = [m for m in group.members if not self._is_task(m)]
        if not watchers or self._in_lapsed_shard(group):
            self._end_group(group)
            return
        for trigger_id in group.members - set(watchers):
            self.groups.leave(trigger_id)
            self._forget_info(trigger_id)
        runner_id = group.runner_id
        attempt = self.watcher_failures.get(group.identity_hash, 0) + 1
        self.watcher_failures[group.identity_hash] = attempt
        self.watcher_failed_at[group.identity_hash] = time.monotonic()
        delay = min(WATCHER_BACKOFF_MAX_SECONDS, WATCHER_BACKOFF_SECONDS * 2 ** (attempt - 1))
        self.groups.suspend(group, time.monotonic() + delay)
        self.watcher_restarts_total += 1
        self.last_watcher_error = why
        log.warning("an asset watcher failed; starting it again after a backoff", runner_id=runner_id,
                    watchers=len(watchers), attempt=attempt, retry_in=delay, error=why)

    def _fail_tasks(self, group: Group, exc: Any) -> None:
        with create_session() as session:
            fenced = self._fence(session)
            tasks = [m for m in self._task_members(sorted(group.members)) if self._shard_of(m) in fenced]
            self.failures_total += fanout.fail(session, tasks, exc)

    # --- cancellation without on_kill ---

    def send_msg(self, msg: Any, request_id: int, error: Any = None, **dump_opts: Any) -> Any:
        """Send cancels signed: negative ids are cancelled without on_kill (see runner.py)."""
        if isinstance(msg, messages.TriggerStateSync) and msg.to_cancel:
            signed = {i if i in self.user_cancels else -i for i in msg.to_cancel}
            msg = msg.model_copy(update={"to_cancel": signed})
        return super().send_msg(msg, request_id, error, **dump_opts)

    def _handle_request(self, msg: Any, log: Any, req_id: int) -> None:
        handing_out = bool(self.creating_triggers)
        if isinstance(msg, messages.TriggerStateChanges) and msg.finished:
            self._read_sent_log_lines()
        super()._handle_request(msg, log, req_id)
        if isinstance(msg, messages.TriggerStateChanges):
            if msg.finished or msg.events or msg.failures or handing_out:
                self.runner_changes += 1  # what the runner runs changed: compare with the groups again
            for trigger_id in msg.finished or ():
                self.user_cancels.discard(trigger_id)

    def _read_sent_log_lines(self) -> None:
        """Read what the runner's log channel holds now. Airflow closes an ended coroutine's log file when a
        sync reports it ended, and reads the log channel 4 KB per loop pass: the runner sends its lines in
        batches just before a sync (runner.py, item 6), and the ended coroutines' last lines must reach their
        files, not the supervisor's own log. Bounded: a runner that never stops writing holds nothing up."""
        for key in list(self.selector.get_map().values()):
            if self._open_sockets.get(key.fileobj) != "logs":  # type: ignore[call-overload]
                continue
            read, _on_close = key.data
            for _ in range(LOG_READS_BEFORE_FINISHING):
                ready, _, _ = io_select.select([key.fileobj], [], [], 0)
                if not ready or not read(key.fileobj):
                    break  # nothing more now, or the channel closed (the loop's next select handles that)

    # --- reporting ---

    def _counters(self) -> dict[str, Any]:
        return {
            "runner_alive": self.is_alive(),
            "waiters": len(self.member_info),
            "groups": self.groups.group_count(),
            "events_total": self.events_total,
            "resumed_total": self.resumed_total,
            "failures_total": self.failures_total,
            "watchers_failing": sum(1 for h in self.watcher_failures if h in self.groups.by_hash),
            "watcher_restarts_total": self.watcher_restarts_total,
            "health_url": self.health_url,
        }

    def publish_snapshot(self) -> None:
        """Copy the counters for the HTTP thread (it must never iterate what this loop mutates)."""
        counters = self._counters()
        counters.update(shards_owned=len(self.owned), job_id=self.job_id,
                        coroutines=len(self.running_triggers), events_pending=len(self.events),
                        events_dead_total=self.dead_letters.total,
                        last_watcher_error=self.last_watcher_error if counters["watchers_failing"] else None)
        self.published = counters

    def snapshot(self) -> dict[str, Any]:
        """What /metrics and /health report (called from the HTTP thread: reads only published values)."""
        now = time.monotonic()
        pending_since = self.pending_since
        return {**self.published, "lease_age": now - self.last_renewal,
                "events_stuck_seconds": 0.0 if pending_since is None else now - pending_since}
