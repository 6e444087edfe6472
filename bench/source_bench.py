"""One query per source: stock ``airflow triggerer`` vs smart, coalesced checks off and on, in one run.

    .venv/bin/python -m bench.source_bench --json

On a private PostgreSQL server with pg_stat_statements loaded: a source database with one ETL status table
(``meta.detail_process_table_status``) and, per mode, a fresh Airflow metadata database with ``--waiters``
deferred TableLoadTrigger waits over ``--tables`` distinct tables (waiter ``i`` on table ``t{i % tables}``),
``--interval`` pokes, ``--instances`` triggerers. Measured per mode, after start-up settled:

- ``source_queries_per_interval``: calls of the status query on the source (pg_stat_statements), and
  ``source_db_ms_per_interval``, its execution time there;
- ``runner_cpu_s_per_interval``: CPU of the processes below each triggerer (its trigger runner), and the
  ratio to stock's (``runner_cpu_ratio``);
- the burst: ``--burst`` SUCCESS rows land at once; ``resume_p99_s`` from the insert to each of their
  waiters leaving DEFERRED (its ``scheduled_dttm``, both by the database clock); ``lost``: waiters of
  those tables still deferred at the end.

Then, smart only: the supervisors' metadata-database reads while nothing changes at each of
``--scan-waiters``: rows scanned per 30 s from pg_stat_user_tables (sequential rows read and index
fetches, per table) and blocks touched from pg_stat_statements.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.triggerer_bench import (  # noqa: E402
    TreeSampler,
    append_result,
    start_instance,
    wait_until,
)
from devkit.devstack import AirflowConfig, AirflowStack, migrate  # noqa: E402
from devkit.pgserver import EmbeddedPostgres  # noqa: E402
from tests.helpers.databases import create_database, drop_database, unique_name  # noqa: E402
from tests.helpers.seeding import seed_deferred  # noqa: E402
from tests.helpers.waiting import rows  # noqa: E402

console = Console(stderr=True)
TABLE_LOAD = "triggers.table_load.TableLoadTrigger"
MODES = ("stock", "smart-batching-off", "smart")
STATUS_DDL = """
CREATE EXTENSION IF NOT EXISTS pg_stat_statements;
CREATE SCHEMA IF NOT EXISTS meta;
CREATE TABLE IF NOT EXISTS meta.detail_process_table_status (
    id bigserial PRIMARY KEY, table_name text, status text, created_dttm timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS status_table_at ON meta.detail_process_table_status (table_name, created_dttm);
"""
STATUS_QUERY = "%DISTINCT ON%detail_process_table_status%"


@dataclass
class ModeResult:
    mode: str
    source_queries_per_interval: float = 0.0
    source_db_ms_per_interval: float = 0.0
    runner_cpu_s_per_interval: float = 0.0
    supervisor_cpu_s_per_interval: float = 0.0
    resume_p50_s: float = 0.0
    resume_p99_s: float = 0.0
    resumed: int = 0
    lost: int = 0


@dataclass
class Scans:
    waiters: int
    rows_scanned_per_30s: int = 0
    by_table: dict[str, int] = field(default_factory=dict)
    blocks_per_30s: int = 0
    statements_per_30s: int = 0
    top_statements: list[tuple[int, int, str]] = field(default_factory=list)  # blocks, calls, query
    # the sweep (every sweep_seconds, 600 by default): rows one sweep of every instance reads, and the
    # rows per 30 s with it spread over its interval
    rows_per_sweep: int = 0
    rows_scanned_per_30s_with_sweep: int = 0


@contextlib.contextmanager
def stats_server(root: Path) -> Iterator[EmbeddedPostgres]:
    """A private server with pg_stat_statements (the source's and the metadata databases' counts)."""
    server = EmbeddedPostgres(
        root / "pgdata",
        settings={"shared_preload_libraries": "pg_stat_statements", "pg_stat_statements.track": "all"},
    )
    server.start(timeout=60)
    try:
        yield server
    finally:
        server.stop()


def on(server: EmbeddedPostgres, dbname: str) -> str:
    return server.dsn.rsplit("/", 1)[0] + f"/{dbname}"


def sql(dsn: str, statement: str, *args: Any) -> list[Any]:
    async def run() -> list[Any]:
        conn = await asyncpg.connect(dsn)
        try:
            if args:
                return list(await conn.fetch(statement, *args))
            await conn.execute(statement)
            return []
        finally:
            await conn.close()

    return asyncio.run(run())


def status_statements(source: str) -> tuple[int, float]:
    """Calls of the status query on the source so far, and their total execution time (ms)."""
    found = sql(
        source,
        "SELECT coalesce(sum(s.calls), 0), coalesce(sum(s.total_exec_time), 0) "
        "FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid "
        "WHERE d.datname = current_database() AND s.query LIKE $1",
        STATUS_QUERY,
    )
    return int(found[0][0]), float(found[0][1])


def table_reads(dsn: str) -> dict[str, int]:
    """Rows each table of this database gave so far: sequential reads plus index fetches."""
    found = rows(
        dsn,
        "SELECT schemaname || '.' || relname, coalesce(seq_tup_read, 0) + "
        "coalesce(idx_tup_fetch, 0) FROM pg_stat_user_tables",
    )
    return {name: int(count) for name, count in found}


def statement_counts(dsn: str) -> dict[str, tuple[int, int]]:
    """Blocks touched and calls so far per statement text on this database."""
    found = rows(
        dsn,
        "SELECT s.query, sum(s.shared_blks_hit + s.shared_blks_read), sum(s.calls) "
        "FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid "
        "WHERE d.datname = current_database() GROUP BY s.query",
    )
    return {query: (int(blocks), int(calls)) for query, blocks, calls in found}


def summed(counts: dict[str, tuple[int, int]]) -> tuple[int, int]:
    """Blocks and calls of every statement in one reading of ``statement_counts``."""
    return sum(b for b, _c in counts.values()), sum(c for _b, c in counts.values())


def top_statements(
    after: dict[str, tuple[int, int]], before: dict[str, tuple[int, int]], top: int = 8
) -> list[tuple[int, int, str]]:
    """The statements that touched the most blocks between two readings: (blocks, calls, first words)."""
    grown = []
    for query, (blocks, calls) in after.items():
        old_blocks, old_calls = before.get(query, (0, 0))
        if blocks > old_blocks:
            grown.append((blocks - old_blocks, calls - old_calls, " ".join(query.split())[:120]))
    return sorted(grown, reverse=True)[:top]


def flush_stats(dsn: str) -> None:
    """Table statistics reach pg_stat_user_tables when a backend flushes them (at most every second, at
    the latest 10 s after it went idle): wait that long before reading them."""
    time.sleep(11)
    rows(dsn, "SELECT pg_stat_clear_snapshot()")


@dataclass(frozen=True)
class Place:
    """Where a run happens: the server, the migrated template, a home folder."""

    server: EmbeddedPostgres
    template: str
    home: Path


class Deployment:
    """One mode's metadata database, seeded waits and triggerers."""

    def __init__(self, place: Place, mode: str, args: argparse.Namespace) -> None:
        self.server, self.mode, self.args = place.server, mode, args
        home = place.home
        self.name = unique_name(f"st_source_{mode.replace('-', '_')}")
        self.dsn = create_database(place.server.dsn, self.name, place.template)
        # a source of its own: an earlier mode's burst must not have loaded this one's tables
        self.source = create_database(place.server.dsn, f"{self.name}_source")
        sql(self.source, STATUS_DDL)
        extra = {
            "AIRFLOW_CONN_WAREHOUSE": self.source,
            "AIRFLOW__SMART_TRIGGERER__RESUME_HOLD_SECONDS": "0",
            "AIRFLOW__TRIGGERER__JOB_HEARTBEAT_SEC": "5",
            "AIRFLOW__SMART_TRIGGERER__COALESCE_CHECKS": str(
                not mode.endswith("batching-off") and mode != "stock"
            ),
        }
        self.config = AirflowConfig(
            home=home / mode / "airflow",
            database_dsn=self.dsn,
            dags_folder=home / mode / "dags",
            fernet_key=os.environ["AIRFLOW__CORE__FERNET_KEY"],
            extra=extra,
        )
        self.config.home.mkdir(parents=True, exist_ok=True)
        self.stack = AirflowStack(self.config)

    def seed(self, waiters: int, tables: int) -> None:
        console.print(f"[bold]{self.mode}[/]: seeding {waiters} waits on {tables} tables")
        interval = self.args.interval
        seed_deferred(
            self.dsn,
            self.config.dags_folder,
            count=waiters,
            classpath=TABLE_LOAD,
            kwargs_for=lambda i: {
                "conn_id": "warehouse",
                "required_tables": [f"t{i % tables}"],
                "poll_interval": interval,
            },
            dag_id=f"bench_source_{waiters}",
        )

    def start(self) -> list[Any]:
        kind = "stock" if self.mode == "stock" else "smart"
        instances = [
            start_instance(self.stack, kind, f"{self.mode}-{n}", self.args.waiters)
            for n in range(self.args.instances)
        ]
        jobs = [job for _component, job in instances]
        wait_until(lambda: self.assigned(jobs) >= self.waiting(), 600, "every wait assigned", interval=1)
        return [component for component, _job in instances]

    def waiting(self) -> int:
        return int(rows(self.dsn, "SELECT count(*) FROM task_instance WHERE state = 'deferred'")[0][0])

    def assigned(self, jobs: list[int]) -> int:
        return int(rows(self.dsn, "SELECT count(*) FROM trigger WHERE triggerer_id = ANY(%s)", jobs)[0][0])

    def restart(self, settings: dict[str, str]) -> None:
        """Every instance stopped, then started again with these settings on top (the same waits)."""
        self.stack.stop()
        self.config.extra.update(settings)
        self.stack = AirflowStack(self.config)
        self.start()

    def stop(self) -> None:
        self.stack.stop()
        with contextlib.suppress(Exception):
            drop_database(self.server.dsn, self.name)
            drop_database(self.server.dsn, f"{self.name}_source")


def measure_mode(place: Place, mode: str, args: argparse.Namespace) -> ModeResult:
    result = ModeResult(mode)
    deployment = Deployment(place, mode, args)
    source = deployment.source
    try:
        deployment.seed(args.waiters, args.tables)
        components = deployment.start()
        with TreeSampler(components) as sampler:
            console.print(
                f"  every wait assigned; {2 * args.interval:g}s to settle, then "
                f"{args.windows} intervals of pure waiting"
            )
            time.sleep(2 * args.interval)
            calls, ms = status_statements(source)
            supervisors, runners = sampler.split()
            time.sleep(args.windows * args.interval)
            calls_after, ms_after = status_statements(source)
            supervisors_after, runners_after = sampler.split()
        result.source_queries_per_interval = (calls_after - calls) / args.windows
        result.source_db_ms_per_interval = (ms_after - ms) / args.windows
        result.runner_cpu_s_per_interval = (runners_after - runners) / args.windows
        result.supervisor_cpu_s_per_interval = (supervisors_after - supervisors) / args.windows
        burst(deployment, result, args)
        console.print(
            f"  {mode}: {result.source_queries_per_interval:.1f} source queries per interval, "
            f"runner CPU {result.runner_cpu_s_per_interval:.2f} s per interval, resume p99 "
            f"{result.resume_p99_s:.1f} s, lost {result.lost}"
        )
    finally:
        deployment.stop()
    return result


def burst(deployment: Deployment, result: ModeResult, args: argparse.Namespace) -> None:
    """``--burst`` tables land at once; their waiters' resume latencies by the database clock."""
    landed = [f"t{n}" for n in range(args.burst)]
    expected = sum(1 for i in range(args.waiters) if i % args.tables < args.burst)
    at = sql(
        deployment.source,
        "INSERT INTO meta.detail_process_table_status (table_name, status) "
        "SELECT unnest($1::text[]), 'SUCCESS' RETURNING created_dttm",
        landed,
    )[0][0]
    landed_at = at.timestamp()
    query = (
        "SELECT extract(epoch FROM scheduled_dttm) FROM task_instance "
        "WHERE state <> 'deferred' AND scheduled_dttm IS NOT NULL"
    )
    deadline = time.monotonic() + 3 * args.interval + 120
    while time.monotonic() < deadline:
        if len(rows(deployment.dsn, query)) >= expected:
            break
        time.sleep(0.5)
    latencies = sorted(float(r[0]) - landed_at for r in rows(deployment.dsn, query))
    result.resumed = len(latencies)
    result.lost = expected - len(latencies)
    if latencies:
        result.resume_p50_s = latencies[len(latencies) // 2]
        result.resume_p99_s = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]


def measure_scans(place: Place, waiters: int, args: argparse.Namespace) -> Scans:
    """The supervisors' metadata reads over 30 s while nothing changes, at ``waiters`` waits; then, the
    instances started again with a short ``sweep_seconds``, what one sweep reads."""
    scans = Scans(waiters)
    local = argparse.Namespace(**{**vars(args), "waiters": waiters})
    deployment = Deployment(place, f"smart-scans-{waiters}", local)
    try:
        deployment.seed(waiters, max(1, waiters // 2))
        deployment.start()
        console.print(f"  {waiters} waits assigned; settling, then 30 s of pure waiting")
        time.sleep(2 * args.interval)
        window = read_window(deployment.dsn, 30.0)
        scans.by_table, scans.rows_scanned_per_30s = window.by_table, window.rows
        scans.blocks_per_30s, scans.statements_per_30s = window.blocks, window.calls
        scans.top_statements = window.top
        console.print(
            f"  {waiters} waiters: {scans.rows_scanned_per_30s} rows scanned per 30 s "
            f"({scans.statements_per_30s} statements, {scans.blocks_per_30s} blocks)"
        )
        measure_sweep(deployment, scans, args)
    finally:
        deployment.stop()
    return scans


@dataclass
class Window:
    rows: int
    by_table: dict[str, int]
    blocks: int
    calls: int
    top: list[tuple[int, int, str]]
    sweeps: int  # calls of the sweep's own statement (one per instance and sweep)


# the lingering check's statement (queries.sql, not_waited_on), run once a sweep by every instance, as
# pg_stat_statements shows it (constants replaced by $n, whitespace as written: compared collapsed)
SWEEP_START = (
    "SELECT i.trigger_id FROM smart_triggerer.trigger_identity i JOIN trigger t ON t.id = "
    "i.trigger_id WHERE i.shard = ANY("
)
SWEEP_TEST_SECONDS = 20  # sweep_seconds while a sweep is measured


def is_sweep(query: str) -> bool:
    return " ".join(query.split()).startswith(SWEEP_START)


def read_window(dsn: str, seconds: float) -> Window:
    """The metadata reads of ``seconds`` of waiting (pg_stat_user_tables and pg_stat_statements)."""
    flush_stats(dsn)
    before, top_before = table_reads(dsn), statement_counts(dsn)
    time.sleep(seconds)
    flush_stats(dsn)
    after, top_after = table_reads(dsn), statement_counts(dsn)
    by_table = {
        name: after[name] - before.get(name, 0) for name in after if after[name] - before.get(name, 0) > 0
    }
    (blocks, calls), (blocks_after, calls_after) = summed(top_before), summed(top_after)
    sweeps = sum(c for q, (_b, c) in top_after.items() if is_sweep(q)) - sum(
        c for q, (_b, c) in top_before.items() if is_sweep(q)
    )
    return Window(
        sum(by_table.values()),
        by_table,
        blocks_after - blocks,
        calls_after - calls,
        top_statements(top_after, top_before),
        sweeps,
    )


def measure_sweep(deployment: Deployment, scans: Scans, args: argparse.Namespace) -> None:
    """The same waits under instances that sweep every SWEEP_TEST_SECONDS: a window's rows less the
    quiet rate, per sweep seen in it, is what one sweep reads; spread over the default interval, what
    it adds per 30 s."""
    from smart_triggerer.config import Settings

    deployment.restart({"AIRFLOW__SMART_TRIGGERER__SWEEP_SECONDS": str(SWEEP_TEST_SECONDS)})
    time.sleep(2 * args.interval)
    window = read_window(deployment.dsn, 60.0)
    if window.sweeps == 0:
        console.print("  no sweep seen in the window: sweep figures left out")
        return
    instances = max(args.instances, 1)
    extra = max(window.rows - 2 * scans.rows_scanned_per_30s, 0)
    scans.rows_per_sweep = round(extra / window.sweeps * instances)  # every instance sweeps once
    scans.rows_scanned_per_30s_with_sweep = round(
        scans.rows_scanned_per_30s + scans.rows_per_sweep * 30.0 / Settings.sweep_seconds
    )
    console.print(
        f"  {scans.waiters} waiters: one sweep of every instance reads {scans.rows_per_sweep} "
        f"rows; with a sweep every {Settings.sweep_seconds:.0f} s, "
        f"{scans.rows_scanned_per_30s_with_sweep} rows per 30 s"
    )


@contextlib.contextmanager
def stdout_on_stderr(active: bool) -> Iterator[None]:
    """With --json, stdout carries the JSON line alone: whatever else writes to it meanwhile (Airflow's
    logging while seeding) goes to stderr, down to the file descriptor."""
    if not active:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def report(results: list[ModeResult], scans: list[Scans], args: argparse.Namespace) -> dict[str, Any]:
    by_mode = {r.mode: r for r in results}
    stock = by_mode.get("stock")
    figures: dict[str, Any] = {
        "waiters": args.waiters,
        "tables": args.tables,
        "instances": args.instances,
        "interval_s": args.interval,
        "burst": args.burst,
        "source_queries_per_interval": {r.mode: round(r.source_queries_per_interval, 1) for r in results},
        "source_db_ms_per_interval": {r.mode: round(r.source_db_ms_per_interval, 1) for r in results},
        "runner_cpu_s_per_interval": {r.mode: round(r.runner_cpu_s_per_interval, 2) for r in results},
        "resume_p99_s": {r.mode: round(r.resume_p99_s, 2) for r in results},
        "lost": {r.mode: r.lost for r in results},
        "supervisor_rows_scanned_per_30s": {s.waiters: s.rows_scanned_per_30s for s in scans},
        "supervisor_blocks_per_30s": {s.waiters: s.blocks_per_30s for s in scans},
        "supervisor_rows_scanned_by_table": {s.waiters: s.by_table for s in scans},
        "supervisor_top_statements_by_blocks": {s.waiters: s.top_statements for s in scans},
        "supervisor_rows_per_sweep": {s.waiters: s.rows_per_sweep for s in scans},
        "supervisor_rows_scanned_per_30s_with_sweep": {
            s.waiters: s.rows_scanned_per_30s_with_sweep for s in scans
        },
    }
    if stock and stock.runner_cpu_s_per_interval > 0:
        figures["runner_cpu_ratio"] = {
            r.mode: round(r.runner_cpu_s_per_interval / stock.runner_cpu_s_per_interval, 3) for r in results
        }
    return figures


def table(figures: dict[str, Any]) -> Table:
    out = Table(
        title=f"{figures['waiters']} waits on {figures['tables']} tables, {figures['instances']} "
        f"instances, {figures['interval_s']:g} s pokes"
    )
    modes = list(figures["source_queries_per_interval"])
    out.add_column("")
    for mode in modes:
        out.add_column(mode, justify="right")
    for key in (
        "source_queries_per_interval",
        "source_db_ms_per_interval",
        "runner_cpu_s_per_interval",
        "runner_cpu_ratio",
        "resume_p99_s",
        "lost",
    ):
        values = figures.get(key, {})
        out.add_row(key, *(str(values.get(mode, "-")) for mode in modes))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--waiters", type=int, default=20000)
    parser.add_argument("--tables", type=int, default=10000)
    parser.add_argument("--instances", type=int, default=2)
    parser.add_argument("--interval", type=float, default=30.0)
    parser.add_argument("--windows", type=int, default=2, help="intervals of pure waiting measured")
    parser.add_argument("--burst", type=int, default=2000)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--scan-waiters", default="5000,50000", help="'' to skip the scan measurement")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--write", action="store_true", help="append the result to bench/RESULTS.md")
    args = parser.parse_args()
    if not os.environ.get("AIRFLOW__CORE__FERNET_KEY"):
        from cryptography.fernet import Fernet

        os.environ["AIRFLOW__CORE__FERNET_KEY"] = Fernet.generate_key().decode()
    home = Path(tempfile.mkdtemp(prefix="smart-triggerer-source-bench-"))
    try:
        with stdout_on_stderr(args.json), stats_server(home) as server:
            template = unique_name("st_source_template")
            dsn = create_database(server.dsn, template)
            sql(dsn, "CREATE EXTENSION pg_stat_statements")  # its view, in every clone
            console.print("migrating a template metadata database")
            migrate(
                AirflowConfig(
                    home=home / "template",
                    database_dsn=dsn,
                    dags_folder=home / "dags",
                    fernet_key=os.environ["AIRFLOW__CORE__FERNET_KEY"],
                )
            )
            place = Place(server, template, home)
            results = [measure_mode(place, mode, args) for mode in args.modes.split(",") if mode]
            scans = [measure_scans(place, int(n), args) for n in args.scan_waiters.split(",") if n]
    finally:
        shutil.rmtree(home, ignore_errors=True)
    figures = report(results, scans, args)
    console.print(table(figures))
    if args.write:
        body = "```json\n" + json.dumps(figures, indent=1) + "\n```"
        append_result("One query per source", "bench.source_bench", body)
    if args.json:
        print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
