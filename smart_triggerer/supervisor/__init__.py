"""The smart supervisor: Airflow's ``TriggerRunnerSupervisor`` with identity groups and shard leases.

Each loop it (1) renews its membership and the leases of the shards rendezvous hashing gives it, (2)
computes the identity of new trigger rows once, (3) reads the waiters that arrived or left since the last
loop from the change feed (``sql/0005_change_feed.sql``, ``sql/0011_one_feed_function.sql``; every waiter
only of a shard just taken), keeps them in identity groups and asks Airflow's runner subprocess for one
coroutine per group (so a loop in which nothing changed reads no rows and costs nothing per waiter), (4)
fans every event out to all members of the group in one transaction, holding it back for members that
deferred too recently, and (5) fails every member when the group's trigger fails. Everything else (the
runner, trigger logs, connections, the task-SDK comms) is Airflow's; trigger log files are written through a
bounded pool of open descriptors (``trigger_logs.py``), as an instance may run more coroutines than it may
open files.

Every write for a member runs in a transaction that first share-locks the member's shard lease and
checks it by the database clock (``Store.fence``): a process paused past its lease writes nothing for
shards another instance took over. An event is acknowledged to the runner (``persisted_event_seqs``)
only after it was stored; an event that cannot be stored fails its own members, never the whole loop.

The parts, one module each, own one job apiece (their docstrings say which): ``leases``, ``handover``,
``stall``, ``load``, ``feed``, ``deadlines``, ``starting``, ``log_files``, ``events``, ``housekeeping``: each
an object that owns its state and is handed the context the parts share (``shared.py``: settings, groups
and members, held events, owned shards, the database clock, the counters) and the parts it works with.
The class here is the conductor: ``run_once`` calls the parts in order, it answers what a part asks of the
instance (each part's ``Instance``), it overrides Airflow's ``TriggerRunnerSupervisor`` where that is the
contract (``runner_comms.py``: workloads, the runner's requests, its log channel) and it reports
(``reports.py``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

import structlog
from airflow.jobs.triggerer_job_runner import messages

from smart_triggerer.runner.trigger_runner import SmartTriggerRunner
from smart_triggerer.supervisor.log_files import WRITE_HELD_EVERY_SECONDS
from smart_triggerer.supervisor.reports import Reports
from smart_triggerer.supervisor.runner_comms import RunnerComms
from smart_triggerer.supervisor.state import SupervisorState

log = structlog.get_logger(logger_name=__name__)


class SmartTriggerRunnerSupervisor(RunnerComms, Reports, SupervisorState):
    """Airflow's supervisor with identity groups and shard leases: the parts, called in order."""

    @classmethod
    def run_in_process(cls) -> None:
        SmartTriggerRunner().run()

    def run_once(self) -> None:
        """Load once per ``loop_seconds`` (at once when a peer joined, stopped or handed shards over); in
        between, handle runner messages (events) as they come."""
        # first: a load or a start services the runner's sockets too (feed.py, starting.py), and a
        # blocking log reader must never be live there (see runner_comms.py)
        self._guard_log_reads()
        self.leases.guard()
        self.leases.listen(self.selector)
        self.waker.attach(self.selector)
        since_load = time.monotonic() - self.last_load
        if since_load >= self.settings.loop_seconds:
            self.loops += 1
            self.last_load = time.monotonic()
            self._db_step("load", self.load_triggers)
            self._db_step("cleanup", self.housekeeping.run)
        elif self.starting.backlog():
            # a takeover or a start: keep starting coroutines between loads, a time budget at a time
            self._db_step("start", self.start_groups)
        if not self.starting.backlog():
            self.dag_cache.clear()  # the start is over
        self.starting.hold_collector()  # held from a big start's first batch; released once it is over
        self.log_files.pace()
        # until the next load: a loop after the last one, or sooner when a member's membership lapses; at
        # once while groups still wait for a coroutine (events are handled between batches)
        wait = max(self.settings.loop_seconds - (time.monotonic() - self.last_load), 0.0)
        if self.log_files.pending():
            wait = min(wait, WRITE_HELD_EVERY_SECONDS)  # held log files are made a pass at a time
        self._service_subprocess(0.0 if self.starting.backlog() else wait)
        self.watch.look()  # after its messages were read: a wedged runner's instance steps out
        # lease checks run before writes: shards that may have lapsed while we waited stop first
        self.leases.guard()
        self._db_step("events", self.handle_events)
        self._db_step("failures", self.handle_failed_triggers)
        self._db_step("held events", self.release_held)
        self.leases.finish_leaving()
        self._db_step("heartbeat", self.heartbeat)
        self._track_pending()
        self.emit_metrics()
        self.publish_snapshot()

    def load_triggers(self) -> None:
        """What changed since the last loop, read from the change feed: nothing changed, nothing read.
        Timeouts, unreadable rows and starting groups are steps of their own: one failing (a lock, a row
        that cannot be built) never keeps the others, nor the next loop's read, from running."""
        try:
            self.read_changes()
        finally:
            self._db_step("timeouts", self.deadlines.timeout_members)
            self._db_step("unreadable", self.deadlines.fail_unreadable)
            self._db_step("start", self.start_groups)
            # publish this loop's counters when they changed, so `status` agrees with /metrics
            if self._counters() != self.published_counters:
                self._db_step("heartbeat", self.leases.heartbeat_counters)

    def read_changes(self) -> None:
        """Renew the leases, then read the waiters that arrived or left (and those of shards to read)."""
        self.leases.renew()
        self.feed.read()

    # --- Airflow's calls for the runner's events and failures, answered by the events part ---

    def handle_events(self) -> None:
        self.event_fanout.handle_events()

    def handle_failed_triggers(self) -> None:
        self.event_fanout.handle_failed_triggers()

    def release_held(self) -> None:
        self.event_fanout.release_held()

    # --- membership and leases (leases.py): started, stopped and drained by the service ---

    def register(self) -> None:
        self.leases.register()

    def drain(self) -> None:
        """Graceful stop, before the leases are released: every shard is given up as in a handover, for
        as long as a handover's drain at most, so that events in flight are stored by this instance."""
        if not self.owned or self._exit_code is not None:
            return
        deadline = time.monotonic() + self.handover.drain_seconds()
        self.handover.leave(set(self.owned) - set(self.handover.leaving), deadline)
        while self.handover.runners & self.alive_runners() and time.monotonic() < deadline:
            self.starting.request_started()  # the cancels go out with the runner's next answer
            self._service_subprocess(0.05)
            self._db_step("events", self.handle_events)
            if self._exit_code is not None:
                break
        self._db_step("events", self.handle_events)
        left = self.handover.runners & self.alive_runners()
        if left:
            log.warning(
                "stopping with coroutines the runner had not ended yet; an event they fire now is "
                "fired again by the next owner (a state) or redelivered by its source",
                coroutines=len(left),
            )

    def release_all(self) -> None:
        self.waker.close()
        self.leases.release_all()

    # --- what the leases ask of the instance (leases.py, Instance) ---

    def stalled(self) -> bool:
        return self.watch.stall is not None

    def counters(self) -> dict[str, Any]:
        return self._counters()

    def counters_published(self, counters: dict[str, Any]) -> None:
        self.published_counters = counters

    def load_by(self, due: float) -> None:
        """The next load runs once ``loop_seconds`` have passed since ``last_load``: moved back so that it
        runs at ``due`` at the latest."""
        self.last_load = min(self.last_load, due - self.settings.loop_seconds)

    def step_error(self) -> str | None:
        return self.last_error

    # --- what starting asks of the instance (starting.py, Instance) ---

    def runner_version(self) -> int:
        return self.runner_changes

    def running(self) -> set[int]:
        return self.running_triggers

    def not_to_start(self) -> Iterable[Iterable[int]]:
        return (
            (entry.trigger_id for entry in self.events),
            (entry.trigger_id for entry in self.orphans),
            self.cancelling_triggers,
            (failure[0] for failure in self.failed_triggers),
            (w.id for w in self.creating_triggers),
        )

    def cancel(self, runners: set[int]) -> None:
        self.cancelling_triggers.update(runners)
        self._nudge_runner()

    def build(self, trigger_ids: set[int]) -> list[Any]:
        try:
            return self.build_trigger_workloads(trigger_ids)
        finally:
            self.build_bag = None  # DAGs are shared within one build only

    def hand_out(self, workloads: Sequence[Any]) -> None:
        self.creating_triggers.extend(workloads)
        if workloads:
            self._nudge_runner()

    # --- what the events part asks of the instance (events.py, Instance) ---

    def alive_coroutines(self) -> set[int]:
        return set(self.running_triggers - self.cancelling_triggers)

    def runner_changed(self) -> None:
        self.runner_changes += 1

    def guard_leases(self) -> None:
        self.leases.guard()

    def step_failed(self, name: str, err: Exception) -> None:
        self._step_failed(name, err)

    # --- what the feed asks of the instance (feed.py, Instance) ---

    def stopping(self) -> bool:
        return bool(self.stop)

    def renewed_at(self) -> float:
        return self.leases.last_renewal

    def renew_now(self) -> None:
        self.leases.renew_now()

    def drop_lapsed(self) -> None:
        self.leases.drop_lapsed()

    def leaving_shards(self) -> Collection[int]:
        return self.handover.leaving.keys()

    def published_groups(self) -> Mapping[int, int]:
        return self.leases.shard_groups

    def start_groups(self) -> None:
        self.starting.start_groups()

    def send_to_runner(self) -> None:
        self._service_subprocess(0.0)

    # --- what the runner watch asks of the instance (stall.py, Instance) ---

    def runner_last_message(self) -> float:
        return float(self._last_runner_comms)

    def runner_exited(self) -> bool:
        return self._exit_code is not None

    def runner_pid(self) -> int:
        return int(self.pid)

    def alive_runners(self) -> set[int]:
        """Coroutines the runner runs or has been handed (it may still start those)."""
        return self.running_triggers | {w.id for w in self.creating_triggers}

    def hand_every_shard_over(self) -> None:
        self.leases.drop_all()

    def take_shards_again(self) -> None:
        self.leases.lost_the_feed()
        self.leases.renew_now()

    def db_step(self, name: str, step: Callable[[], None]) -> bool:
        return self._db_step(name, step)

    # --- what the handover asks of the instance (handover.py, Instance) ---

    def events_in_flight(self) -> list[int]:
        return [entry.trigger_id for entry in self.events]

    def read_in_full(self, shards: set[int]) -> None:
        self.to_read |= shards & self.owned

    # --- what housekeeping asks of the instance (housekeeping.py, Instance) ---

    def read_the_feed_again(self) -> None:
        self.leases.lost_the_feed()

    def stop_with(self, code: int) -> None:
        self.stop = True
        self.stop_code = code

    def forget_watcher_failures(self, now: float) -> None:
        self.event_fanout.forget_watcher_failures(now)

    def forget_held(self, trigger_id: int) -> None:
        self.held.pop(trigger_id, None)

    def wake(self) -> None:
        """From a signal handler: the loop's wait for the runner ends now (see waker.py)."""
        self.waker.wake()

    def _track_pending(self) -> None:
        """Since when events have waited to be stored (/health fails once that exceeds a lease)."""
        self.pending_since = (self.pending_since or time.monotonic()) if self.events else None

    def send_msg(self, msg: Any, request_id: int, error: Any = None, **dump_opts: Any) -> Any:
        """Send cancels signed: negative ids are cancelled without on_kill (see runner.py)."""
        if isinstance(msg, messages.TriggerStateSync) and msg.to_cancel:
            signed = {i if i in self.user_cancels else -i for i in msg.to_cancel}
            msg = msg.model_copy(update={"to_cancel": signed})
        return super().send_msg(msg, request_id, error, **dump_opts)
