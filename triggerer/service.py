"""Running one smart triggerer instance: a ``TriggererJob`` whose supervisor is the smart one."""

from __future__ import annotations

import contextlib
import os

import structlog
from airflow.jobs.job import Job, run_job
from airflow.jobs.triggerer_job_runner import TriggererJobRunner
from sqlalchemy.exc import SQLAlchemyError

from triggerer.bounded import bound_waits
from triggerer.config import Settings
from triggerer.health import HealthServer
from triggerer.heap import tune_collector
from triggerer.supervisor import SmartTriggerRunnerSupervisor

log = structlog.get_logger(logger_name=__name__)

# per signal of the runner's stop escalation; SIGTERM -> exit stays within about 2 s
STOP_GRACE_SECONDS = 0.75


class SmartTriggererJobRunner(TriggererJobRunner):
    """Airflow's triggerer job (same job type, so Airflow's health checks count it) with our supervisor."""

    def __init__(self, job: Job, capacity: int | None, queues: set[str] | None, settings: Settings) -> None:
        super().__init__(job, capacity=capacity, queues=queues)
        self.settings = settings

    def _execute(self) -> int | None:
        os.environ["_AIRFLOW_PROCESS_CONTEXT"] = "server"
        self.register_signals()
        health = None
        if self.settings.health_port is not None:
            health = HealthServer(self.settings.health_port, self.settings.lease_seconds,
                                  self.settings.health_host, self.settings.health_token)
            health.start()
        supervisor: SmartTriggerRunnerSupervisor | None = None
        tune_collector()  # before the runner is forked: it inherits the settings and the frozen heap
        try:
            supervisor = SmartTriggerRunnerSupervisor.start(
                job=self.job, capacity=self.capacity, logger=log, queues=self.queues,
                settings=self.settings, health_url=health.url if health else None,
            )
            self.trigger_runner = supervisor
            if health is not None:
                health.snapshot = supervisor.snapshot
            supervisor.register()
            log.info("smart triggerer started", job_id=self.job.id, shards=self.settings.shards,
                     capacity=self.capacity, dedup=self.settings.dedup)
            supervisor.run()
            if not supervisor.stop:
                log.error("the trigger runner subprocess died; exiting", exit_code=supervisor._exit_code)
                return 1
            return supervisor.stop_code
        finally:
            self._shutdown(supervisor, health)

    def _shutdown(self, supervisor: SmartTriggerRunnerSupervisor | None, health: HealthServer | None) -> None:
        if supervisor is not None:
            # Release first: the next owner takes the shards within one of its loops.
            with contextlib.suppress(SQLAlchemyError):
                supervisor.release_all()
                log.info("released shard leases")
            # The leases are gone: whatever the runner still does is redone by the next owner, so it gets a
            # short grace (SIGINT, then SIGTERM, then SIGKILL) instead of Airflow's 10 s per step.
            supervisor.kill(escalation_delay=STOP_GRACE_SECONDS, force=True)
            supervisor.write_held_log_lines()
        if health is not None:
            health.stop()
        log.info("smart triggerer stopped")


def preflight(settings: Settings) -> None:
    """Before anything starts: PostgreSQL, reachable, and the deployment's shard count."""
    from airflow.utils.session import create_session

    from commandline.errors import require_airflow, require_postgres
    from triggerer.store import Store

    require_airflow()
    require_postgres()
    with create_session() as session:
        Store(session).check_shards(settings.shards)


def run(capacity: int | None, queues: set[str] | None, settings: Settings, skip_serve_logs: bool) -> int:
    from airflow.cli.commands.triggerer_command import _serve_logs
    from airflow.configuration import conf

    bound_waits(settings.lease_seconds)  # before the first connection of the run: every one carries them
    preflight(settings)
    with _serve_logs(skip_serve_logs):
        runner = SmartTriggererJobRunner(
            Job(heartrate=conf.getfloat("triggerer", "JOB_HEARTBEAT_SEC")), capacity, queues, settings
        )
        code = run_job(job=runner.job, execute_callable=runner._execute)
    return int(code or 0)
