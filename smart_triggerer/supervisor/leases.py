"""Membership and shard leases: joining (migrations first), renewing the leases the placement gives this
instance (placement.py; rendezvous hashing while an instance of an earlier release is live), noticing a
lapse by the database clock, dropping and releasing shards.

The part owns when it last renewed, the group counts it published per shard and read of its peers, the
shards moved in and out, and the connection that hears peers join and stop; it asks the rest of the
instance through ``Instance`` (the conductor answers)."""

from __future__ import annotations

import math
import selectors
import time
from collections.abc import Callable
from typing import Any, Protocol

import structlog
from airflow.utils.net import get_hostname
from airflow.utils.session import create_session
from sqlalchemy.exc import SQLAlchemyError

from smart_triggerer.config import ConfigError
from smart_triggerer.db.errors import cause, is_transient
from smart_triggerer.db.notices import MembershipNotices
from smart_triggerer.db.store import PLACEMENT, LiveMember, Store, split_space
from smart_triggerer.placement.rendezvous import Member, assign, shards_of
from smart_triggerer.placement.shards import Candidate, place
from smart_triggerer.supervisor.feed import Feed
from smart_triggerer.supervisor.handover import Handover
from smart_triggerer.supervisor.load import LoadFilters
from smart_triggerer.supervisor.shared import Shared

log = structlog.get_logger(logger_name=__name__)

# after a member's membership lapses, its leases (renewed just before its heartbeat) have expired too
LAPSE_MARGIN_SECONDS = 0.05

MIGRATE_WAIT_SECONDS = 60.0  # start-up: how long migrations are tried again while their locks are busy

# a shard's group count is published again when it moved by this many groups and by a tenth
LOAD_STEP = 5

LOADS_EVERY_SECONDS = 5.0  # groups per shard are counted this often (a pass over every group)


class Instance(Protocol):
    """What the leases ask of the rest of the instance (the conductor answers)."""

    health_url: str | None

    def stalled(self) -> bool: ...  # out of the fleet while its runner does not answer (stall.py)
    def counters(self) -> dict[str, Any]: ...  # what the heartbeat publishes
    def counters_published(self, counters: dict[str, Any]) -> None: ...
    def publish_snapshot(self) -> None: ...
    def load_by(self, due: float) -> None: ...  # the next load runs at time.monotonic() ``due`` at the latest
    def step_error(self) -> str | None: ...  # the cause of the last step that failed
    def db_step(self, name: str, step: Callable[[], None]) -> bool: ...


class Leases:
    def __init__(
        self,
        shared: Shared,
        feed: Feed,
        handover: Handover,
        load_filters: LoadFilters,
        instance: Instance,
    ) -> None:
        self.shared = shared
        self.settings = shared.settings
        self.feed = feed
        self.handover = handover
        self.load_filters = load_filters
        self.instance = instance
        self.last_renewal = -math.inf  # time.monotonic() the last renewal that succeeded started
        # groups per owned shard as last published with the leases (published again when it changes enough)
        self.published_loads: dict[int, int] = {}
        # groups per shard as their owners last published them (read with each renewal): a takeover reads
        # its first shards, about FIRST_READ_GROUPS groups, before the rest (feed.py)
        self.shard_groups: dict[int, int] = {}
        self.loads_counted_at = -math.inf
        self.shards_moved_in = 0  # shards taken since start
        self.shards_moved_out = 0  # shards handed over (or dropped) since start
        self.notices: MembershipNotices | None = None  # peers' joins and stops

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
                log.info(
                    "the schema is busy (another instance migrating, or a reader); trying again",
                    error=cause(err),
                    retry_in=delay,
                )
                time.sleep(delay)
                delay = min(delay * 2, 2.0)
        self.instance.publish_snapshot()

    def _migrate_and_join(self) -> None:
        with create_session() as session:
            store = Store(session)
            store.migrate(self.settings.shards)
            self._refuse_overlapping_queues(store)
            store.refuse_other_leases(self.shared.job_id, self.settings.lease_seconds)
            store.register(
                self.shared.job_id,
                get_hostname(),
                self.shared.capacity,
                self.shared.queues_key,
                health_url=self.instance.health_url,
                shards=self.settings.shards,
                lease_seconds=self.settings.lease_seconds,
            )
            # peers renew now and hand this one its share
            store.notify_membership(self.shared.job_id, self.shared.queues_key)

    def _refuse_overlapping_queues(self, store: Store) -> None:
        """Queue sets own separate shard spaces: two sets of one team that share a queue would both run its
        triggers (each team has spaces of its own)."""
        mine = set(self.shared.queues or ())
        for other in store.live_queue_sets(self.settings.lease_seconds):
            theirs, team = split_space(other)
            if team == self.shared.team_name and theirs != mine and theirs & mine:
                raise ConfigError(
                    f"--queues {','.join(sorted(mine))} overlaps a live instance's --queues "
                    f"{','.join(sorted(theirs))}: instances must serve either the same queue set or "
                    "disjoint ones"
                )

    def guard(self) -> None:
        """Stop running shards before their leases can expire when they cannot be renewed.

        A slow loop (a busy host, a long burst) is not a reason: the leases are renewed now, and those
        still valid by the database clock keep their groups running (stopping and restarting coroutines
        is itself a stall). Only when that renewal fails are all shards stopped.
        """
        if not self.shared.owned or not self._renewal_overdue():
            return
        if self.instance.db_step("renewal", self.renew) or not self.shared.owned:
            return
        log.warning(
            "cannot renew shard leases; stopping all shards before they expire",
            shards=len(self.shared.owned),
            cause=self.instance.step_error(),
        )
        self.drop_all()

    def _renewal_overdue(self) -> bool:
        return time.monotonic() - self.last_renewal > self.settings.lease_seconds * 0.6

    def drop_lapsed(self) -> None:
        """Shards whose lease lapsed while this instance thought it held them (the database clock stepped,
        a loop was slow): their members are dropped, not kept without a coroutine, and the shards leave
        ``owned``, so whoever claims them next (this instance too) reads them in full."""
        lapsed, self.shared.lapsed = self.shared.lapsed & self.shared.owned, set()
        if not lapsed:
            return
        log.warning(
            "shard leases lapsed by the database clock; dropping them until claimed again",
            shards=sorted(lapsed),
        )
        self.drop(lapsed)
        self.shared.owned -= lapsed
        self.feed.to_read -= lapsed

    def heartbeat_counters(self) -> None:
        counters = self.instance.counters()
        with create_session() as session:
            store = Store(session)
            self._renew_membership(store, counters)
        self.instance.counters_published(counters)

    def _renew_membership(self, store: Store, counters: dict[str, Any]) -> None:
        """Heartbeat our instance row; note the database clock it read, and re-read the feed if our
        membership had lapsed before this renewal."""
        was_live, db_now = store.heartbeat(
            self.shared.job_id, self.settings.lease_seconds, feed_xmin=self._feed_xmin(), **counters
        )
        self.shared.db_clock = (db_now, time.monotonic())
        if not was_live:
            self.lost_the_feed()

    def _feed_xmin(self) -> str | None:
        """How far this instance has read the change feed (rows before it may be pruned)."""
        if self.feed.load_xmin is None or self.feed.hash_xmin is None:
            return None
        return min(self.feed.load_xmin, self.feed.hash_xmin, key=int)

    def renew(self) -> None:
        started = time.monotonic()
        self.load_filters.update()
        with create_session() as session:
            store = Store(session)
            counters = self.instance.counters()
            self._renew_membership(store, counters)
            self.instance.counters_published(counters)
            live = store.live_candidates(self.settings.lease_seconds, self.shared.queues_key)
            self._wake_at_lapse([m.lapses_in for m in live if m.candidate.job_id != self.shared.job_id])
            desired = self._desired_shards(store, live)
            released = self.handover.drained(self.shared.owned - desired)
            # shards still being given up keep their leases until their coroutines ended (handover.py)
            desired |= self.shared.owned - desired - released
            if released:
                store.release_shards(self.shared.job_id, released, self.shared.queues_key)
                # the taker claims them now, not at its next loop
                store.notify_membership(self.shared.job_id, self.shared.queues_key)
            loads = self._loads_to_publish()
            claimed = store.claim_shards(
                self.shared.job_id, desired, self.settings.lease_seconds, self.shared.queues_key, loads
            )
            written = claimed.copy()  # the shards whose group counts this statement published
            if skipped := (desired - claimed) & self.shared.owned:
                # still ours, locked by a session of ours whose client is gone: kept, renewed later
                claimed |= store.held_shards(self.shared.job_id, skipped, self.shared.queues_key)
        published = self.published_loads | {s: loads[s] for s in written & loads.keys()}
        self.published_loads = {s: g for s, g in published.items() if s in claimed}
        self.last_renewal = started
        lost, gained = self.shared.owned - claimed, claimed - self.shared.owned
        self.shards_moved_in += len(gained)
        self.shards_moved_out += len(lost)
        if lost:
            log.info("handing over shards", shards=sorted(lost))
            self.drop(lost)
        if gained:
            log.info("took shards", shards=sorted(gained))
        self.shared.owned = claimed
        self.feed.to_read = (self.feed.to_read | gained) & claimed

    def _desired_shards(self, store: Store, live: list[LiveMember]) -> set[int]:
        """The shards this instance should hold, by the placement every live instance computes alike."""
        if self.instance.stalled():
            return set()  # out of the fleet while its runner does not answer (stall.py)
        if all(m.candidate.job_id != self.shared.job_id for m in live):
            live = [*live, LiveMember(self._candidate(), PLACEMENT, self.settings.lease_seconds)]
        if any(m.placement < PLACEMENT for m in live):
            # an instance of an earlier release is live (a rolling upgrade): all compute its placement,
            # so that the fleet agrees on one map; load-following placement resumes once it has left
            members = [Member(m.candidate.job_id, m.candidate.capacity) for m in live]
            self.load_filters.note_fleet(False)  # capacity is only a weight in that placement
            return shards_of(self.shared.job_id, assign(self.settings.shards, members))
        shards = store.shard_loads(self.shared.queues_key)
        self.shard_groups = {s.shard: s.groups for s in shards if s.groups is not None}
        placement = place(
            self.settings.shards,
            [m.candidate for m in live],
            self.shard_groups,
            {s.shard: s.owner for s in shards},
            self.settings.placement_epsilon,
        )
        self.load_filters.note_fleet(placement.full)
        return placement.shards_of(self.shared.job_id)

    def _candidate(self) -> Candidate:
        return Candidate(
            self.shared.job_id,
            self.shared.capacity,
            accepting=self.load_filters.accepting,
            limit=self.load_filters.limit_groups,
        )

    def _loads_to_publish(self) -> dict[int, int]:
        """Groups per owned and loaded shard, where they changed enough since last published: placement
        weighs shards by these, and inputs that stay still while little changes keep shards still."""
        now = time.monotonic()
        if now - self.loads_counted_at < LOADS_EVERY_SECONDS:
            return {}
        self.loads_counted_at = now
        counts = {shard: 0 for shard in self.shared.owned - self.feed.to_read}
        for group in self.shared.groups.waiting():
            info = self.shared.member_info.get(next(iter(group.members)))
            if info is not None and info.shard in counts:
                counts[info.shard] += 1
        return {
            shard: groups
            for shard, groups in counts.items()
            if abs(groups - self.published_loads.get(shard, -LOAD_STEP)) >= max(LOAD_STEP, 0.1 * groups)
        }

    def lost_the_feed(self) -> None:
        """Our membership lapsed by the database clock (a pause, a very slow loop), and with it our claim on
        the change feed (peers prune what every live instance has read): read everything again, once. A
        slow loop whose membership held reads on from where it was."""
        self.feed.load_xmin = self.feed.hash_xmin = None

    def listen(self, selector: selectors.BaseSelector) -> None:
        """Renew as soon as a peer joins, stops or hands shards over (notices.py); again after the
        listening connection broke, at most every ``RETRY_SECONDS``."""
        if self.notices is None:
            self.notices = MembershipNotices(self.shared.job_id, self.shared.queues_key, self.renew_now)
        self.notices.attach(selector)

    def renew_now(self) -> None:
        """The next loop loads (and so renews) at once."""
        self.instance.load_by(-math.inf)

    def _wake_at_lapse(self, lapses_in: list[float]) -> None:
        """Load again right when another member's membership lapses (it stopped renewing: crashed or
        paused), not up to a loop later: its shards, whose leases expire with it, are taken at once."""
        soonest = min((left for left in lapses_in if left < self.settings.loop_seconds), default=None)
        if soonest is not None:
            self.instance.load_by(time.monotonic() + max(soonest, 0.0) + LAPSE_MARGIN_SECONDS)

    def finish_leaving(self) -> None:
        """Once the shards being given up have drained, renew at once: that renewal releases them."""
        if self.handover.over():
            self.renew_now()

    def drop(self, shards: set[int]) -> None:
        """Forget every waiter of these shards and cancel their coroutines without on_kill."""
        dropped = [t for t, info in self.shared.member_info.items() if info.shard in shards]
        for trigger_id in dropped:
            # held events first: their shard is known only while the member's info is kept (they are
            # stored: whoever holds the shard next resumes them)
            self.shared.held.pop(trigger_id, None)
            self.shared.forget_member(trigger_id, user_action=False)
        self.handover.forget(shards)

    def drop_all(self) -> None:
        """Every shard stopped (a renewal that failed, the runner wedged): its waiters forgotten, no drain
        left, nothing owned and so nothing left to read in full (whatever is claimed again is, then)."""
        self.drop(self.shared.owned | set(self.handover.leaving))
        self.shared.owned, self.feed.to_read = set(), set()

    def release_all(self) -> None:
        """Graceful stop: release every lease and leave the membership at once; the last instance also
        takes the change feed off Airflow's tables (best effort: the next start prunes what is left)."""
        if self.notices is not None:
            self.notices.close()
        with create_session() as session:
            store = Store(session)
            store.stop_instance(self.shared.job_id)
            store.notify_membership(self.shared.job_id, self.shared.queues_key)  # the takers claim at once
        self.shared.owned = set()
        try:
            with create_session() as session:
                removed = Store(session).remove_feed_if_last(self.shared.job_id, self.settings.lease_seconds)
        except SQLAlchemyError as err:
            log.warning(
                "could not remove the change feed's triggers; the next instance to start uses them",
                error=cause(err),
            )
            return
        if removed:
            log.info("last instance stopped: removed the change feed's triggers from Airflow's tables")
