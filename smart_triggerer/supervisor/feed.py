"""Loading from the change feed: identities of new trigger rows computed once, then the waiters
that arrived or left since the last loop (every waiter only of a shard just taken), kept in groups. The
part owns how far it has read the feed and the shards it has still to read in full; it asks the rest of
the instance through ``Instance`` (the conductor answers)."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping
from typing import Protocol

import structlog
from airflow.utils.session import create_session

from smart_triggerer.db.store import Store, WaitingTrigger
from smart_triggerer.supervisor import fanout
from smart_triggerer.supervisor.deadlines import MemberDeadlines
from smart_triggerer.supervisor.identities import compute_identities, group_key
from smart_triggerer.supervisor.shared import Held, MemberInfo, Shared

log = structlog.get_logger(logger_name=__name__)

# a takeover of more groups than twice this reads about this many first and hands them to the runner
# before it reads the rest (a thousand groups: a few of the runner's batches, a short read)
FIRST_READ_GROUPS = 1000
# a takeover's phases go on for at most this share of the lease after the renewal that took the shards
# (the renewal itself is overdue at 0.6): the rest is read by the next loop, right after it renews
PHASES_WITHIN_LEASE = 0.3


class Instance(Protocol):
    """What the feed asks of the rest of the instance (the conductor answers)."""

    def stopping(self) -> bool: ...
    def runner_exited(self) -> bool: ...
    def renewed_at(self) -> float: ...  # time.monotonic() of the renewal that took the shards
    def renew_now(self) -> None: ...  # the next loop renews (and loads) at once
    def drop_lapsed(self) -> None: ...  # shards whose lease a fence found lapsed
    def leaving_shards(self) -> Collection[int]: ...  # being given up: their next owner reads them
    def published_groups(self) -> Mapping[int, int]: ...  # groups per shard, as owners last published them
    def start_groups(self) -> None: ...
    def send_to_runner(self) -> None: ...  # what was started goes to the runner now
    def db_step(self, name: str, step: Callable[[], None]) -> bool: ...


class Feed:
    def __init__(self, shared: Shared, deadlines: MemberDeadlines, instance: Instance) -> None:
        self.shared = shared
        self.settings = shared.settings
        self.deadlines = deadlines
        self.instance = instance
        # how far the change feed has been read (snapshot xmins); None: read everything (start, lost track)
        self.load_xmin: str | None = None
        self.hash_xmin: str | None = None
        self.sweep_after = 0  # a sweep's pass: the last trigger id it read
        # shards taken whose waiters have not been read in full yet: a shard leaves this set only when that
        # read commits (a statement failing later in the loop that took it must not leave it unread)
        self.to_read: set[int] = set()

    def read(self) -> None:
        """The waiters that arrived or left since the last read (and those of shards to read), after the
        leases were renewed."""
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
        log.warning(
            "the database's transaction ids went back; reading every waiter again",
            position=max(read),
            now=int(xmin),
        )
        self.load_xmin = self.hash_xmin = None
        return True

    def _hash_new_triggers(self) -> None:
        """Store the identity of every trigger row the change feed reports as new (of every row without
        one, in a sweep); the feed position moves on only once nothing before it is left unhashed (a row
        another instance is hashing, a row beyond this loop's limit)."""
        after = self.hash_xmin  # None: a sweep over every trigger row
        # a sweep's pass under way (its last batch was full) goes on from there: where the feed stands is
        # read between passes only (a count over every trigger row, each loop of a start otherwise)
        if (after is not None or not self.sweep_after) and self._nothing_to_hash(after):
            return
        hashed = self._hash_batches(after)
        if after is None:
            log.info("hashing trigger rows the change feed does not cover", rows=hashed)

    def _nothing_to_hash(self, after: str | None) -> bool:
        """Where the feed stands: True when no row is left to hash (the hashing position moves on) or the
        database went back in time (everything is read again)."""
        if after is None:
            self._ensure_feed()
        with create_session() as session:
            store = Store(session)
            if after is None:
                position = store.sweep_position(self.shared.queue_list)
            else:
                position = store.feed_position(after, self.shared.queue_list)
        if self._went_back(position.xmin):
            return True
        if position.unhashed == 0:
            self.hash_xmin = position.xmin
            return True
        return False

    def _hash_batches(self, after: str | None) -> int:
        """Hash rows without an identity, a committed batch at a time (peers share the work: SKIP LOCKED),
        while this loop's time budget lasts; returns how many. A sweep (``after`` None) reads on from where
        its last batch ended, not from the first row again: read from the first row, each batch makes the
        database go over every row the sweep has hashed already (docs/design.md, Measurements behind the
        code)."""
        batch = self.settings.max_new_per_loop * 4
        deadline = time.monotonic() + self.shared.busy_budget()
        hashed = 0
        while True:
            with create_session() as session:
                store = Store(session)
                rows = store.unhashed_triggers(
                    self.shared.queue_list,
                    limit=batch,
                    after_xid=after,
                    after_id=self.sweep_after if after is None else 0,
                )
                if rows:
                    store.insert_identities(compute_identities(rows, self.settings))
            hashed += len(rows)
            if after is None:
                # a full batch: the pass goes on after its last row (in id order); a short one ends it, and
                # the next pass starts from the first row again (a row a peer held, locked, is hashed by
                # the peer, or by that pass if the peer could not)
                self.sweep_after = rows[-1][0] if len(rows) == batch else 0
            if len(rows) < batch or time.monotonic() >= deadline or self.instance.stopping():
                return hashed

    def _ensure_feed(self) -> None:
        """Before reading everything again: the last instance to stop removes the feed's triggers, and
        this one may have been taken for stopped while it was paused."""
        with create_session() as session:
            if Store(session).ensure_feed_locked():
                log.warning(
                    "installed the change feed's triggers again (an instance stopped while this one "
                    "was paused, or a table of Airflow's was recreated)"
                )

    def _load_waiters(self) -> None:
        """Arrivals and departures since the last read, from the change feed; every waiter of shards just
        taken (or of all owned shards when the feed position was lost) in full.

        A takeover (or a start) of many groups reads its shards in phases, about ``FIRST_READ_GROUPS``
        groups first (by the loads their last owner published), then twice as many each time, and hands
        each phase's batches to the runner before reading the next: the runner starts coroutines while the
        supervisor reads, and never waits for one big read (tens of thousands of waiters take a while to
        read and claim, and the runner sat idle meanwhile; docs/design.md, Measurements behind the code).
        Shards of one read start soonest due first. The shards of later phases stay in ``to_read`` until
        their read commits; past ``PHASES_WITHIN_LEASE`` of the lease since the renewal, the next loop
        renews at once and reads them."""
        reread = self.load_xmin is None
        unread = set(self.shared.owned) if reread else self.to_read & self.shared.owned
        if reread and (self.shared.member_info or self.shared.held):
            # the feed's position was lost: every waiter at once, so that those gone meanwhile are forgotten
            self._read_waiters(unread, unread)
            return
        first, *later = self._read_phases(unread)
        self.to_read |= set().union(*later)  # a start's shards too: read in full by a later loop if need be
        if not self._read_waiters(first, unread):
            return
        for phase in later:
            if self.instance.stopping() or self.instance.runner_exited():
                return  # stopping, or the runner is gone: the rest stays to be read
            if (
                time.monotonic() - self.instance.renewed_at()
                > PHASES_WITHIN_LEASE * self.settings.lease_seconds
            ):
                # a slow machine, a short lease: renew first (the next loop, at once), then read the rest
                self.instance.renew_now()
                return
            self.instance.drop_lapsed()  # shards whose lease a read's fence found lapsed start nothing
            self.instance.db_step("start", self.instance.start_groups)
            self.instance.send_to_runner()  # the start's last batch goes to the runner before the next read
            shards = phase & self.shared.owned  # a shard dropped meanwhile is read when claimed again
            if self.instance.stopping() or (shards and not self._read_waiters(shards, set(), feed=False)):
                return

    def _read_phases(self, unread: set[int]) -> list[set[int]]:
        """The shards to read, in phases (in shard order): about ``FIRST_READ_GROUPS`` groups, then twice
        as many each phase; one phase when they are few, or when a shard's load is unknown (never
        published)."""
        loads = {shard: self.instance.published_groups().get(shard) for shard in unread}
        if None in loads.values() or sum(g or 0 for g in loads.values()) <= 2 * FIRST_READ_GROUPS:
            return [unread]
        phases: list[set[int]] = []
        phase: set[int] = set()
        groups, budget = 0, FIRST_READ_GROUPS
        for shard in sorted(unread):
            if groups >= budget:
                phases.append(phase)
                phase, groups, budget = set(), 0, budget * 2
            phase.add(shard)
            groups += loads[shard] or 0
        return [*phases, phase]

    def _read_waiters(self, full: set[int], unread: set[int], *, feed: bool = True) -> bool:
        """Read every waiter of the ``full`` shards and (``feed``) the arrivals and departures in owned
        shards read before (not those in ``unread``: they are read in full later), claim the new ones and
        join them; False when the database went back in time (everything is read again)."""
        hold = self.settings.resume_hold_seconds
        gone: set[int] = set()
        started = time.monotonic()
        with create_session() as session:
            store = Store(session)
            xmin = store.snapshot_xmin()
            rows = store.waiting_triggers(full, self.shared.queue_list, hold_seconds=hold)
            if feed and self.load_xmin is not None:
                rows += store.waiting_triggers(
                    self.shared.owned - full - unread,
                    self.shared.queue_list,
                    after_xid=self.load_xmin,
                    hold_seconds=hold,
                )
                gone = store.deleted_triggers(self.load_xmin)
            new = [r for r in rows if r.trigger_id not in self.shared.member_info and not r.error]
            if new:
                fenced = self.shared.fence(session)
                store.claim_triggers(self.shared.job_id, [r.trigger_id for r in new if r.shard in fenced])
        if self._went_back(xmin):
            return False
        self.to_read -= full  # read in full, committed
        if feed:
            # a later read in full of other shards keeps the position: the next feed read covers their
            # arrivals since this snapshot too
            reconcile = self.load_xmin is None
            self.load_xmin = xmin
            if reconcile:
                self._reconcile({r.trigger_id for r in rows})
        for trigger_id in gone:
            self.shared.held.pop(trigger_id, None)
            if trigger_id in self.shared.member_info:
                self.shared.forget_member(trigger_id, user_action=True)
        for row in rows:
            self._join(row)
        if full:  # a takeover's or a start's read: how long the runner waited for it
            log.info(
                "read whole shards",
                shards=len(full),
                waits=len(rows),
                seconds=round(time.monotonic() - started, 2),
            )
        return True

    def _join(self, row: WaitingTrigger) -> None:
        if row.trigger_id in self.shared.member_info or row.trigger_id in self.shared.held:
            return
        if row.shard not in self.shared.owned or row.shard in self.instance.leaving_shards():
            return  # a shard being given up: its next owner reads it in full
        if row.error is not None:
            self.deadlines.add_unreadable(row.trigger_id, row.shard, row.error)
            return
        self.shared.member_info[row.trigger_id] = MemberInfo(row.shard, row.has_task, row.dedupable)
        now = time.monotonic()
        if row.held_event is not None:
            # its event came while it was held by an owner before: resumed from it, never started again
            self.shared.held[row.trigger_id] = Held(fanout.event_from_text(row.held_event), now + row.held_in)
            return
        if row.hold_left > 0:
            self.shared.young_until[row.trigger_id] = now + row.hold_left
        if row.timeout_in is not None:
            self.deadlines.add(row.trigger_id, row.timeout_in)
        dedup = row.dedupable and self.settings.dedup
        key = group_key(row.trigger_id, row.identity_hash, dedup)
        group = self.shared.groups.join(row.trigger_id, key, row.execution if dedup else None)
        if group.stricter_than_running():
            # The newcomer needs more (a shorter poll interval, another NOTIFY channel): run the group from
            # its row with the merged settings; the old coroutine is cancelled without on_kill.
            log.info("restarting a group with more demanding settings", members=len(group.members))
            self.shared.groups.restart(group, runner=row.trigger_id)

    def _reconcile(self, waiting: set[int]) -> None:
        for trigger_id in set(self.shared.member_info) - waiting:
            self.shared.forget_member(trigger_id, user_action=True)
        for trigger_id in set(self.shared.held) - waiting:
            self.shared.held.pop(trigger_id, None)
