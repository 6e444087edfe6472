"""The ``smart-triggerer`` command line (also ``airflow smart-triggerer`` through the provider)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence

from smart_triggerer import __version__
from smart_triggerer.cli.errors import add_common_arguments
from smart_triggerer.cli.parser import Parser


def _positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return number


def _port(value: str) -> int:
    number = int(value)
    if not 0 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port 0-65535 (0 picks a free one), got {value}")
    return number


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--capacity",
        type=_positive_int,
        default=None,
        help="the most groups (coroutines) the instance runs, and its weight in shard "
        "placement; when every instance is full, the waits beyond it stay deferred "
        "and start as room frees (default: [triggerer] capacity)",
    )
    parser.add_argument(
        "--health-port",
        type=_port,
        default=None,
        help="serve GET /health and /metrics on PORT; 0 picks a free port and logs it "
        "(default: [smart_triggerer] health_port, unset = no endpoint)",
    )
    parser.add_argument(
        "--health-host",
        default=None,
        help="address the health endpoint binds (default: [smart_triggerer] health_host, "
        "127.0.0.1); any other address, e.g. 0.0.0.0 for Kubernetes probes, needs "
        "[smart_triggerer] health_token",
    )
    parser.add_argument(
        "--queues",
        default=None,
        help="comma-separated trigger queues to serve (isolation from stock triggerers)",
    )
    parser.add_argument(
        "--team-name",
        default=None,
        help="serve only this team's triggers, in a shard space of its own (Airflow 3.3 "
        "multi-team; needs [core] multi_team), as airflow triggerer --team-name",
    )
    parser.add_argument(
        "--skip-serve-logs",
        action="store_true",
        help="do not start the trigger log server (as for `airflow triggerer`)",
    )


def add_status_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--team-name",
        default=None,
        help="with [core] multi_team: only this team's instances (and those of no team). "
        "status reads the metadata database with its credentials: it is for operators; "
        "the page scopes by team through Airflow's auth manager",
    )


EPILOG = """Configuration: the usual Airflow configuration (AIRFLOW_HOME, airflow.cfg, AIRFLOW__SECTION__KEY);
the metadata database must be PostgreSQL: `run` and `status` always use [database] sql_alchemy_conn
(SMART_TRIGGERER_DSN is read only by the demo and the tests of a clone, `python3 dev.py demo|test`).
Exit codes: 0 ok, 1 unexpected error (traceback), 2 invalid setting or argument, 3 database unreachable,
4 metadata database not PostgreSQL, 5 shard count differs from the deployment's, 6 missing database
privilege, 7 Airflow release not supported, 8 schema too new, 9 Airflow's tables never migrated."""


def build_parser() -> Parser:
    parser = Parser(
        prog="smart-triggerer",
        description="A deduplicating, sharded replacement for `airflow triggerer`.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    run = commands.add_parser(
        "run",
        help="run one smart triggerer instance",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_run_arguments(run)
    status = commands.add_parser(
        "status",
        help="instances, shards, waiters, groups, dedup ratio",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_status_arguments(status)
    for sub in (run, status):
        add_common_arguments(sub)
    return parser


def run_command(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from smart_triggerer.config import Settings
    from smart_triggerer.supervisor.service import run

    settings = Settings.from_airflow()
    if args.health_port is not None:
        settings = replace(settings, health_port=args.health_port)
    if getattr(args, "health_host", None):
        settings = replace(settings, health_host=args.health_host)
    queues = queue_set(args.queues)
    team = team_of(getattr(args, "team_name", None))
    return run(args.capacity, queues, settings, args.skip_serve_logs, team_name=team)


def queue_set(raw: str | None) -> set[str] | None:
    """``--queues``, refused as ``airflow triggerer`` refuses it, and when malformed."""
    from airflow.configuration import conf

    from smart_triggerer.config import ConfigError

    if raw is None:
        return None
    queues = [q.strip() for q in raw.split(",")]
    if not all(queues):
        raise ConfigError(
            f"--queues {raw!r} has an empty queue name: give comma-separated names, e.g. "
            "--queues reports,exports"
        )
    if not conf.getboolean("triggerer", "queues_enabled", fallback=False):
        raise ConfigError(
            "--queues may only be used when [triggerer] queues_enabled is True "
            "(AIRFLOW__TRIGGERER__QUEUES_ENABLED), as for airflow triggerer"
        )
    return set(queues)


def team_of(raw: str | None) -> str | None:
    """``--team-name``, refused as ``airflow triggerer`` refuses it (the team's existence is checked once
    the database is known to answer)."""
    from airflow.configuration import conf

    from smart_triggerer.config import ConfigError

    if raw is None:
        return None
    if not raw.strip():
        raise ConfigError("--team-name is empty: give the name of a team (airflow teams list)")
    if not conf.getboolean("core", "multi_team", fallback=False):
        raise ConfigError(
            "--team-name may only be used when [core] multi_team is True "
            "(AIRFLOW__CORE__MULTI_TEAM), as for airflow triggerer"
        )
    return raw.strip()


def status_command(args: argparse.Namespace) -> int:
    from smart_triggerer.config import Settings
    from smart_triggerer.db import status
    from smart_triggerer.db.preflight import require_migrated, require_postgres

    settings = Settings.from_airflow()
    team = team_of(getattr(args, "team_name", None))
    require_postgres()
    require_migrated()
    result = status.collect(settings, None if team is None else frozenset({team}))
    if args.json:
        print(json.dumps(result))
    else:
        status.render(result)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    from smart_triggerer.cli.errors import guarded

    handlers = {"run": run_command, "status": status_command}
    return guarded("smart-triggerer", args.verbose, lambda: handlers[args.command](args))


def provider_run(args: argparse.Namespace) -> None:
    """``airflow smart-triggerer run``: the same errors, exit codes and messages as ``smart-triggerer``."""
    _exit(guarded_command(run_command, args))


def provider_status(args: argparse.Namespace) -> None:
    _exit(guarded_command(status_command, args))


def guarded_command(command: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    from smart_triggerer.cli.errors import guarded

    return guarded("airflow smart-triggerer", getattr(args, "verbose", False), lambda: command(args))


def _exit(code: int) -> None:
    if code:
        sys.exit(code)


if __name__ == "__main__":
    sys.exit(main())
