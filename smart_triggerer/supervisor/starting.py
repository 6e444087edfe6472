"""Starting groups: one coroutine per group in Airflow's runner, most urgent first, built a batch at a
time (workloads, DAGs read once per start, log files through the bounded pool, first lines held
during a big start) and the runner's requests answered."""

from __future__ import annotations

import contextlib
import math
import os
import time
from typing import Any, cast

import structlog
from airflow.jobs.triggerer_job_runner import (
    TriggerLoggingFactory,
    messages,
)
from airflow.models.dagbag import DBDagBag
from airflow.models.taskinstance import TaskInstance
from airflow.models.trigger import Trigger
from airflow.utils.session import create_session
from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, selectinload

from smart_triggerer.db.bounded import each_statement_commits
from smart_triggerer.db.errors import cause, is_outage, is_transient
from smart_triggerer.placement.groups import Group
from smart_triggerer.runner.trigger_runner import NUDGE_SIGNAL
from smart_triggerer.supervisor.dagbag import OneBuildDagBag
from smart_triggerer.supervisor.state import SupervisorState
from smart_triggerer.supervisor.trigger_logs import (
    PooledTriggerLoggingFactory,
    read_while_ready,
    reading_only_ready,
)
from smart_triggerer.supervisor.workloads import StartFromTrigger, log_renderer, plain_workload, task_rows

log = structlog.get_logger(logger_name=__name__)
TASK_STATE_REQUESTS = ("GetTaskStates", "GetDRCount")  # what ExternalDagTrigger asks Airflow

# a group whose poll interval no kwarg names is started after those due within this many seconds
UNKNOWN_INTERVAL_SECONDS = 60.0

LOG_READS_BEFORE_FINISHING = 1024  # reads of Airflow's 4 KB each: the runner's biggest batch is 256 KB


def start_under_way(hash_xmin: str | None, sweep_after: int, to_read: set[int], owned: set[int]) -> bool:
    """A start or a takeover has more to hand out than the groups waiting now: a sweep's pass hashes on
    (its groups wait to be read), or shards of a phased takeover are still to be read. Between two loops
    of a cold start the groups read so far may all be running: making their files then took the
    supervisor's CPU from the rest of the start (docs/design.md, Measurements behind the code)."""
    return (hash_xmin is None and sweep_after != 0) or bool(to_read & owned)


class _RowCannotBeBuilt(Exception):
    """A database error building one row's workload that is not an outage nor a lock: that row cannot
    lead its group, and the build's transaction is lost (the others are built again)."""

    def __init__(self, trigger_id: int) -> None:
        super().__init__(trigger_id)
        self.trigger_id = trigger_id


class GroupStarting(SupervisorState):
    def _start_groups(self) -> None:
        """Start waiting groups, most urgent first, a batch at a time while this call's time budget lasts
        (the rest in the next call, right after the runner's messages were handled): every loop stays short
        and renews its leases in time, and a takeover of thousands starts in seconds. A build is a batch at
        most, also for groups started while the database was away (``build_backlog``)."""
        self.groups.wake(time.monotonic())  # failed watchers whose backoff is over
        self._hold_collector()
        self.log_files.pace()  # before the first batch goes out: its lines come back between batches
        deadline = time.monotonic() + self._busy_budget()
        while not self.stop:
            for group in self._next_to_start(min(self.settings.max_new_per_loop, self._room())):
                self.groups.start(group)
            self.build_backlog = self._request_started()
            if not self._start_backlog() or time.monotonic() >= deadline:
                return
            # hand this batch to the runner (it asks, we answer) and read its log lines while building
            # the next: a runner left unanswered stalls on its full log socket
            self._service_subprocess(0.0)

    def _start_under_way(self) -> bool:
        return start_under_way(self.hash_xmin, self.sweep_after, self.to_read, self.owned)

    def _hold_collector(self) -> None:
        """No collection of the older generations while a big start runs (``collector.OlderHeld``): groups
        wait to start or to be built, shards of a phased takeover are still to be read, or the first log
        lines of a big hand-out are still held. The last is the runner's own sign: the lines are held
        until none of a new coroutine came for a moment (``LogFiles.pace``), and Airflow counts a
        coroutine running as soon as the runner takes its pile, which it then creates for seconds. The
        collection that fell due ran while it did, on the same two cores (docs/design.md, Measurements
        behind the code)."""
        starting = self._start_backlog() or bool(self.to_read & self.owned) or self.log_files.pool.holding
        self.collector.update(len(self.groups.unstarted), starting)

    def _start_backlog(self) -> bool:
        """Groups wait for a coroutine (with room for one), or started groups for their workload."""
        return (bool(self.groups.unstarted) and self._room() > 0) or self.build_backlog

    def _next_to_start(self, count: int) -> list[Group]:
        """Up to ``count`` waiting groups, most urgent first. The order is sorted again only when a group
        came to wait since (``Groups.arrivals``) or it ran out: a takeover of tens of thousands starts
        them over many calls, and sorting them all again in each was a sixteenth of the supervisor's
        CPU. Groups started or gone meanwhile are passed over."""
        if count <= 0:
            return []
        if self.start_order_arrivals != self.groups.arrivals or not self.start_order:
            self.start_order = self._by_urgency() if self.groups.unstarted else []
            self.start_order_arrivals = self.groups.arrivals
        batch: list[Group] = []
        taken = 0
        for group in self.start_order:
            taken += 1
            if self.groups.unstarted.get(group.identity_hash) is group:
                batch.append(group)
                if len(batch) == count:
                    break
        del self.start_order[:taken]
        return batch

    def _by_urgency(self) -> list[Group]:
        """The waiting groups, those whose next poll or earliest member timeout is due soonest first (a
        group just taken over may be due at once; its last poll is not known): asset watchers first, then
        by poll interval or timeout, whichever comes sooner."""
        now = self._db_now()
        timeouts = self.deadlines.soonest()

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
        requested = self.groups.runners  # read, never changed here
        if self.handover.runners:
            requested = requested - self.handover.runners  # shards being given up: their coroutines end
        # the groups' ids the runner neither runs nor has been handed, nor is ending: the running ones
        # first, between two sets kept as they are (a takeover compares tens of thousands of ids once per
        # batch; building their union first cost twice as much), then the few of the others
        new_ids = requested - self.running_triggers
        if new_ids:
            new_ids.difference_update(
                (entry.trigger_id for entry in self.events),
                (entry.trigger_id for entry in self.orphans),
                self.cancelling_triggers,
                (failure[0] for failure in self.failed_triggers),
                (w.id for w in self.creating_triggers),
            )
        cancel_ids = self.running_triggers - requested
        if cancel_ids:
            self.cancelling_triggers.update(cancel_ids)
            self._nudge_runner()
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
        if workloads:
            self._nudge_runner()
        not_started = new_ids - {w.id for w in workloads}
        for trigger_id in not_started:
            self._next_leader(trigger_id)
        return bool(not_started), more

    def _nudge_runner(self) -> None:
        """Coroutines wait to be handed to the runner (or cancelled): end its idle tick now
        (design: Nudges), once until it asks again. A runner that is gone or not listening yet loses
        nothing: its
        next tick asks anyway."""
        if self.nudged or self.pid is None or self.pid <= 0 or self._exit_code is not None:
            # asked already; not started (0 or less would signal a whole process group: ours); or exited
            # (reaped: its pid may be another process's)
            return
        self.nudged = True
        with contextlib.suppress(OSError):  # exited: the loop notices and stops
            os.kill(self.pid, NUDGE_SIGNAL)

    def _next_leader(self, trigger_id: int) -> None:
        """A group's leader row could not start (its task was cleared or timed out between load and start,
        its workload cannot be built): let another member lead, or the group would never run."""
        group = self.groups.by_runner(trigger_id)
        if group is None:
            return
        group.unstartable.add(trigger_id)
        self.groups.stop_runner(group)
        leader = self.groups.start(group)
        log.warning(
            "a group's leader could not start",
            trigger_id=trigger_id,
            next_leader=leader,
            members=len(group.members),
        )

    def fetch_trigger_details(self, trigger_ids: set[int], *, session: Session) -> dict[int, Trigger]:
        """Airflow's ``Trigger.bulk_fetch`` without what a workload never reads: it also joins each task
        instance's trigger (the row just read, again) and that trigger's triggerer job, for every trigger
        of a takeover's build (docs/design.md, Measurements behind the code)."""
        each_statement_commits(session)  # the first statement of Airflow's build session (bounded.py)
        stmt = (
            select(Trigger)
            .where(Trigger.id.in_(trigger_ids))
            .options(selectinload(Trigger.task_instance).noload(TaskInstance.trigger))
        )
        return {trigger.id: trigger for trigger in session.scalars(stmt)}

    def build_trigger_workloads(self, new_trigger_ids: set[int]) -> list[Any]:
        """Task triggers' workloads from one statement per batch (workloads.py); the rest Airflow's way."""
        render_log_fname = log_renderer()
        if render_log_fname is None:
            return super().build_trigger_workloads(new_trigger_ids)
        built, airflow_way = self._build_task_workloads(new_trigger_ids, render_log_fname)
        if airflow_way:
            built.extend(super().build_trigger_workloads(airflow_way))
        return built

    def _build_task_workloads(
        self, trigger_ids: set[int], render_log_fname: Any
    ) -> tuple[list[Any], set[int]]:
        """(workloads built, ids left to Airflow's builder). A row whose DAG cannot be read on this host
        is in neither: another member leads its group (``_next_leader``)."""
        try:
            with create_session() as session:
                each_statement_commits(session)  # deserializing a big DAG may take a while (bounded.py)
                rows = task_rows(session, trigger_ids)
                flags = StartFromTrigger(session, self.dag_cache, DBDagBag()).of(list(rows.values()))
        except Exception as err:
            if isinstance(err, SQLAlchemyError) and (is_outage(err) or is_transient(err)):
                raise
            # a row the batch cannot read: Airflow's builder names the row it cannot build, and another
            # member of its group leads
            log.warning(
                "could not read a batch of workloads in one statement; building them Airflow's way",
                error=cause(err),
            )
            return [], set(trigger_ids)
        built: list[Any] = []
        airflow_way = set(trigger_ids) - set(rows)  # watchers, callbacks, rows gone (Airflow says which)
        log_id = self.job.id if self.job is not None else self.id
        for trigger_id, row in rows.items():
            flag = flags[trigger_id]
            if isinstance(flag, Exception):
                log.error(
                    "a trigger's workload cannot be built on this host",
                    trigger_id=trigger_id,
                    error=cause(flag),
                )
                continue
            made = (
                None
                if flag or row.ti["dag_version_id"] is None
                else plain_workload(row, render_log_fname, log_id)
            )
            if made is None:  # starts from the trigger, no DAG version, or values only Airflow can explain
                airflow_way.add(trigger_id)
                continue
            workload, ti, log_path = made
            self.log_files.close_now(
                trigger_id
            )  # its previous coroutine's file, if not closed yet: before this one
            self.logger_cache[trigger_id] = PooledTriggerLoggingFactory(
                log_path=log_path,
                ti=ti,  # type: ignore[arg-type]  # as Airflow's
                pool=self.log_files.pool,
            )
            built.append(self._for_group(workload, row.encrypted_kwargs))
        return built, airflow_way

    def _create_workload(
        self, trigger: Trigger, dag_bag: Any, render_log_fname: Any, session: Session
    ) -> Any:
        """Airflow's, for the rows ``build_trigger_workloads`` leaves to it."""
        if self.build_bag is None or self.build_bag.bag is not dag_bag:
            self.build_bag = OneBuildDagBag(dag_bag, self.dag_cache)
        try:
            workload = super()._create_workload(
                trigger, cast("DBDagBag", self.build_bag), render_log_fname, session
            )  # a DBDagBag in all Airflow asks of it
        except SQLAlchemyError as err:
            if is_outage(err) or is_transient(err):
                raise
            # this row's own data is refused (e.g. a value its model cannot load): it cannot lead here
            log.error(
                "a trigger's workload cannot be built; another member leads its group",
                trigger_id=trigger.id,
                error=cause(err),
            )
            raise _RowCannotBeBuilt(trigger.id) from err
        except Exception as err:
            # e.g. a timetable or a module the task's DAG needs is not installed on this host: this row
            # cannot lead its group here (another member, or another host after a handover, may)
            log.error(
                "a trigger's workload cannot be built on this host", trigger_id=trigger.id, error=cause(err)
            )
            return None
        self._pool_log_file(trigger.id)
        return None if workload is None else self._for_group(workload, trigger.encrypted_kwargs)

    def _for_group(self, workload: Any, encrypted_kwargs: str) -> Any:
        """A dedupable group's coroutine runs with its members' merged settings and no timeout of its own."""
        group = self.groups.by_runner(workload.id)
        info = self.member_info.get(workload.id)
        if group is None or info is None or not info.dedupable or not self.settings.dedup:
            return workload
        if workload.timeout_after is not None:
            # Members time out one by one (see _timeout_members); the shared coroutine must not.
            workload = workload.model_copy(update={"timeout_after": None})
        # the merged settings, also for a single member: they are what running_settings records, and a
        # group's merges only grow (members that left still count until the group ends)
        return self._with_group_settings(workload, encrypted_kwargs, group)

    def _pool_log_file(self, trigger_id: int) -> None:
        """The coroutine's log file through the bounded pool, not one descriptor per coroutine."""
        self.log_files.close_now(
            trigger_id
        )  # its previous coroutine's file, if not closed yet: before this one
        factory = self.logger_cache.get(trigger_id)
        if type(factory) is TriggerLoggingFactory:
            self.logger_cache[trigger_id] = PooledTriggerLoggingFactory.replacing(
                factory, self.log_files.pool
            )

    def _with_group_settings(self, workload: Any, encrypted_kwargs: str, group: Group) -> Any:
        """Run the group with its members' merged settings (shortest interval, every channel...). While
        its members all brought the same execution kwargs, the leader's own are the merged ones: its
        kwargs are not decrypted to compare (most groups at a takeover of tens of thousands)."""
        if not group.settings or group.uniform is not None:
            return workload
        kwargs = Trigger._decrypt_kwargs(encrypted_kwargs)
        changed = {
            k: v for k, v in group.settings.items() if k in kwargs and kwargs[k] != v and [kwargs[k]] != v
        }
        if not changed:
            return workload
        kwargs.update(changed)
        return workload.model_copy(update={"encrypted_kwargs": Trigger.encrypt_kwargs(kwargs)})

    def _handle_request(self, msg: Any, log: Any, req_id: int) -> None:
        handing_out = bool(self.creating_triggers)
        if isinstance(msg, messages.TriggerStateChanges):
            self.nudged = False  # it asked: what is waiting goes out with this answer
        if type(msg).__name__ in TASK_STATE_REQUESTS:
            self.task_state_requests_total += 1
        if isinstance(msg, messages.TriggerStateChanges) and msg.finished:
            self._read_sent_log_lines()
            self.log_files.close_later(msg.finished)
        super()._handle_request(msg, log, req_id)
        if isinstance(msg, messages.TriggerStateChanges):
            if msg.finished or msg.events or msg.failures or handing_out:
                self.runner_changes += 1  # what the runner runs changed: compare with the groups again
            for trigger_id in msg.finished or ():
                self.user_cancels.discard(trigger_id)

    def _guard_log_reads(self) -> None:
        """Airflow's loop selects, then calls each ready socket's reader in turn; the reader's ``recv``
        blocks. ``_read_sent_log_lines`` (run while a runner request is handled) may empty the log channel
        that the same select reported ready, and Airflow would then block reading it: the runner, waiting
        for the answer to its next request, sends no line, and both wait for ever (CI: every event fired
        after that moment was never stored). Each log reader is wrapped once, before any select, to read
        only what is there."""
        for key in self._log_keys():
            read, on_close = key.data
            if not hasattr(read, "raw"):  # not wrapped yet
                self.selector.modify(key.fileobj, key.events, data=(reading_only_ready(read), on_close))

    def _log_keys(self) -> list[Any]:
        """The selector keys of the runner's log channel."""
        keys = self.selector.get_map().values()
        return [key for key in keys if self._open_sockets.get(key.fileobj) == "logs"]  # type: ignore[call-overload]

    def _read_sent_log_lines(self) -> None:
        """Read what the runner's log channel holds now. Airflow closes an ended coroutine's log file when a
        sync reports it ended, and its reader takes 4 KB a call: the runner sends its lines in
        batches just before a sync (docs/design.md, runner: The log channel), and the ended coroutines'
        last lines must reach their
        files, not the supervisor's own log. Bounded: a runner that never stops writing holds nothing up."""
        for key in self._log_keys():
            # Airflow's reader, its 4 KB reads counted; a closed channel is left to the loop's next select
            raw = getattr(key.data[0], "raw", key.data[0])
            read_while_ready(raw, key.fileobj, LOG_READS_BEFORE_FINISHING)
