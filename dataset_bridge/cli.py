"""The ``dataset-bridge`` command line: run the bridge process, show its status."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from dataset_bridge.service import BridgeSettings
from dataset_bridge.task_success import MappingError, TaskMapping
from smart_triggerer.cli.parser import Parser


def _positive(value: str) -> float:
    number = float(value)
    if number <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return number


MAX_BATCH = 1000  # the inbox's most events per request


def _whole(low: int, high: int) -> Callable[[str], int]:
    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number, got {value!r}") from None
        if not low <= number <= high:
            raise argparse.ArgumentTypeError(f"must be {low}-{high}, got {number}")
        return number

    return parse


def build_parser() -> Parser:
    parser = Parser(
        prog="dataset-bridge",
        description="Producer success -> exactly one asset event -> consumer DAG runs.",
        epilog="Configuration: the usual Airflow configuration (AIRFLOW_HOME, airflow.cfg, "
        "AIRFLOW__SECTION__KEY); the metadata database must be PostgreSQL.\nExit codes: 0 ok, 1 "
        "unexpected error (traceback), 2 invalid argument or file, 3 database unreachable, 4 "
        "metadata database not PostgreSQL, 6 missing database privilege, 9 Airflow's tables never "
        "migrated.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text in (
        ("run", "run the bridge: mapped task successes and the reconciler"),
        ("status", "events emitted, backlog, held-back events, watermarks"),
    ):
        sub = commands.add_parser(name, help=help_text)
        sub.add_argument("--mapping", help="YAML/JSON file: 'dag_id.task_id' -> [asset URI or name]")
        sub.add_argument(
            "--grace",
            type=_positive,
            default=15.0,
            help="seconds an unconsumed event waits before it is queued again (default 15)",
        )
        sub.add_argument(
            "--lookback",
            type=_positive,
            default=86400.0,
            help="oldest event age, in seconds, the reconciler looks at (default 86400)",
        )
    commands.choices["run"].add_argument(
        "--interval", type=_positive, default=2.0, help="seconds between passes (default 2)"
    )
    commands.choices["run"].add_argument(
        "--retention-days",
        type=_positive,
        default=30.0,
        help="days the ledgers (emitted events, reconciler decisions, watcher idempotency keys) are kept; "
        "task successes older than this are not bridged any more (default 30)",
    )
    relay = commands.add_parser("relay", help="relay the outbox to other deployments' inboxes")
    relay.add_argument("--routes", required=True, help="YAML/JSON routes file (source, targets)")
    relay.add_argument(
        "--concurrency", type=_whole(1, 64), default=4, help="targets delivered at once, 1-64 (default 4)"
    )
    relay.add_argument(
        "--batch",
        type=_whole(1, MAX_BATCH),
        default=MAX_BATCH,
        help="events per request, at most the inbox's 1000 (default 1000; a batch the inbox "
        "finds too large is split)",
    )
    relay.add_argument(
        "--backoff-cap",
        type=_positive,
        default=60.0,
        help="longest wait between retries, seconds (default 60)",
    )
    relay.add_argument(
        "--retention-days",
        type=_positive,
        default=30.0,
        help="days delivered outbox rows are kept (dead letters stay) (default 30)",
    )
    init = commands.add_parser(
        "init",
        help="create the bridge's tables and register the routes' targets "
        "(run once when you configure routing, before any event)",
    )
    init.add_argument("--routes", help="YAML/JSON routes file: its targets' events are relayed from now on")
    replay = commands.add_parser(
        "relay-replay",
        help="requeue a target's dead letters (once the cause is "
        "fixed: a secret, an allow-list, an asset in B)",
    )
    replay.add_argument(
        "--target",
        action="append",
        required=True,
        metavar="NAME",
        help="target whose dead letters go back into the queue (repeatable)",
    )
    relay_status = commands.add_parser("relay-status", help="per target: backlog, delivered, dead-lettered")
    relay_status.add_argument("--json", action="store_true", help="print one JSON object")
    status = commands.choices["status"]
    status.add_argument(
        "--watermarks",
        action="append",
        default=[],
        metavar="CONN_ID",
        help="also show status-table watermarks kept in this connection's database",
    )
    status.add_argument("--json", action="store_true", help="print one JSON object")
    from smart_triggerer.cli.errors import add_common_arguments

    for sub in commands.choices.values():
        add_common_arguments(sub)
    return parser


def _settings(args: argparse.Namespace) -> BridgeSettings:
    from dataset_bridge.retention import Retention

    return BridgeSettings(
        interval=getattr(args, "interval", 2.0),
        grace_seconds=args.grace,
        lookback_seconds=args.lookback,
        retention=Retention(days=getattr(args, "retention_days", 30.0)),
    )


async def _watermarks(conn_id: str) -> list[dict[str, Any]]:
    import asyncpg

    from triggers.pg import target_for

    conn = await asyncpg.connect(**(await target_for(conn_id)).connect_kwargs())
    try:
        if not await conn.fetchval("SELECT to_regclass('dataset_bridge.status_watermark') IS NOT NULL"):
            return []
        rows = await conn.fetch(
            "SELECT status_table, table_name, last_id, updated_at "
            "FROM dataset_bridge.status_watermark ORDER BY 1, 2"
        )
    finally:
        await conn.close()
    return [
        {
            "conn_id": conn_id,
            "status_table": r["status_table"],
            "table_name": r["table_name"],
            "last_id": r["last_id"],
            "updated_at": r["updated_at"].isoformat(),
        }
        for r in rows
    ]


def status_command(args: argparse.Namespace, mapping: TaskMapping | None) -> int:
    from dataset_bridge import service

    result = service.status(mapping, _settings(args))
    result["watermarks"] = [w for conn_id in args.watermarks for w in asyncio.run(_watermarks(conn_id))]
    if args.json:
        print(json.dumps(result))
        return 0
    render_status(result)
    return 0


def render_status(result: dict[str, Any]) -> None:
    console = Console()
    if not result.get("initialized"):
        console.print(
            "dataset bridge: not initialised in this database yet (run `dataset-bridge init` "
            "or `dataset-bridge run`)"
        )
    else:
        console.print(_summary_table(result))
    if result.get("emitted"):
        emitted = Table("source", "events emitted", title="emitted by source")
        for source, count in sorted(result["emitted"].items()):
            emitted.add_row(source, str(count))
        console.print(emitted)
    if result.get("horizons"):
        horizons = Table("mapped task", "successes bridged from", title="task-success horizons")
        for task, since in sorted(result["horizons"].items()):
            horizons.add_row(task, since)
        console.print(horizons)
    if result.get("recent_decisions"):
        decisions = Table("event", "dag_id", "outcome", "why", "at", title="reconciler: latest decisions")
        for d in result["recent_decisions"]:
            decisions.add_row(str(d["event_id"]), d["dag_id"], d["outcome"], d["reason"] or "", d["at"])
        console.print(decisions)
    if result.get("watermarks"):
        marks = Table("conn_id", "status_table", "table_name", "last_id", "updated_at", title="watermarks")
        for w in result["watermarks"]:
            marks.add_row(
                *(str(w[k]) for k in ("conn_id", "status_table", "table_name", "last_id", "updated_at"))
            )
        console.print(marks)


def _summary_table(result: dict[str, Any]) -> Table:
    table = Table("measure", "value", title="dataset bridge")
    reconciled = result.get("reconciled") or {}
    rows = (
        ("events emitted (task successes)", str(sum((result.get("emitted") or {}).values()))),
        (
            "successes waiting to be bridged",
            "-- (pass --mapping)" if result.get("backlog") is None else str(result["backlog"]),
        ),
        ("events held back (not yet consumed)", str(result.get("held_back", 0))),
        (
            "reconciler: re-queued / cleared / unconsumable",
            " / ".join(str(reconciled.get(k, 0)) for k in ("requeued", "cleared", "unconsumable")),
        ),
        (
            "status-table watcher events",
            "-- (no smart triggerer here)"
            if result.get("watcher_events") is None
            else str(result["watcher_events"]),
        ),
    )
    for measure, value in rows:
        table.add_row(measure, value)
    return table


def relay_command(args: argparse.Namespace) -> int:
    from dataset_bridge import relay
    from dataset_bridge.routes import Routes

    if args.command == "relay-replay":
        counts = asyncio.run(relay.replay(args.target))
        for target in args.target:
            print(f"dataset-bridge: {counts.get(target, 0)} dead letter(s) of {target} requeued")
        return 0
    if args.command == "relay-status":
        targets = asyncio.run(relay.relay_status())
        if args.json:
            print(json.dumps({"targets": targets}))
            return 0
        table = Table("target", "backlog", "delivered", "dead", "next attempt", "last error", title="relay")
        for t in targets:
            table.add_row(
                *(str(t[k]) for k in ("target", "backlog", "delivered", "dead", "next_attempt", "last_error"))
            )
        Console().print(table)
        return 0
    routes = Routes.load(args.routes)
    for target in routes.targets:
        target.secret()
    from dataset_bridge.retention import Retention

    settings = relay.RelaySettings(
        batch=args.batch,
        concurrency=args.concurrency,
        backoff_cap=args.backoff_cap,
        retention=Retention(days=args.retention_days),
    )
    return asyncio.run(_run_relay(routes, settings))


def init_command(args: argparse.Namespace) -> int:
    from dataset_bridge import relay, service
    from dataset_bridge.routes import Routes

    routes = Routes.load(args.routes) if args.routes else None
    service.prepare(None)
    if routes is not None:
        relay.prepare(routes)
    targets = ", ".join(t.name for t in routes.targets) if routes else "none"
    print(f"dataset-bridge: tables ready; targets registered: {targets}")
    return 0


async def _run_relay(routes: Any, settings: Any) -> int:
    import signal

    from dataset_bridge import relay

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    return await relay.run_relay(routes, settings, stop)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    from smart_triggerer.cli.errors import guarded

    return guarded("dataset-bridge", args.verbose, lambda: dispatch(args))


def dispatch(args: argparse.Namespace) -> int:
    from dataset_bridge.routes import RoutesError
    from smart_triggerer.db.preflight import require_migrated, require_postgres
    from smart_triggerer.errors import UserError

    try:
        require_postgres()
        require_migrated()
        if args.command in ("relay", "relay-status", "relay-replay"):
            return relay_command(args)
        if args.command == "init":
            return init_command(args)
        mapping = TaskMapping.load(args.mapping) if args.mapping else None
    except (MappingError, RoutesError) as err:
        raise UserError(str(err)) from err
    if args.command == "status":
        return status_command(args, mapping)
    from dataset_bridge import service

    return service.run(mapping, _settings(args))


if __name__ == "__main__":
    sys.exit(main())
