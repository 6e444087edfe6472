"""Membership and shard leases: joining (migrations first), renewing the leases the placement gives this
instance (placement.py; rendezvous hashing while an instance of an earlier release is live), noticing a
lapse by the database clock, dropping and releasing shards."""

from __future__ import annotations

import math
import time
from typing import Any

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
from smart_triggerer.supervisor.state import SupervisorState

log = structlog.get_logger(logger_name=__name__)

# after a member's membership lapses, its leases (renewed just before its heartbeat) have expired too
LAPSE_MARGIN_SECONDS = 0.05

MIGRATE_WAIT_SECONDS = 60.0  # start-up: how long migrations are tried again while their locks are busy

# a shard's group count is published again when it moved by this many groups and by a tenth
LOAD_STEP = 5

LOADS_EVERY_SECONDS = 5.0  # groups per shard are counted this often (a pass over every group)


class Leases(SupervisorState):
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
        self.publish_snapshot()

    def _migrate_and_join(self) -> None:
        with create_session() as session:
            store = Store(session)
            store.migrate(self.settings.shards)
            self._refuse_overlapping_queues(store)
            store.refuse_other_leases(self.job_id, self.settings.lease_seconds)
            store.register(
                self.job_id,
                get_hostname(),
                self.capacity,
                self.queues_key,
                health_url=self.health_url,
                shards=self.settings.shards,
                lease_seconds=self.settings.lease_seconds,
            )
            # peers renew now and hand this one its share
            store.notify_membership(self.job_id, self.queues_key)

    def _refuse_overlapping_queues(self, store: Store) -> None:
        """Queue sets own separate shard spaces: two sets of one team that share a queue would both run its
        triggers (each team has spaces of its own)."""
        mine = set(self.queues or ())
        for other in store.live_queue_sets(self.settings.lease_seconds):
            theirs, team = split_space(other)
            if team == self.team_name and theirs != mine and theirs & mine:
                raise ConfigError(
                    f"--queues {','.join(sorted(mine))} overlaps a live instance's --queues "
                    f"{','.join(sorted(theirs))}: instances must serve either the same queue set or "
                    "disjoint ones"
                )

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
        log.warning(
            "cannot renew shard leases; stopping all shards before they expire",
            shards=len(self.owned),
            cause=self.last_error,
        )
        self._drop_shards(set(self.owned))
        self.owned = set()

    def _renewal_overdue(self) -> bool:
        return time.monotonic() - self.last_renewal > self.settings.lease_seconds * 0.6

    def _drop_lapsed(self) -> None:
        """Shards whose lease lapsed while this instance thought it held them (the database clock stepped,
        a loop was slow): their members are dropped, not kept without a coroutine, and the shards leave
        ``owned``, so whoever claims them next (this instance too) reads them in full."""
        lapsed, self.lapsed = self.lapsed & self.owned, set()
        if not lapsed:
            return
        log.warning(
            "shard leases lapsed by the database clock; dropping them until claimed again",
            shards=sorted(lapsed),
        )
        self._drop_shards(lapsed)
        self.owned -= lapsed
        self.to_read -= lapsed

    def _heartbeat_counters(self) -> None:
        counters = self._counters()
        with create_session() as session:
            store = Store(session)
            self._renew_membership(store, counters)
        self.published_counters = counters

    def _renew_membership(self, store: Store, counters: dict[str, Any]) -> None:
        """Heartbeat our instance row; note the database clock it read, and re-read the feed if our
        membership had lapsed before this renewal."""
        was_live, db_now = store.heartbeat(
            self.job_id, self.settings.lease_seconds, feed_xmin=self._feed_xmin(), **counters
        )
        self.db_clock = (db_now, time.monotonic())
        if not was_live:
            self._lost_the_feed()

    def _feed_xmin(self) -> str | None:
        """How far this instance has read the change feed (rows before it may be pruned)."""
        if self.load_xmin is None or self.hash_xmin is None:
            return None
        return min(self.load_xmin, self.hash_xmin, key=int)

    def _renew_leases(self) -> None:
        started = time.monotonic()
        self.load_filters.update()
        with create_session() as session:
            store = Store(session)
            counters = self._counters()
            self._renew_membership(store, counters)
            self.published_counters = counters
            live = store.live_candidates(self.settings.lease_seconds, self.queues_key)
            self._wake_at_lapse([m.lapses_in for m in live if m.candidate.job_id != self.job_id])
            desired = self._desired_shards(store, live)
            released = self.handover.drained(self.owned - desired)
            # shards still being given up keep their leases until their coroutines ended (handover.py)
            desired |= self.owned - desired - released
            if released:
                store.release_shards(self.job_id, released, self.queues_key)
                # the taker claims them now, not at its next loop
                store.notify_membership(self.job_id, self.queues_key)
            loads = self._loads_to_publish()
            claimed = store.claim_shards(
                self.job_id, desired, self.settings.lease_seconds, self.queues_key, loads
            )
            written = claimed.copy()  # the shards whose group counts this statement published
            if skipped := (desired - claimed) & self.owned:
                # still ours, locked by a session of ours whose client is gone: kept, renewed later
                claimed |= store.held_shards(self.job_id, skipped, self.queues_key)
        published = self.published_loads | {s: loads[s] for s in written & loads.keys()}
        self.published_loads = {s: g for s, g in published.items() if s in claimed}
        self.last_renewal = started
        lost, gained = self.owned - claimed, claimed - self.owned
        self.shards_moved_in += len(gained)
        self.shards_moved_out += len(lost)
        if lost:
            log.info("handing over shards", shards=sorted(lost))
            self._drop_shards(lost)
        if gained:
            log.info("took shards", shards=sorted(gained))
        self.owned = claimed
        self.to_read = (self.to_read | gained) & claimed

    def _desired_shards(self, store: Store, live: list[LiveMember]) -> set[int]:
        """The shards this instance should hold, by the placement every live instance computes alike."""
        if self.watch.stall is not None:
            return set()  # out of the fleet while its runner does not answer (stall.py)
        if all(m.candidate.job_id != self.job_id for m in live):
            live = [*live, LiveMember(self._candidate(), PLACEMENT, self.settings.lease_seconds)]
        if any(m.placement < PLACEMENT for m in live):
            # an instance of an earlier release is live (a rolling upgrade): all compute its placement,
            # so that the fleet agrees on one map; load-following placement resumes once it has left
            members = [Member(m.candidate.job_id, m.candidate.capacity) for m in live]
            self.load_filters.note_fleet(False)  # capacity is only a weight in that placement
            return shards_of(self.job_id, assign(self.settings.shards, members))
        shards = store.shard_loads(self.queues_key)
        self.shard_groups = {s.shard: s.groups for s in shards if s.groups is not None}
        placement = place(
            self.settings.shards,
            [m.candidate for m in live],
            self.shard_groups,
            {s.shard: s.owner for s in shards},
            self.settings.placement_epsilon,
        )
        self.load_filters.note_fleet(placement.full)
        return placement.shards_of(self.job_id)

    def _candidate(self) -> Candidate:
        return Candidate(
            self.job_id,
            self.capacity,
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
        counts = {shard: 0 for shard in self.owned - self.to_read}
        for group in self.groups.waiting():
            info = self.member_info.get(next(iter(group.members)))
            if info is not None and info.shard in counts:
                counts[info.shard] += 1
        return {
            shard: groups
            for shard, groups in counts.items()
            if abs(groups - self.published_loads.get(shard, -LOAD_STEP)) >= max(LOAD_STEP, 0.1 * groups)
        }

    def _lost_the_feed(self) -> None:
        """Our membership lapsed by the database clock (a pause, a very slow loop), and with it our claim on
        the change feed (peers prune what every live instance has read): read everything again, once. A
        slow loop whose membership held reads on from where it was."""
        self.load_xmin = self.hash_xmin = None

    def listen_for_peers(self) -> None:
        """Renew as soon as a peer joins, stops or hands shards over (notices.py); again after the
        listening connection broke, at most every ``RETRY_SECONDS``."""
        if self.notices is None:
            self.notices = MembershipNotices(self.job_id, self.queues_key, self._renew_now)
        self.notices.attach(self.selector)

    def _renew_now(self) -> None:
        """The next loop loads (and so renews) at once."""
        self.last_load = -math.inf

    def _wake_at_lapse(self, lapses_in: list[float]) -> None:
        """Load again right when another member's membership lapses (it stopped renewing: crashed or
        paused), not up to a loop later: its shards, whose leases expire with it, are taken at once."""
        soonest = min((left for left in lapses_in if left < self.settings.loop_seconds), default=None)
        if soonest is not None:
            # the next load runs once loop_seconds have passed since last_load: move last_load back
            due = time.monotonic() + max(soonest, 0.0) + LAPSE_MARGIN_SECONDS
            self.last_load = min(self.last_load, due - self.settings.loop_seconds)

    def _alive_runners(self) -> set[int]:
        """Coroutines the runner runs or has been handed (it may still start those)."""
        return self.running_triggers | {w.id for w in self.creating_triggers}

    def _finish_leaving(self) -> None:
        """Once the shards being given up have drained, renew at once: that renewal releases them."""
        if self.handover.over():
            self._renew_now()

    def drain(self) -> None:
        """Graceful stop, before the leases are released: every shard is given up as in a handover, for
        as long as a handover's drain at most, so that events in flight are stored by this instance."""
        if not self.owned or self._exit_code is not None:
            return
        deadline = time.monotonic() + self.handover.drain_seconds()
        self.handover.leave(set(self.owned) - set(self.handover.leaving), deadline)
        while self.handover.runners & self._alive_runners() and time.monotonic() < deadline:
            self._request_started()  # the cancels go out with the runner's next answer
            self._service_subprocess(0.05)
            self._db_step("events", self.handle_events)
            if self._exit_code is not None:
                break
        self._db_step("events", self.handle_events)
        left = self.handover.runners & self._alive_runners()
        if left:
            log.warning(
                "stopping with coroutines the runner had not ended yet; an event they fire now is "
                "fired again by the next owner (a state) or redelivered by its source",
                coroutines=len(left),
            )

    def _drop_shards(self, shards: set[int]) -> None:
        """Forget every waiter of these shards and cancel their coroutines without on_kill."""
        dropped = [t for t, info in self.member_info.items() if info.shard in shards]
        for trigger_id in dropped:
            # held events first: their shard is known only while the member's info is kept (they are
            # stored: whoever holds the shard next resumes them)
            self.held.pop(trigger_id, None)
            self._forget_member(trigger_id, user_action=False)
        self.handover.forget(shards)

    def release_all(self) -> None:
        """Graceful stop: release every lease and leave the membership at once; the last instance also
        takes the change feed off Airflow's tables (best effort: the next start prunes what is left)."""
        if self.notices is not None:
            self.notices.close()
        self.waker.close()
        with create_session() as session:
            store = Store(session)
            store.stop_instance(self.job_id)
            store.notify_membership(self.job_id, self.queues_key)  # the takers claim at once
        self.owned = set()
        try:
            with create_session() as session:
                removed = Store(session).remove_feed_if_last(self.job_id, self.settings.lease_seconds)
        except SQLAlchemyError as err:
            log.warning(
                "could not remove the change feed's triggers; the next instance to start uses them",
                error=cause(err),
            )
            return
        if removed:
            log.info("last instance stopped: removed the change feed's triggers from Airflow's tables")
