"""What the supervisor says to Airflow's runner and builds for it, where overriding Airflow's
``TriggerRunnerSupervisor`` is the contract: the workloads of the groups' coroutines (one statement per
batch for task triggers, DAGs read once per start, log files through the bounded pool), the runner's
requests answered (task-state questions counted, ended coroutines' last log lines read first), its log
channel read without blocking, and the nudge that ends its idle tick when coroutines wait for it."""

from __future__ import annotations

import contextlib
import os
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
from smart_triggerer.supervisor.starting import RowCannotBeBuilt
from smart_triggerer.supervisor.state import SupervisorState
from smart_triggerer.supervisor.trigger_logs import (
    PooledTriggerLoggingFactory,
    read_while_ready,
    reading_only_ready,
)
from smart_triggerer.supervisor.workloads import StartFromTrigger, log_renderer, plain_workload, task_rows

log = structlog.get_logger(logger_name=__name__)
TASK_STATE_REQUESTS = ("GetTaskStates", "GetDRCount")  # what ExternalDagTrigger asks Airflow

LOG_READS_BEFORE_FINISHING = 1024  # reads of Airflow's 4 KB each: the runner's biggest batch is 256 KB


class RunnerComms(SupervisorState):
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
        is in neither: another member leads its group (``Starting.next_leader``)."""
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
            raise RowCannotBeBuilt(trigger.id) from err
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
