"""The ``smart-triggerer`` command line (also ``airflow smart-triggerer`` through the provider)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from triggerer import __version__


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
    parser.add_argument("--capacity", type=_positive_int, default=None,
                        help="declared capacity: the instance's weight in shard placement and the most "
                             "triggers it runs (default: [triggerer] capacity)")
    parser.add_argument("--health-port", type=_port, default=None,
                        help="serve GET /health and /metrics on 127.0.0.1:PORT; 0 picks a free port and "
                             "logs it (default: [smart_triggerer] health_port, unset = no endpoint)")
    parser.add_argument("--queues", default=None,
                        help="comma-separated trigger queues to serve (isolation from stock triggerers)")
    parser.add_argument("--skip-serve-logs", action="store_true",
                        help="do not start the trigger log server (as for `airflow triggerer`)")


def add_status_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="smart-triggerer",
        description=(
            "A deduplicating, sharded replacement for `airflow triggerer`. "
            "Uses the usual Airflow configuration (AIRFLOW_HOME, AIRFLOW__... environment)."
        ),
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_run_arguments(commands.add_parser("run", help="run one smart triggerer instance"))
    status = commands.add_parser("status", help="instances, shards, waiters, groups, dedup ratio")
    add_status_arguments(status)
    demo = commands.add_parser("demo", help="run the demo: a whole deployment on a private PostgreSQL, the "
                                            "example DAGs, a warehouse scenario and a summary")
    demo.add_argument("--quick", action="store_true", help="a smaller scenario (for CI)")
    demo.add_argument("--json", action="store_true",
                      help="progress on stderr; the summary as one JSON object, the last line of stdout")
    demo.add_argument("--keep-running", action="store_true",
                      help="leave the stack up after the summary and print the UI URL (Ctrl-C stops it)")
    return parser


def run_command(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from triggerer.config import Settings
    from triggerer.service import run

    settings = Settings.from_airflow()
    if args.health_port is not None:
        settings = replace(settings, health_port=args.health_port)
    queues = {q.strip() for q in args.queues.split(",") if q.strip()} if args.queues else None
    return run(args.capacity, queues, settings, args.skip_serve_logs)


def status_command(args: argparse.Namespace) -> int:
    from triggerer import status
    from triggerer.config import Settings

    result = status.collect(Settings.from_airflow())
    if args.json:
        print(json.dumps(result))
    else:
        status.render(result)
    return 0


def demo_command(args: argparse.Namespace) -> int:
    from triggerer.demo import run_demo

    return run_demo(quick=args.quick, as_json=args.json, keep_running=args.keep_running)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    from triggerer.config import ConfigError

    handlers = {"run": run_command, "status": status_command, "demo": demo_command}
    try:
        return handlers[args.command](args)
    except ConfigError as err:
        print(f"smart-triggerer: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
