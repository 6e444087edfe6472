"""Running one smart triggerer instance: a ``TriggererJob`` whose supervisor is the smart one."""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import time
from pathlib import Path
from typing import Any

import structlog
from airflow.jobs.job import Job, run_job
from airflow.jobs.triggerer_job_runner import TriggererJobRunner
from sqlalchemy.exc import SQLAlchemyError

from smart_triggerer.config import ConfigError, Settings
from smart_triggerer.db.bounded import bound_waits, close_pooled_connections
from smart_triggerer.runner.collector import tune_collector
from smart_triggerer.supervisor import SmartTriggerRunnerSupervisor
from smart_triggerer.supervisor.log_files import EXIT_LOG_SECONDS
from smart_triggerer.web.health import HealthServer

log = structlog.get_logger(logger_name=__name__)

# per signal of the runner's stop escalation; SIGTERM -> exit within about 2 s (longer with tens of thousands
# of waiters, measured: docs/design.md; up to EXIT_LOG_SECONDS after the signal while log files a recent
# takeover left are written)
STOP_GRACE_SECONDS = 0.75
LEAVING_NICENESS = 19


class SmartTriggererJobRunner(TriggererJobRunner):
    """Airflow's triggerer job (same job type, so Airflow's health checks count it) with our supervisor."""

    signalled_at: float | None = None  # the first stop signal, on the monotonic clock

    def __init__(
        self,
        job: Job,
        capacity: int | None,
        queues: set[str] | None,
        settings: Settings,
        team_name: str | None = None,
    ) -> None:
        super().__init__(job, capacity=capacity, queues=queues, team_name=team_name)
        self.settings = settings

    def _exit_gracefully(self, signum: int, frame: Any) -> None:
        """Airflow's (stop at the end of this loop; a second signal forces the exit), and the loop's wait
        for the runner ends now: the leases are released at once (waker.py)."""
        super()._exit_gracefully(signum, frame)
        if self.signalled_at is None:
            self.signalled_at = time.monotonic()
        if isinstance(self.trigger_runner, SmartTriggerRunnerSupervisor):
            self.trigger_runner.wake()

    def _execute(self) -> int | None:
        os.environ["_AIRFLOW_PROCESS_CONTEXT"] = "server"
        self.register_signals()
        health = None
        if self.settings.health_port is not None:
            health = HealthServer(
                self.settings.health_port,
                self.settings.lease_seconds,
                self.settings.health_host,
                self.settings.health_token,
            )
            health.start()
        supervisor: SmartTriggerRunnerSupervisor | None = None
        tune_collector()  # before the runner is forked: it inherits the settings and the frozen heap
        close_pooled_connections()  # nor any database socket: the runner never opens a session
        try:
            supervisor = SmartTriggerRunnerSupervisor.start(
                job=self.job,
                capacity=self.capacity,
                logger=log,
                queues=self.queues,
                team_name=self.team_name,
                settings=self.settings,
                health_url=health.url if health else None,
            )
            self.trigger_runner = supervisor
            if health is not None:
                health.snapshot = supervisor.snapshot
            supervisor.register()
            log.info(
                "smart triggerer started",
                job_id=self.job.id,
                shards=self.settings.shards,
                capacity=self.capacity,
                dedup=self.settings.dedup,
                team=self.team_name,
            )
            supervisor.run()
            if not supervisor.stop:
                log.error("the trigger runner subprocess died; exiting", exit_code=supervisor._exit_code)
                return 1
            return supervisor.stop_code
        finally:
            self._shutdown(supervisor, health)

    def _shutdown(self, supervisor: SmartTriggerRunnerSupervisor | None, health: HealthServer | None) -> None:
        exit_by = (self.signalled_at or time.monotonic()) + EXIT_LOG_SECONDS
        if supervisor is not None:
            # Events in flight first (their coroutines end, what they sent is stored under the leases),
            # then release: the next owner takes the shards within one of its loops.
            drain(supervisor)
            with contextlib.suppress(SQLAlchemyError):
                supervisor.release_all()
                log.info("released shard leases")
            # The leases are gone (or expire as they would after a crash): whatever the runner still does
            # is redone by the next owner, so it gets a short grace (SIGINT, then SIGTERM, then SIGKILL)
            # instead of Airflow's 10 s per step, at the lowest priority.
            yield_cpu(supervisor.pid)
            leave_the_heap()
            supervisor.log_files.pool.exiting = True  # the runner's last lines are written as they come
            supervisor.kill(escalation_delay=STOP_GRACE_SECONDS, force=True)
        if health is not None:  # nothing left to report on: the log files below may take seconds
            stop_health(health)
        if supervisor is not None:
            # up to EXIT_LOG_SECONDS after the stop signal, one second at least
            supervisor.log_files.write_at_exit(max(exit_by - time.monotonic(), 1.0))
            # remote uploads queued (a slow store): what is left by the exit budget is said in one line
            supervisor.log_files.uploads.finish(max(exit_by - time.monotonic(), 0.5))
        log.info("smart triggerer stopped")


def drain(supervisor: SmartTriggerRunnerSupervisor) -> None:
    """Events in flight stored before the leases go; a drain that fails must not keep them."""
    try:
        supervisor.drain()
    except Exception as err:
        log.warning("could not store the events in flight before stopping", error=repr(err))


def stop_health(health: HealthServer) -> None:
    """The health endpoint stopped; one that fails to stop must not cost the rest of the exit."""
    try:
        health.stop()
    except Exception as err:
        log.warning("the health endpoint did not stop cleanly", error=repr(err))


def yield_cpu(runner_pid: int) -> None:
    """On the way out, what this instance still does (its runner cancelling thousands of coroutines,
    their last log lines) is cleanup: at the lowest priority, so that on a host it shares with the
    instance taking its shards over (two instances on one node, a rolling restart) the taker's start goes
    first (the cleanup of tens of thousands of waiters takes CPU the taker needs; docs/design.md,
    Measurements behind the code).

    Linux keeps a nice value per thread: every thread of the supervisor and of its runner is lowered
    (where /proc numbers processes otherwise, a PID namespace of a sandbox: the supervisor's Python
    threads and the runner's main thread).
    It shares the CPU between sessions first (autogroups) and a nice value counts only within its
    session: an instance in a session of its own (started by a service manager or with setsid) lowers
    its session's share as well; one that shares a session (two instances started from one shell) does
    not, as that would lower the taker's share with its own. Neither reaches across cgroups (containers,
    systemd units with a CPU controller): there each instance has its own share anyway."""
    for thread in _threads(runner_pid) + _own_threads():
        with contextlib.suppress(OSError):  # the runner (or a thread) may have exited already
            os.setpriority(os.PRIO_PROCESS, thread, LEAVING_NICENESS)
    if os.getsid(0) == os.getpid():
        with contextlib.suppress(OSError):  # no autogroups (another kernel, a setting): nice alone
            Path("/proc/self/autogroup").write_text(str(LEAVING_NICENESS))


def leave_the_heap() -> None:
    """On the way out, once the leases are released (or their release failed: they then lapse as after
    a crash): no more collections. What is left is cleanup and the exit, and a collection then scans the
    whole heap of groups being dropped, in a leaving supervisor, on the cores the next owner starts on
    (docs/design.md, Measurements behind the code). Frozen, the heap is not scanned at the interpreter's
    exit either; the cycles made meanwhile are freed with the process."""
    gc.disable()
    gc.freeze()


def _proc_is_ours() -> bool:
    """Whether /proc numbers processes as this process does. In a PID namespace whose /proc was not
    mounted again (a sandbox, some container set-ups) it gives the host's numbers: a thread id read there
    names another thread, or nothing, here."""
    try:
        return os.readlink("/proc/self") == str(os.getpid())
    except OSError:
        return False


def _threads(pid: int) -> list[int]:
    """The ids of a process's threads (its main thread alone where /proc cannot tell)."""
    if not _proc_is_ours():
        return [pid]
    try:
        return [int(name) for name in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return [pid]


def _own_threads() -> list[int]:
    """This process's threads: /proc's list (threads started by C libraries too) where it can be trusted,
    and Python's, whose ids come from the kernel in this process's own numbering."""
    python = [t.native_id for t in threading.enumerate() if t.native_id is not None]
    return sorted(set(_threads(os.getpid()) + python))


def preflight(settings: Settings, team_name: str | None = None) -> None:
    """Before anything starts: PostgreSQL, reachable and migrated, the deployment's shard count, the team."""
    from airflow.utils.session import create_session

    from smart_triggerer.db.preflight import require_airflow, require_migrated, require_postgres
    from smart_triggerer.db.store import Store

    require_airflow()
    require_postgres()
    require_migrated()
    with create_session() as session:
        Store(session).check_shards(settings.shards)
    if team_name is not None:
        from airflow.models.team import Team

        if Team.get_name_if_exists(team_name) is None:
            raise ConfigError(
                f"--team-name {team_name!r}: no such team (airflow teams list; "
                "airflow teams create makes one)"
            )


def log_server(skip: bool) -> contextlib.AbstractContextManager[object]:
    """Airflow's trigger log server beside the instance, as ``airflow triggerer`` runs it; skipped, its
    module is not even imported (Airflow's own context manager imports the server's web stack either way,
    a cost paid at every start; docs/design.md, Measurements behind the code)."""
    if skip:
        return contextlib.nullcontext()
    from airflow.cli.commands.triggerer_command import _serve_logs

    return _serve_logs(False)


def run(
    capacity: int | None,
    queues: set[str] | None,
    settings: Settings,
    skip_serve_logs: bool,
    *,
    team_name: str | None = None,
) -> int:
    from airflow.configuration import conf

    bound_waits(settings.lease_seconds)  # before the first connection of the run: every one carries them
    preflight(settings, team_name)
    with log_server(skip_serve_logs):
        runner = SmartTriggererJobRunner(
            Job(heartrate=conf.getfloat("triggerer", "JOB_HEARTBEAT_SEC")),
            capacity,
            queues,
            settings,
            team_name,
        )
        code = run_job(job=runner.job, execute_callable=runner._execute)
    return int(code or 0)
