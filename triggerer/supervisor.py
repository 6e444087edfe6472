"""The smart supervisor: Airflow's ``TriggerRunnerSupervisor`` with identity groups and shard leases.

Each loop it (1) renews its membership and the leases of the shards rendezvous hashing gives it,
(2) computes the identity of new trigger rows once, (3) loads the waiters of its shards into identity
groups and asks Airflow's runner subprocess for one coroutine per group, (4) fans every event out to all
members of the group in one transaction, holding it back for members that deferred too recently, and
(5) fails every member when the group's trigger fails. Everything else (the runner, trigger logs,
connections, the task-SDK comms) is Airflow's.
"""

from __future__ import annotations

import math
import socket
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import attrs
import structlog
from airflow.jobs.triggerer_job_runner import TriggerRunnerSupervisor, messages
from airflow.models.trigger import Trigger
from airflow.triggers.base import TriggerEvent
from airflow.utils.session import create_session
from sqlalchemy.exc import DBAPIError, SQLAlchemyError
from sqlalchemy.orm import Session

from triggerer import fanout
from triggerer.config import Settings
from triggerer.groups import Group, Groups
from triggerer.identities import compute_identities, group_key
from triggerer.rendezvous import Member, assign, shards_of
from triggerer.runner import SmartTriggerRunner
from triggerer.store import Store, WaitingTrigger

log = structlog.get_logger(logger_name=__name__)


@dataclass
class Held:
    """An event kept back for a member whose deferral is too recent to resume safely."""

    event: TriggerEvent
    release_at: float  # time.time()


@attrs.define(kw_only=True)
class SmartTriggerRunnerSupervisor(TriggerRunnerSupervisor):
    settings: Settings = attrs.field(factory=Settings.from_airflow)
    health_url: str | None = None

    groups: Groups = attrs.field(factory=Groups, init=False)
    owned: set[int] = attrs.field(factory=set, init=False)
    member_info: dict[int, WaitingTrigger] = attrs.field(factory=dict, init=False)
    held: dict[int, Held] = attrs.field(factory=dict, init=False)
    user_cancels: set[int] = attrs.field(factory=set, init=False)
    gained: set[int] = attrs.field(factory=set, init=False)
    max_seen_id: int = attrs.field(default=0, init=False)
    loops: int = attrs.field(default=0, init=False)
    last_renewal: float = attrs.field(default=-math.inf, init=False)
    last_load: float = attrs.field(default=-math.inf, init=False)
    db_ok: bool = attrs.field(default=True, init=False)
    events_total: int = attrs.field(default=0, init=False)
    resumed_total: int = attrs.field(default=0, init=False)
    failures_total: int = attrs.field(default=0, init=False)

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

    # --- the loop ---

    def register(self) -> None:
        with create_session() as session:
            store = Store(session)
            store.migrate(self.settings.shards)
            store.register(self.job_id, socket.getfqdn(), self.capacity, self.queues_key, self.health_url)

    def run_once(self) -> None:
        """Load once per ``loop_seconds``; in between, handle runner messages (events) as they come."""
        since_load = time.monotonic() - self.last_load
        if since_load >= self.settings.loop_seconds:
            self.loops += 1
            self.last_load = time.monotonic()
            self._db_step("load", self.load_triggers)
            self._db_step("cleanup", self.clean_unused)
            since_load = 0.0
        self._service_subprocess(self.settings.loop_seconds - since_load)
        self._db_step("events", self.handle_events)
        self._db_step("failures", self.handle_failed_triggers)
        self._db_step("held events", self.release_held)
        self._db_step("heartbeat", self.heartbeat)
        self.emit_metrics()
        self._guard_leases()

    def _db_step(self, name: str, step: Callable[[], None]) -> None:
        """A database outage must not stop the service: log once, keep looping, recover by itself."""
        try:
            step()
        except (DBAPIError, SQLAlchemyError) as err:
            if self.db_ok:
                log.warning("database unavailable; retrying every loop", step=name, error=type(err).__name__)
            self.db_ok = False
        else:
            if not self.db_ok and name == "load":
                log.info("database reachable again")
                self.db_ok = True

    def _guard_leases(self) -> None:
        """Stop running shards before their leases can expire when renewal keeps failing."""
        if not self.owned:
            return
        if time.monotonic() - self.last_renewal > self.settings.lease_seconds * 0.6:
            log.warning("cannot renew shard leases; stopping all shards before they expire",
                        shards=len(self.owned))
            self._drop_shards(set(self.owned))
            self.owned = set()

    # --- leases ---

    def load_triggers(self) -> None:
        self._renew_leases()
        self._hash_new_triggers()
        self._load_waiters()
        self._timeout_members()
        self._fail_unreadable()
        self._start_groups()

    def _renew_leases(self) -> None:
        started = time.monotonic()
        with create_session() as session:
            store = Store(session)
            store.heartbeat(self.job_id, **self._counters())
            members = store.live_members(self.settings.lease_seconds, self.queues_key)
            if all(m.job_id != self.job_id for m in members):
                members.append(Member(self.job_id, self.capacity))
            desired = shards_of(self.job_id, assign(self.settings.shards, members))
            released = self.owned - desired
            if released:
                store.release_shards(self.job_id, released)
            claimed = store.claim_shards(self.job_id, desired, self.settings.lease_seconds)
        self.last_renewal = started
        lost, gained = self.owned - claimed, claimed - self.owned
        if lost:
            log.info("handing over shards", shards=sorted(lost))
            self._drop_shards(lost)
        if gained:
            log.info("took shards", count=len(gained))
        self.owned = claimed
        self.gained = gained

    def _drop_shards(self, shards: set[int]) -> None:
        """Forget every waiter of these shards and cancel their coroutines without on_kill."""
        dropped = [t for t, info in self.member_info.items() if info.shard in shards]
        for trigger_id in dropped:
            # held events first: their shard is known only while the member's info is kept
            self.held.pop(trigger_id, None)
            self._forget_member(trigger_id, user_action=False)

    def release_all(self) -> None:
        """Graceful stop: release every lease and leave the membership at once."""
        with create_session() as session:
            Store(session).stop_instance(self.job_id)
        self.owned = set()

    # --- identities and membership ---

    def _hash_new_triggers(self) -> None:
        with create_session() as session:
            store = Store(session)
            rows = store.unhashed_triggers(sorted(self.queues) if self.queues else None,
                                           limit=self.settings.max_new_per_loop * 4)
            if rows:
                store.insert_identities(compute_identities(rows, self.settings))

    def _load_waiters(self) -> None:
        gained = self.gained
        full = self.loops % self.settings.reconcile_every == 0
        with create_session() as session:
            store = Store(session)
            if full:
                rows = store.waiting_triggers(self.owned)
            else:
                rows = store.waiting_triggers(self.owned - gained, after_id=self.max_seen_id)
                rows += store.waiting_triggers(gained & self.owned)
            new = [r.trigger_id for r in rows if r.trigger_id not in self.member_info]
            if new:
                store.claim_triggers(self.job_id, new)
        if full:
            self._reconcile({r.trigger_id for r in rows})
        for row in rows:
            self._join(row)

    def _join(self, row: WaitingTrigger) -> None:
        self.max_seen_id = max(self.max_seen_id, row.trigger_id)
        if row.trigger_id in self.member_info or row.trigger_id in self.held:
            return
        if row.shard not in self.owned:
            return
        self.member_info[row.trigger_id] = row
        dedup = row.dedupable and self.settings.dedup
        key = group_key(row.trigger_id, row.identity_hash, dedup)
        group = self.groups.join(row.trigger_id, key, row.execution if dedup else None)
        if group.stricter_than_running():
            # The newcomer needs a more demanding setting (e.g. a shorter poll interval): run the group
            # from its row with the merged settings; the old coroutine is cancelled without on_kill.
            log.info("restarting a group with more demanding settings", members=len(group.members))
            self.groups.restart(group, runner=row.trigger_id)

    def _reconcile(self, waiting: set[int]) -> None:
        for trigger_id in set(self.member_info) - waiting:
            self._forget_member(trigger_id, user_action=True)
        for trigger_id in set(self.held) - waiting:
            self.held.pop(trigger_id, None)

    def _forget_member(self, trigger_id: int, *, user_action: bool) -> None:
        info = self.member_info.pop(trigger_id, None)
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
        """Time out deferred members one by one (as the scheduler does), precisely, each loop."""
        with create_session() as session:
            fanout.timeout(session, sorted(self.owned))

    def _fail_unreadable(self) -> None:
        """Tasks whose trigger kwargs could not be read fail at once with the cause, alone."""
        with create_session() as session:
            for trigger_id, error in Store(session).failed_identities(self.owned):
                log.error("failing the tasks of an unreadable trigger", trigger_id=trigger_id, error=error)
                fanout.fail(session, [trigger_id], [f"smart-triggerer: {error}\n"])

    def _start_groups(self) -> None:
        # Building a workload costs Airflow a few queries per trigger: start a bounded number per loop so
        # every loop stays short and renews its leases in time (stock Airflow takes 50 per loop).
        pending = [g for g in self.groups.waiting() if g.runner_id is None]
        for group in pending[: self.settings.max_new_per_loop]:
            self.groups.start(group)
        self.update_triggers(self.groups.runner_ids())

    # --- workloads ---

    def _create_workload(self, trigger: Trigger, dag_bag: Any, render_log_fname: Any,
                         session: Session) -> Any:
        workload = super()._create_workload(trigger, dag_bag, render_log_fname, session)
        group = self.groups.by_runner(trigger.id)
        if workload is None or group is None:
            return workload
        info = self.member_info.get(trigger.id)
        if info is not None and info.dedupable and self.settings.dedup:
            # Members time out one by one (see _timeout_members); the shared coroutine must not.
            workload = workload.model_copy(update={"timeout_after": None})
            workload = self._with_group_settings(workload, trigger, group)
        return workload

    def _with_group_settings(self, workload: Any, trigger: Trigger, group: Group) -> Any:
        """Run the group with its members' most demanding numeric settings."""
        kwargs = trigger.kwargs
        changed = {k: v for k, v in group.settings.items() if k in kwargs and kwargs[k] != v}
        if not changed:
            return workload
        kwargs.update(changed)
        return workload.model_copy(update={"encrypted_kwargs": Trigger.encrypt_kwargs(kwargs)})

    # --- events and failures ---

    def handle_events(self) -> None:
        if not self.events:
            return
        entries = list(self.events)
        plans = [(entry, self.groups.by_runner(entry.trigger_id)) for entry in entries]
        now = time.time()
        batches: list[fanout.Batch] = []
        with create_session() as session:
            for entry, group in plans:
                if group is None:
                    continue
                ready, _young = self._split_by_age(group.members, now)
                batches.append((self._task_members(ready), entry.event))
                for trigger_id in group.members:
                    if not self._is_task(trigger_id):
                        fanout.submit_watcher_event(session, trigger_id, entry.event)
            self.resumed_total += fanout.resume(session, batches)
        for _ in entries:
            entry = self.events.popleft()
            if entry.persist_seq is not None:
                self.persisted_event_seqs.append(entry.persist_seq)
        self.events_total += len(entries)
        for entry, group in plans:
            if group is None:
                log.debug("event for a group this instance no longer runs", runner_id=entry.trigger_id)
                continue
            self._after_event(group, entry.event, now)

    def _after_event(self, group: Group, event: TriggerEvent, now: float) -> None:
        if not all(self._is_task(m) for m in group.members):
            return  # asset watchers and callbacks keep running after an event
        _ready, young = self._split_by_age(group.members, now)
        for trigger_id in young:
            self.held[trigger_id] = Held(event, self._release_time(trigger_id))
        for trigger_id in group.members:
            if trigger_id not in self.held:
                self.member_info.pop(trigger_id, None)
        self.groups.finish(group)

    def _split_by_age(self, members: Iterable[int], now: float) -> tuple[list[int], list[int]]:
        ready: list[int] = []
        young: list[int] = []
        for trigger_id in members:
            (young if self._release_time(trigger_id) > now else ready).append(trigger_id)
        return ready, young

    def _release_time(self, trigger_id: int) -> float:
        info = self.member_info.get(trigger_id)
        if info is None:
            return 0.0
        return info.created_date.timestamp() + self.settings.resume_hold_seconds

    def _is_task(self, trigger_id: int) -> bool:
        info = self.member_info.get(trigger_id)
        return info is None or info.has_task

    def _task_members(self, members: Iterable[int]) -> list[int]:
        return [m for m in members if self._is_task(m)]

    def release_held(self) -> None:
        now = time.time()
        due = [t for t, h in self.held.items() if h.release_at <= now]
        if not due:
            return
        by_event: dict[int, list[int]] = defaultdict(list)
        for trigger_id in due:
            by_event[id(self.held[trigger_id].event)].append(trigger_id)
        with create_session() as session:
            batches = [(ids, self.held[ids[0]].event) for ids in by_event.values()]
            self.resumed_total += fanout.resume(session, batches)
        for trigger_id in due:
            self.held.pop(trigger_id, None)
            self.member_info.pop(trigger_id, None)

    def handle_failed_triggers(self) -> None:
        if not self.failed_triggers:
            return
        entries = list(self.failed_triggers)
        plans = [(runner_id, exc, self.groups.by_runner(runner_id)) for runner_id, exc in entries]
        with create_session() as session:
            for runner_id, exc, group in plans:
                if group is None:
                    log.debug("failure of a group this instance no longer runs", runner_id=runner_id)
                    continue
                self.failures_total += fanout.fail(session, self._task_members(sorted(group.members)), exc)
        for _ in entries:
            self.failed_triggers.popleft()
        for _runner_id, _exc, group in plans:
            if group is not None:
                for trigger_id in list(group.members):
                    self.member_info.pop(trigger_id, None)
                self.groups.finish(group)

    # --- cancellation without on_kill ---

    def send_msg(self, msg: Any, request_id: int, error: Any = None, **dump_opts: Any) -> Any:
        """Send cancels signed: negative ids are cancelled without on_kill (see runner.py)."""
        if isinstance(msg, messages.TriggerStateSync) and msg.to_cancel:
            signed = {i if i in self.user_cancels else -i for i in msg.to_cancel}
            msg = msg.model_copy(update={"to_cancel": signed})
        return super().send_msg(msg, request_id, error, **dump_opts)

    def _handle_request(self, msg: Any, log: Any, req_id: int) -> None:
        super()._handle_request(msg, log, req_id)
        if isinstance(msg, messages.TriggerStateChanges):
            for trigger_id in msg.finished or ():
                self.user_cancels.discard(trigger_id)

    # --- reporting ---

    def _counters(self) -> dict[str, Any]:
        return {
            "runner_alive": self.is_alive(),
            "waiters": len(self.member_info),
            "groups": self.groups.group_count(),
            "events_total": self.events_total,
            "resumed_total": self.resumed_total,
            "failures_total": self.failures_total,
            "health_url": self.health_url,
        }

    def snapshot(self) -> dict[str, Any]:
        """What /metrics and /health report (read from the HTTP thread: plain values only)."""
        counters = self._counters()
        counters.update(shards_owned=len(self.owned), job_id=self.job_id,
                        coroutines=len(self.running_triggers), lease_age=time.monotonic() - self.last_renewal)
        return counters
