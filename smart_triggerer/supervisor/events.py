"""Events and failures: each event stored and fanned out to every member of its group in one fenced
transaction (held back for members that deferred too recently), a poison event set aside alone,
a failed group's tasks failed and its watchers started again after a backoff. The part owns what it
keeps between loops (orphaned events, strikes, dead letters, watchers' failures); Airflow's queues of the
runner's events and failures are the instance's, reached through ``Instance`` (the conductor answers)."""

from __future__ import annotations

import time
from collections import defaultdict, deque
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import structlog
from airflow.jobs.triggerer_job_runner import (
    TriggerEventEntry,
)
from airflow.triggers.base import TriggerEvent
from airflow.utils.session import create_session

from smart_triggerer.db.bounded import idle_limit_seconds
from smart_triggerer.db.errors import blames_event, cause, is_outage, is_transient
from smart_triggerer.db.store import Store
from smart_triggerer.placement.groups import Group
from smart_triggerer.supervisor import fanout
from smart_triggerer.supervisor.dead_letters import DEAD_AFTER, DeadLetters, payload_text
from smart_triggerer.supervisor.shared import Held, Shared

log = structlog.get_logger(logger_name=__name__)

# a failed asset watcher starts again after 1 s, then 2, 4... up to a minute while it keeps failing
WATCHER_BACKOFF_SECONDS = 1.0

WATCHER_BACKOFF_MAX_SECONDS = 60.0

# an event whose transaction the server ends this many times in a row while the database answers (a
# listener slower than the idle-in-transaction limit) is failed as its own fault
OUTAGE_STRIKES = 3


def _failure_cause(exc: Any) -> str:
    """A runner-reported failure in one line: an exception, the traceback lines it was sent as, or none."""
    if isinstance(exc, BaseException):
        return cause(exc)
    lines = [line.strip() for line in exc or () if isinstance(line, str) and line.strip()]
    return lines[-1].splitlines()[-1] if lines else "the trigger exited without sending an event"


class Instance(Protocol):
    """What the events part asks of the rest of the instance (the conductor answers)."""

    events: deque[TriggerEventEntry]  # Airflow's: the runner's events, to store
    failed_triggers: deque[Any]  # Airflow's: (runner id, error) of coroutines that failed
    persisted_event_seqs: deque[int]  # Airflow's: events stored, acknowledged to the runner

    def alive_coroutines(self) -> set[int]: ...  # running, not being cancelled
    def runner_changed(self) -> None: ...  # what the runner should run may differ now
    def guard_leases(self) -> None: ...  # renew first if a renewal is overdue
    def step_failed(self, name: str, err: Exception) -> None: ...  # logged once per cause


class EventFanout:
    def __init__(self, shared: Shared, instance: Instance) -> None:
        self.shared = shared
        self.settings = shared.settings
        self.instance = instance
        # events of coroutines still running whose group this instance forgot (its shards were dropped
        # and may be re-claimed without restarting the coroutine): kept until the group is back or the
        # coroutine ends
        self.orphans: list[TriggerEventEntry] = []
        self.outage_strikes: dict[int, int] = {}  # runner id -> in a row
        self.dead_letters = DeadLetters()
        # identity hash -> failures in a row of a group with asset watchers (reset by its next stored event)
        self.watcher_failures: dict[int, int] = {}
        self.watcher_failed_at: dict[int, float] = {}  # time.monotonic()
        self.last_watcher_error: str | None = None
        self.watcher_restarts_total = 0

    def handle_events(self) -> None:
        """Store the runner's events, front first, in bounded transactions; acknowledge what was stored.

        A transaction that fails is retried event by event, unless the database refuses every writer (an
        outage, read-only, a permission): then every event stays queued. Event by event, one that meets a
        lock it may not wait for is tried again next loop, behind the others; one whose own payload or
        listeners are refused fails its own members with the cause.
        """
        self._adopt_orphans()
        if self.instance.events:
            self.instance.runner_changed()  # runner ids leave the events queue: what to run may differ now
        later: list[TriggerEventEntry] = []
        try:
            while self.instance.events:
                # a slow chunk (a listener that takes seconds) must not let the leases lapse meanwhile
                self.instance.guard_leases()
                chunk = self._front_chunk()
                try:
                    self._store_events(chunk)
                except Exception as err:
                    if not self._event_may_be_at_fault(err):
                        raise
                    self._store_one_by_one(len(chunk), later)
                    continue
                for entry in chunk:
                    self.instance.events.popleft()
                    self.outage_strikes.pop(entry.trigger_id, None)
        finally:
            # events put off for a lock go back even when a later one met an outage
            self.instance.events.extend(later)

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
        self.instance.runner_changed()
        back, waiting = [], []
        alive = self.instance.alive_coroutines()
        for entry in self.orphans:
            if self.shared.groups.by_runner(entry.trigger_id) is not None:
                back.append(entry)
            elif entry.trigger_id in alive:
                waiting.append(entry)
            else:
                log.debug("dropping an event of a coroutine handed over", runner_id=entry.trigger_id)
        self.orphans = waiting
        self.instance.events.extendleft(reversed(back))

    def _front_chunk(self) -> list[TriggerEventEntry]:
        """Events from the front of the queue, up to ``max_resumes_per_transaction`` task members."""
        chunk: list[TriggerEventEntry] = []
        size = 0
        for entry in self.instance.events:
            group = self.shared.groups.by_runner(entry.trigger_id)
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
            self.instance.guard_leases()
            entry = self.instance.events[0]
            started = time.monotonic()
            try:
                self._store_events([entry])
            except Exception as err:
                if is_transient(err):
                    log.info(
                        "an event met a lock it may not wait for; trying it again next loop",
                        runner_id=entry.trigger_id,
                        error=cause(err),
                    )
                    later.append(entry)
                elif blames_event(err):
                    self._poisoned(entry, err)
                elif not self._lost_its_session_again(entry, err, time.monotonic() - started):
                    raise  # the database refuses every writer: this and every later event stay queued
                elif self.outage_strikes[entry.trigger_id] >= OUTAGE_STRIKES:
                    self._poisoned(
                        entry,
                        err,
                        why=(
                            f"the server ended its transaction {OUTAGE_STRIKES} times while the database "
                            "answered (a listener or callback slower than half a lease?)"
                        ),
                    )
                else:
                    later.append(entry)
            else:
                self.outage_strikes.pop(entry.trigger_id, None)
            self.instance.events.popleft()

    def _lost_its_session_again(self, entry: TriggerEventEntry, err: Exception, seconds: float) -> bool:
        """An event stored alone lost its connection while the database answers, after an attempt as long
        as the server's idle-in-transaction limit (half a lease, bounded.py): count it (a one-off network
        blip is retried; the same event losing its session every time is its own doing). A session ended
        sooner was not idle that long: terminated or restarted from outside, which to the client looks the
        same ("server closed the connection"); counted, it failed innocent tasks when sessions were ended
        again and again for a second while a fresh connection still answered. That is an outage."""
        if (
            not is_outage(err)
            or seconds < idle_limit_seconds(self.settings.lease_seconds)
            or not self._database_answers()
        ):
            return False
        self.outage_strikes[entry.trigger_id] = self.outage_strikes.get(entry.trigger_id, 0) + 1
        return True

    def _store_events(self, entries: Sequence[TriggerEventEntry]) -> None:
        now = time.monotonic()
        batches: list[fanout.Batch] = []
        outcomes: list[tuple[TriggerEventEntry, Group | None, set[int]]] = []
        holds: list[tuple[int, str, float]] = []
        held_events: dict[int, TriggerEvent] = {}
        with create_session() as session:
            fenced = self.shared.fence(session)
            for entry in entries:
                group = self.shared.groups.by_runner(entry.trigger_id)
                if group is None or self._in_lapsed_shard(group):
                    # not ours any more (handed over, lease lapsed): neither stored nor acknowledged
                    outcomes.append((entry, None, set()))
                    continue
                mine = {m for m in group.members if self.shared.shard_of(m) in fenced}
                ready, young = self._split_by_age(self.shared.task_members(mine), now)
                held = self._to_hold(entry.event, young, now)
                if held:
                    holds += held
                    held_events.update(dict.fromkeys(young, entry.event))
                else:
                    ready += young  # an event that cannot be held resumes now
                batches.append((ready, entry.event))
                for trigger_id in sorted(mine):
                    if not self.shared.is_task(trigger_id):
                        fanout.submit_watcher_event(session, trigger_id, entry.event)
                outcomes.append((entry, group, mine))
            # held in the event's own transaction: acknowledged below, the event lives in the database
            release_in = Store(session).hold_events(holds)
            resumed = fanout.resume(session, batches)
        self.shared.counters.resumed += resumed
        self.shared.counters.events += len(entries)
        for trigger_id, seconds in release_in.items():
            self.shared.held[trigger_id] = Held(held_events[trigger_id], now + seconds)
        for entry, group, mine in outcomes:
            if group is None:
                # not stored, not acknowledged: kept while its coroutine may still be ours
                self.orphans.append(entry)
                continue
            self.watcher_failures.pop(group.identity_hash, None)  # it works again
            self.dead_letters.forget(group.identity_hash)
            stored_all = mine >= {m for m in group.members if not self.shared.is_task(m)}
            if entry.persist_seq is not None and stored_all:
                self.instance.persisted_event_seqs.append(entry.persist_seq)
            self._after_event(group)

    def _to_hold(self, event: TriggerEvent, young: list[int], now: float) -> list[tuple[int, str, float]]:
        """What to store for young task members (trigger id, event text, seconds left to hold): none when
        the event cannot be written as text."""
        stored = fanout.event_text(event) if young else None
        if stored is None:
            return []
        return [(m, stored, max(self.shared.young_until.get(m, now) - now, 0.0)) for m in young]

    def _in_lapsed_shard(self, group: Group) -> bool:
        return any(self.shared.shard_of(m) in self.shared.lapsed for m in group.members)

    def _poisoned(self, entry: TriggerEventEntry, err: BaseException, why: str | None = None) -> None:
        """An event that cannot be stored on its own (the database refuses it, a listener or callback
        raises): its task members fail with the cause, its watchers restart with backoff; others go on."""
        self.outage_strikes.pop(entry.trigger_id, None)
        why = why or cause(err)
        group = self.shared.groups.by_runner(entry.trigger_id)
        log.error(
            "an event could not be stored; failing its members",
            runner_id=entry.trigger_id,
            members=len(group.members) if group else 0,
            error=why,
        )
        self.shared.counters.events += 1
        if group is None or self._in_lapsed_shard(group):
            return
        if self._set_aside(entry, group, why):
            return
        self._group_failed(group, [f"smart-triggerer: the trigger's event could not be stored: {why}\n"], why)

    def _set_aside(self, entry: TriggerEventEntry, group: Group, why: str) -> bool:
        """A watcher's event that failed ``DEAD_AFTER`` times in a row: written to the dead-event table and
        acknowledged (its source moves on), its task members failed; the watchers run on. False before."""
        watchers = sorted(m for m in group.members if not self.shared.is_task(m))
        if not watchers:
            return False
        tries = self.dead_letters.failed(group.identity_hash, entry.event.payload)
        if tries < DEAD_AFTER:
            return False
        with create_session() as session:
            fenced = self.shared.fence(session)
            store = Store(session)
            for trigger_id in watchers:
                if self.shared.shard_of(trigger_id) in fenced:
                    store.dead_event(trigger_id, payload_text(entry.event.payload), tries, why)
            tasks = [
                m
                for m in self.shared.task_members(sorted(group.members))
                if self.shared.shard_of(m) in fenced
            ]
            self.shared.counters.failures += fanout.fail(
                session, tasks, [f"smart-triggerer: the trigger's event could not be stored: {why}\n"]
            )
        log.error(
            "an asset watcher's event could not be stored; set aside in smart_triggerer.dead_event so "
            "its source moves on",
            runner_id=entry.trigger_id,
            tries=tries,
            error=why,
        )
        self.dead_letters.forget(group.identity_hash)
        self.dead_letters.total += 1
        if entry.persist_seq is not None:
            self.instance.persisted_event_seqs.append(entry.persist_seq)
        for trigger_id in tasks:
            self.shared.groups.leave(trigger_id)
            self._forget_info(trigger_id)
        return True

    def _after_event(self, group: Group) -> None:
        """Task members are done once the event is stored (young ones held); watchers keep running."""
        tasks = [m for m in group.members if self.shared.is_task(m)]
        if len(tasks) < len(group.members):
            # mixed task/watcher group: the coroutine keeps running for the watchers
            for trigger_id in tasks:
                self.shared.groups.leave(trigger_id)
                if trigger_id not in self.shared.held:
                    self.shared.member_info.pop(trigger_id, None)
            return
        self._end_group(group)

    def _end_group(self, group: Group) -> None:
        for trigger_id in list(group.members):
            self._forget_info(trigger_id)
        self.shared.groups.finish(group)

    def _forget_info(self, trigger_id: int) -> None:
        """What the loop knows of a member that left its group (kept while an event is held for it)."""
        if trigger_id not in self.shared.held:
            self.shared.member_info.pop(trigger_id, None)
            self.shared.young_until.pop(trigger_id, None)

    def _split_by_age(self, members: Iterable[int], now: float) -> tuple[list[int], list[int]]:
        ready: list[int] = []
        young: list[int] = []
        for trigger_id in members:
            (young if self.shared.young_until.get(trigger_id, 0.0) > now else ready).append(trigger_id)
        return ready, young

    def release_held(self) -> None:
        now = time.monotonic()
        due = [t for t, h in self.shared.held.items() if h.release_at <= now]
        if not due:
            return
        by_event: dict[int, list[int]] = defaultdict(list)
        for trigger_id in due:
            by_event[id(self.shared.held[trigger_id].event)].append(trigger_id)
        with create_session() as session:
            fenced = self.shared.fence(session)
            batches = [
                ([t for t in ids if self.shared.shard_of(t) in fenced], self.shared.held[ids[0]].event)
                for ids in by_event.values()
            ]
            Store(session).release_held_events(t for ids, _event in batches for t in ids)
            self.shared.counters.resumed += fanout.resume(session, batches)
        # those not fenced: their shard moved; its new owner resumes them from their stored event
        for trigger_id in due:
            self.shared.held.pop(trigger_id, None)
            self.shared.member_info.pop(trigger_id, None)
            self.shared.young_until.pop(trigger_id, None)

    def handle_failed_triggers(self) -> None:
        """Fail each failed group's members. A failure that cannot be stored now (a lock, the database
        refusing every writer) keeps its group and goes to the back, so it never holds up those behind it;
        an outage keeps them all."""
        for _ in range(len(self.instance.failed_triggers)):
            runner_id, exc = self.instance.failed_triggers[0]
            group = self.shared.groups.by_runner(runner_id)
            if group is None or self._in_lapsed_shard(group):
                log.debug("failure of a group this instance no longer runs", runner_id=runner_id)
            else:
                try:
                    self._group_failed(group, exc, _failure_cause(exc))
                except Exception as err:
                    if is_outage(err):
                        raise
                    self.instance.step_failed("failures", err)
                    self.instance.failed_triggers.rotate(-1)
                    continue
            self.instance.runner_changed()
            self.instance.failed_triggers.popleft()

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
            log.error(
                "a failure's traceback could not be stored; failing its tasks without it", error=cause(err)
            )
            self._fail_tasks(
                group,
                [
                    "smart-triggerer: the trigger failed, and its error could not be "
                    "stored; see the triggerer's log\n"
                ],
            )
        watchers = [m for m in group.members if not self.shared.is_task(m)]
        if not watchers or self._in_lapsed_shard(group):
            self._end_group(group)
            return
        for trigger_id in group.members - set(watchers):
            self.shared.groups.leave(trigger_id)
            self._forget_info(trigger_id)
        runner_id = group.runner_id
        attempt = self.watcher_failures.get(group.identity_hash, 0) + 1
        self.watcher_failures[group.identity_hash] = attempt
        self.watcher_failed_at[group.identity_hash] = time.monotonic()
        delay = min(WATCHER_BACKOFF_MAX_SECONDS, WATCHER_BACKOFF_SECONDS * 2 ** (attempt - 1))
        self.shared.groups.suspend(group, time.monotonic() + delay)
        self.watcher_restarts_total += 1
        self.last_watcher_error = why
        log.warning(
            "an asset watcher failed; starting it again after a backoff",
            runner_id=runner_id,
            watchers=len(watchers),
            attempt=attempt,
            retry_in=delay,
            error=why,
        )

    def _fail_tasks(self, group: Group, exc: Any) -> None:
        with create_session() as session:
            fenced = self.shared.fence(session)
            tasks = [
                m
                for m in self.shared.task_members(sorted(group.members))
                if self.shared.shard_of(m) in fenced
            ]
            self.shared.counters.failures += fanout.fail(session, tasks, exc)

    def forget_watcher_failures(self, now: float) -> None:
        """A watcher group that has run a while since its last failure counts as working again (one that
        rarely fires would otherwise stay 'failing'); groups that left are forgotten."""
        for identity_hash in list(self.watcher_failures):
            group = self.shared.groups.by_hash.get(identity_hash)
            failed_at = self.watcher_failed_at.get(identity_hash, now)
            working = (
                group is not None
                and group.runner_id is not None
                and (now - failed_at > WATCHER_BACKOFF_MAX_SECONDS)
            )
            if group is None or working:
                self.watcher_failures.pop(identity_hash, None)
                self.watcher_failed_at.pop(identity_hash, None)
