"""``airflow smart-triggerer ...``: the same commands through Airflow's provider CLI hook."""

from __future__ import annotations

from typing import Any


def get_cli_commands() -> list[Any]:
    from airflow.cli.cli_config import ActionCommand, Arg, GroupCommand, lazy_load_command

    verbose = Arg(("-v", "--verbose"), action="store_true", help="on an error, print the traceback too")
    run_args = (
        Arg(
            ("--capacity",),
            type=int,
            default=None,
            help="the most groups (coroutines) the instance runs; its weight in shard placement",
        ),
        Arg(
            ("--health-port",),
            type=int,
            default=None,
            help="serve GET /health and /metrics on PORT (0 picks a free port)",
        ),
        Arg(
            ("--health-host",),
            default=None,
            help="address of the health endpoint (default 127.0.0.1; others need health_token)",
        ),
        Arg(("--queues",), default=None, help="comma-separated trigger queues to serve"),
        Arg(
            ("--team-name",),
            default=None,
            help="serve only this team's triggers (Airflow 3.3 multi-team; needs [core] multi_team)",
        ),
        Arg(("--skip-serve-logs",), action="store_true", help="do not start the trigger log server"),
        verbose,
    )
    status_args = (Arg(("--json",), action="store_true", help="print one JSON object"), verbose)
    return [
        GroupCommand(
            name="smart-triggerer",
            help="Deduplicating, sharded triggerer (airflow-smart-triggerer)",
            subcommands=(
                ActionCommand(
                    name="run",
                    help="Run one smart triggerer instance",
                    func=lazy_load_command("smart_triggerer.cli.main.provider_run"),
                    args=run_args,
                ),
                ActionCommand(
                    name="status",
                    help="Instances, shards, waiters, groups, dedup ratio",
                    func=lazy_load_command("smart_triggerer.cli.main.provider_status"),
                    args=status_args,
                ),
            ),
        )
    ]
