"""The demo (``python3 dev.py demo``, or ``python -m devkit.demo`` in the clone's virtualenv): a whole Airflow
deployment on a private PostgreSQL, the example DAGs, a warehouse scenario, live progress and a summary.

Many sensor tasks in many DAGs wait on a few distinct load-status conditions while a simulated ETL writes
status rows; two smart triggerers run one poll per distinct wait; an asset-scheduled consumer runs once its
tables are loaded. Every process runs in its own process group and is stopped at the end, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import random
import secrets
import shlex
import signal
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psycopg2
from rich.console import Console
from rich.live import Live
from rich.table import Table

from devkit.devstack import AirflowConfig, AirflowStack, StackError, migrate
from devkit.pgserver import PgServerError, create_database, drop_database, postgres_dsn, reader_dsn

EXAMPLE_DAGS = Path(__file__).resolve().parents[1] / "example_dags"
STATUS_DDL = """
CREATE SCHEMA IF NOT EXISTS meta;
CREATE TABLE IF NOT EXISTS meta.detail_process_table_status (
    id bigserial PRIMARY KEY, table_name text, status text, created_dttm timestamptz NOT NULL DEFAULT now()
)
"""
POLLS_SQL = """
SELECT coalesce(seq_scan, 0) + coalesce(idx_scan, 0) FROM pg_stat_user_tables
WHERE schemaname = 'meta' AND relname = 'detail_process_table_status'
"""
EXTRA_DAGS = [
    "finance_users_report",
    "marketing_users_report",
    "operations_users_report",
    "etl_daily",
    "reporting",
    "wait_for_service",
    "user_mart",
]
SIDE_TABLES = ["dds.h_user", "dds.s_user"]


class DemoError(RuntimeError):
    """The demo could not run (the message says which step)."""


@dataclass(frozen=True)
class Scenario:
    dags: int
    tasks_per_dag: int
    conditions: int
    etl_seconds: float
    poll_seconds: float

    @property
    def tasks(self) -> int:
        return self.dags * self.tasks_per_dag

    def dag_ids(self) -> list[str]:
        return [f"model_{i:02d}" for i in range(self.dags)]

    def tables(self) -> list[str]:
        return [f"dds.table_{i:02d}" for i in range(self.conditions)]

    def required(self, condition: int) -> list[str]:
        # the same rule as example_dags/warehouse_models.py
        return [
            f"dds.table_{condition % self.conditions:02d}",
            f"dds.table_{(condition + 7) % self.conditions:02d}",
        ]

    def env(self) -> dict[str, str]:
        return {
            "SMART_DEMO_DAGS": str(self.dags),
            "SMART_DEMO_TASKS": str(self.tasks_per_dag),
            "SMART_DEMO_CONDITIONS": str(self.conditions),
            "SMART_DEMO_POLL_SECONDS": str(self.poll_seconds),
        }


FULL = Scenario(dags=20, tasks_per_dag=10, conditions=30, etl_seconds=30, poll_seconds=3)
QUICK = Scenario(dags=5, tasks_per_dag=8, conditions=10, etl_seconds=10, poll_seconds=2)


# fewer than production's 64 so that two instances visibly split them; fixed once the database exists
DEMO_SHARDS = 16


@dataclass
class Progress:
    phase: str = "starting"
    waiting: int = 0
    resumed: int = 0
    groups: int = 0
    shards: dict[str, int] = field(default_factory=dict)
    polls: int = 0
    loaded_tables: int = 0


@dataclass
class Summary:
    tasks: int
    resumed: int
    unique_waits: int
    dedup_ratio: float
    polls: int
    baseline_polls: int
    resume_p50_s: float
    resume_p99_s: float
    consumer_runs: int
    failures: int
    elapsed_s: float


def _query(dsn: str, statement: str, *params: object) -> list[tuple[Any, ...]]:
    conn = psycopg2.connect(dsn)
    try:
        with conn, conn.cursor() as cur:
            cur.execute(statement, params or None)
            return cur.fetchall() if cur.description else []
    finally:
        conn.close()


@contextlib.contextmanager
def _databases(server: str) -> Iterator[tuple[str, str]]:
    """Two fresh databases (Airflow's and the warehouse's), dropped afterwards."""
    suffix = secrets.token_hex(3)
    names = [f"smart_demo_airflow_{suffix}", f"smart_demo_warehouse_{suffix}"]
    dsns = [create_database(server, name) for name in names]
    try:
        yield dsns[0], dsns[1]
    finally:
        for name in names:
            with contextlib.suppress(psycopg2.Error):
                drop_database(server, name)


class Demo:
    def __init__(self, scenario: Scenario, console: Console, home: Path) -> None:
        self.scenario, self.console, self.home = scenario, console, home
        self.progress = Progress()
        self.loaded_at: dict[str, float] = {}
        self.polls_before = 0
        self.unique_waits = 0
        self.started = time.time()
        self.run_started = time.time()

    # --- set-up ---

    def config(self, airflow_dsn: str, warehouse_dsn: str) -> AirflowConfig:
        home = self.home / "airflow"
        home.mkdir(parents=True, exist_ok=True)
        config = AirflowConfig(home=home, database_dsn=airflow_dsn, dags_folder=EXAMPLE_DAGS, parallelism=4)
        config.extra.update(self.scenario.env())
        config.extra.update(
            {
                "AIRFLOW_CONN_WAREHOUSE": warehouse_dsn,
                "AIRFLOW_CONN_SERVICE_API": config.api_url,
                "AIRFLOW__SMART_TRIGGERER__SHARDS": str(DEMO_SHARDS),
                "AIRFLOW__SCHEDULER__MIN_FILE_PROCESS_INTERVAL": "3600",
            }
        )
        return config

    def start(self, stack: AirflowStack, warehouse_dsn: str) -> None:
        _query(warehouse_dsn, STATUS_DDL)
        self.polls_before = self._polls(warehouse_dsn)
        self._phase("starting api-server, dag-processor, scheduler")
        stack.start_core()
        self._phase("starting two smart triggerers and the dataset bridge")
        for name in ("smart-triggerer-1", "smart-triggerer-2"):
            stack.start_smart_triggerer(name)
        stack.start_bridge(args=["--interval", "2", "--grace", "10"])
        self._phase("waiting for the example DAGs to be parsed")
        dag_ids = self.scenario.dag_ids() + EXTRA_DAGS
        stack.wait_for_dags(dag_ids, timeout=300)
        for dag_id in dag_ids:
            stack.unpause(dag_id)

    def trigger_all(self, stack: AirflowStack) -> None:
        self._phase(f"triggering {self.scenario.dags} model DAGs and the other examples")
        for dag_id in self.scenario.dag_ids():
            stack.trigger(dag_id)
        for dag_id in (
            "finance_users_report",
            "marketing_users_report",
            "operations_users_report",
            "wait_for_service",
        ):
            stack.trigger(dag_id)
        same_day = dt.datetime.now(dt.UTC).replace(microsecond=0)
        stack.trigger("reporting", logical_date=same_day)  # waits for etl_daily of the same date
        stack.trigger("etl_daily", logical_date=same_day)

    # --- observing ---

    def _phase(self, text: str) -> None:
        self.progress.phase = text

    def _polls(self, warehouse_dsn: str) -> int:
        found = _query(warehouse_dsn, POLLS_SQL)
        return int(found[0][0]) if found else 0

    def observe(self, airflow_dsn: str, warehouse_dsn: str) -> None:
        states = dict(
            _query(
                airflow_dsn,
                "SELECT state, count(*) FROM task_instance WHERE dag_id LIKE 'model_%%' GROUP BY state",
            )
        )
        self.progress.waiting = int(states.get("deferred", 0))
        self.progress.resumed = int(states.get("success", 0))
        with contextlib.suppress(psycopg2.Error):
            self.progress.groups = int(
                _query(
                    airflow_dsn,
                    "SELECT coalesce(sum(groups), 0) FROM smart_triggerer.instance WHERE stopped_at IS NULL",
                )[0][0]
            )
            self.progress.shards = {
                f"instance {job}": int(n)
                for job, n in _query(
                    airflow_dsn,
                    "SELECT owner_job_id, count(*) FROM smart_triggerer.shard_lease "
                    "WHERE owner_job_id IS NOT NULL GROUP BY 1 ORDER BY 1",
                )
            }
        self.progress.polls = self._polls(warehouse_dsn) - self.polls_before
        self.progress.loaded_tables = len(self.loaded_at)

    def render(self) -> Table:
        p = self.progress
        table = Table(title=f"airflow-smart-triggerer demo: {p.phase}", show_header=False, min_width=60)
        table.add_row("sensor tasks (model DAGs)", str(self.scenario.tasks))
        table.add_row("waiting (deferred)", str(p.waiting))
        table.add_row("resumed", str(p.resumed))
        # the other example DAGs wait too: their groups count here, not in the summary's unique waits
        table.add_row("identity groups, all DAGs (one coroutine each)", str(p.groups))
        table.add_row(
            f"shards per instance (of {DEMO_SHARDS})",
            ", ".join(f"{k}: {v}" for k, v in p.shards.items()) or "-",
        )
        table.add_row("status-table polls", str(p.polls))
        table.add_row("tables loaded by the ETL", f"{p.loaded_tables}/{len(self.scenario.tables()) + 2}")
        table.add_row("elapsed", f"{time.time() - self.started:.0f}s")
        return table

    # --- the scenario ---

    def wait_until(
        self,
        live: Live,
        dsns: tuple[str, str],
        *,
        done: Any,
        timeout: float,
        what: str,
        tick: Any = None,
    ) -> None:
        airflow_dsn, warehouse_dsn = dsns
        deadline = time.monotonic() + timeout
        while True:
            if tick is not None:
                tick()
            self.observe(airflow_dsn, warehouse_dsn)
            live.update(self.render())
            if done():
                return
            if time.monotonic() > deadline:
                raise DemoError(f"timed out after {timeout:.0f}s waiting for {what}")
            time.sleep(0.5)

    def etl_plan(self) -> list[tuple[float, str, str]]:
        """(seconds from start, table, status): START then SUCCESS for every table, seeded order."""
        tables = self.scenario.tables() + SIDE_TABLES
        random.Random(42).shuffle(tables)  # noqa: S311 (a reproducible scenario, not security)
        step = self.scenario.etl_seconds / len(tables)
        plan = []
        for index, table in enumerate(tables):
            plan.append((index * step, table, "START"))
            plan.append((index * step + step * 0.8, table, "SUCCESS"))
        return sorted(plan)

    def etl_tick(self, warehouse_dsn: str, plan: list[tuple[float, str, str]], started: float) -> None:
        now = time.monotonic() - started
        while plan and plan[0][0] <= now:
            _at, table, status = plan.pop(0)
            _query(
                warehouse_dsn,
                "INSERT INTO meta.detail_process_table_status (table_name, status) VALUES (%s, %s)",
                table,
                status,
            )
            if status == "SUCCESS":
                self.loaded_at[table] = time.time()

    def watchers_ready(self, warehouse_dsn: str) -> bool:
        """The consumer's asset watchers keep a watermark per table from the moment they start."""
        try:
            found = _query(
                warehouse_dsn,
                "SELECT count(*) FROM dataset_bridge.status_watermark WHERE table_name = ANY(%s)",
                SIDE_TABLES,
            )
        except psycopg2.Error:
            return False
        return int(found[0][0]) == len(SIDE_TABLES)

    def count_unique_waits(self, airflow_dsn: str) -> bool:
        """Distinct waits among the sensor tasks, once a smart triggerer has placed every one of them."""
        try:
            hashed, unique = _query(
                airflow_dsn,
                "SELECT count(*), count(DISTINCT i.identity_hash) FROM smart_triggerer.trigger_identity i "
                "JOIN task_instance t ON t.trigger_id = i.trigger_id WHERE t.dag_id LIKE 'model_%%'",
            )[0]
        except psycopg2.Error:
            return False  # the triggerers have not created their schema yet
        self.unique_waits = int(unique)
        return int(hashed) == self.scenario.tasks

    def run(self, live: Live, stack: AirflowStack, airflow_dsn: str, warehouse_dsn: str) -> Summary:
        tasks, dsns = self.scenario.tasks, (airflow_dsn, warehouse_dsn)
        self.trigger_all(stack)
        self._phase(f"scheduling {tasks} sensor tasks straight into the triggerers")
        self.wait_until(
            live,
            dsns,
            timeout=300,
            what="every sensor task to defer into a smart triggerer",
            done=lambda: (
                self.progress.waiting == tasks
                and self.count_unique_waits(airflow_dsn)
                and self.watchers_ready(warehouse_dsn)
            ),
        )
        tables = len(self.scenario.tables()) + len(SIDE_TABLES)
        self._phase(f"the ETL loads {tables} tables over {self.scenario.etl_seconds:.0f}s")
        plan, etl_started = self.etl_plan(), time.monotonic()
        self.wait_until(
            live,
            dsns,
            done=lambda: not plan and self.progress.resumed + self._failed_models(airflow_dsn) == tasks,
            timeout=self.scenario.etl_seconds + 300,
            what="every sensor task to resume",
            tick=lambda: self.etl_tick(warehouse_dsn, plan, etl_started),
        )
        self._phase("waiting for the consumer and the other example DAGs to finish")
        self.wait_until(
            live,
            dsns,
            done=lambda: self._others_done(airflow_dsn),
            timeout=300,
            what="the example DAG runs to finish",
        )
        self._phase("collecting the numbers")
        self._settle_polls(warehouse_dsn)
        return self.summary(airflow_dsn, warehouse_dsn)

    def _failed_models(self, airflow_dsn: str) -> int:
        return int(
            _query(
                airflow_dsn,
                "SELECT count(*) FROM task_instance WHERE dag_id LIKE 'model_%%' "
                "AND state IN ('failed', 'upstream_failed', 'skipped')",
            )[0][0]
        )

    def _others_done(self, airflow_dsn: str) -> bool:
        """Every other example DAG has a finished run (the consumer's appears once its tables load)."""
        runs = dict(
            _query(
                airflow_dsn,
                "SELECT dag_id, bool_and(state IN ('success', 'failed')) FROM dag_run "
                "WHERE dag_id = ANY(%s) GROUP BY dag_id",
                EXTRA_DAGS,
            )
        )
        return set(runs) == set(EXTRA_DAGS) and all(runs.values())

    def _settle_polls(self, warehouse_dsn: str) -> None:
        """Backends report table statistics when idle for a while; wait until the count stops moving."""
        last, stable_since = self._polls(warehouse_dsn), time.monotonic()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and time.monotonic() - stable_since < 11:
            time.sleep(1)
            now = self._polls(warehouse_dsn)
            if now != last:
                last, stable_since = now, time.monotonic()

    def summary(self, airflow_dsn: str, warehouse_dsn: str) -> Summary:
        ended = _query(
            airflow_dsn,
            "SELECT dag_id, task_id, state, end_date, queued_dttm FROM task_instance "
            "WHERE dag_id LIKE 'model_%%'",
        )
        latencies, baseline = [], 0
        for dag_id, task_id, state, end_date, _queued in ended:
            condition = (
                int(dag_id[6:]) * self.scenario.tasks_per_dag + int(task_id[-2:])
            ) % self.scenario.conditions
            met = max(self.loaded_at.get(t, float("inf")) for t in self.scenario.required(condition))
            if state == "success" and end_date is not None and met != float("inf"):
                latencies.append(max(0.0, end_date.timestamp() - met))
                waited = end_date.timestamp() - self.run_started
                baseline += 1 + int(waited // self.scenario.poll_seconds)
        failures = int(
            _query(
                airflow_dsn,
                "SELECT count(*) FROM task_instance t JOIN dag_run r "
                "ON r.dag_id = t.dag_id AND r.run_id = t.run_id "
                "WHERE t.state IN ('failed', 'upstream_failed')",
            )[0][0]
        )
        consumer_runs = int(
            _query(
                airflow_dsn,
                "SELECT count(*) FROM dag_run WHERE dag_id = 'user_mart' AND state = 'success'",
            )[0][0]
        )
        resumed = sum(1 for row in ended if row[2] == "success")
        polls = self._polls(warehouse_dsn) - self.polls_before
        return Summary(
            tasks=self.scenario.tasks,
            resumed=resumed,
            unique_waits=self.unique_waits,
            dedup_ratio=round(self.scenario.tasks / self.unique_waits, 2) if self.unique_waits else 0.0,
            polls=polls,
            baseline_polls=baseline,
            resume_p50_s=round(statistics.median(latencies), 2) if latencies else 0.0,
            resume_p99_s=round(_percentile(latencies, 99), 2) if latencies else 0.0,
            consumer_runs=consumer_runs,
            failures=failures,
            elapsed_s=round(time.time() - self.started, 1),
        )


def _percentile(values: list[float], pct: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(pct / 100 * len(ordered) + 0.5) - 1))
    return ordered[index]


def summary_table(summary: Summary) -> Table:
    table = Table(title="airflow-smart-triggerer demo: summary", min_width=60)
    table.add_column("measure")
    table.add_column("value", justify="right")
    saved = (1 - summary.polls / summary.baseline_polls) * 100 if summary.baseline_polls else 0.0
    rows = [
        ("sensor tasks (model DAGs)", summary.tasks),
        ("resumed", summary.resumed),
        ("unique waits among them", summary.unique_waits),
        ("dedup ratio (tasks per poll loop)", f"{summary.dedup_ratio:.2f}"),
        ("polls made (status table scans)", summary.polls),
        (
            "polls with one coroutine per task (estimate)",
            f"{summary.baseline_polls} ({saved:.0f}% saved)",
        ),
        ("resume latency p50", f"{summary.resume_p50_s:.2f}s"),
        ("resume latency p99", f"{summary.resume_p99_s:.2f}s"),
        ("consumer runs (asset-scheduled user_mart)", summary.consumer_runs),
        ("failed tasks", summary.failures),
        ("worker slots used by the sensor tasks", 0),
        ("elapsed", f"{summary.elapsed_s:.0f}s"),
    ]
    for name, value in rows:
        table.add_row(name, str(value))
    return table


def _interrupt_on_sigterm() -> None:
    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def run_demo(*, quick: bool, as_json: bool, keep_running: bool, home: Path | None = None) -> int:
    if not (EXAMPLE_DAGS / "warehouse_models.py").is_file():
        raise DemoError(
            f"example DAGs not found at {EXAMPLE_DAGS}: run the demo from a clone of the repository"
        )
    scenario = QUICK if quick else FULL
    console = Console(stderr=as_json)
    demo = Demo(scenario, console, (home or Path.cwd() / ".demo").resolve())
    _interrupt_on_sigterm()
    summaries: list[Summary] = []

    def publish(summary: Summary) -> None:
        summaries.append(summary)
        if as_json:
            print(json.dumps(asdict(summary)), flush=True)

    try:
        _run(demo, console, keep_running, publish)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: everything was stopped[/yellow]")
        if not summaries:
            return 130
    except (DemoError, StackError, PgServerError, psycopg2.Error) as err:
        # a step failed (database unreachable, migration, a component that exited): say which, stop
        console.print(f"[red]demo failed:[/red] {type(err).__name__}: {err}")
        console.print(f"component logs: {demo.home / 'airflow' / 'component-logs'}")
        return 1
    summary = summaries[0]
    ok = summary.resumed == summary.tasks and summary.failures == 0
    return 0 if ok else 1


def _run(demo: Demo, console: Console, keep_running: bool, publish: Callable[[Summary], None]) -> None:
    where = (
        "SMART_TRIGGERER_DSN" if os.environ.get("SMART_TRIGGERER_DSN") else "a private embedded PostgreSQL"
    )
    console.print(f"PostgreSQL: {where}; AIRFLOW_HOME: {demo.home / 'airflow'}")
    with postgres_dsn() as server, _databases(server) as (airflow_dsn, warehouse_dsn):
        config = demo.config(airflow_dsn, warehouse_dsn)
        with console.status("airflow db migrate (about a minute on a small machine)"):
            migrate(config)
        # metadata-DB sensors read Airflow's database through a read-only role (docs/guides/sensors.md)
        config.extra["AIRFLOW_CONN_AIRFLOW_DB"] = reader_dsn(airflow_dsn)
        stack = AirflowStack(config)
        try:
            with Live(demo.render(), console=console, refresh_per_second=2) as live:
                demo.start(stack, warehouse_dsn)
                demo.run_started = time.time()
                summary = demo.run(live, stack, airflow_dsn, warehouse_dsn)
            console.print(summary_table(summary))
            if keep_running:
                _keep_running(console, config, lambda: publish(summary))
            else:
                publish(summary)
        finally:
            with console.status("stopping every process"):
                stack.stop()


def _keep_running(console: Console, config: AirflowConfig, ready: Callable[[], None]) -> None:
    """Write the environment file, then say the stack is ready (``ready``), then wait for Ctrl-C."""
    env_file = write_env_file(config)
    console.print(
        f"The stack keeps running. Airflow UI: {config.api_url}  (login: not needed, every user is an "
        f"admin in the demo)\nPoint the CLIs at it from another shell:\n"
        f"  source {env_file}\n  smart-triggerer status\n  dataset-bridge status\n"
        "Ctrl-C stops everything."
    )
    ready()
    try:
        while True:
            time.sleep(3600)
    finally:
        env_file.unlink(missing_ok=True)


def write_env_file(config: AirflowConfig) -> Path:
    """``export`` lines for the demo deployment's Airflow settings (0600: they hold its keys)."""
    lines = [
        f"export {key}={shlex.quote(value)}"
        for key, value in sorted(config.env().items())
        if key.startswith("AIRFLOW")
    ]
    path = config.home.parent / "env.sh"
    path.touch(mode=0o600)
    path.chmod(0o600)
    path.write_text("# the kept-running demo deployment; removed when it stops\n" + "\n".join(lines) + "\n")
    return path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python3 dev.py demo",
        description="A whole Airflow deployment on a private PostgreSQL, the example DAGs, a warehouse "
        "scenario and a summary. Creates its databases on SMART_TRIGGERER_DSN (a PostgreSQL "
        "server URL) when set, else on a private embedded PostgreSQL it starts and removes "
        "itself. Uses 16 shards (the production default is 64) so that two instances show an "
        "even split.",
        epilog="Exit codes: 0 every task resumed and nothing failed, 1 a task did not resume or failed, "
        "2 invalid argument, 130 interrupted before the summary.",
    )
    parser.add_argument("--quick", action="store_true", help="a smaller scenario (for CI)")
    parser.add_argument(
        "--json",
        action="store_true",
        help="progress on stderr; stdout is exactly the summary as one JSON object",
    )
    parser.add_argument(
        "--keep-running",
        action="store_true",
        help="leave the stack up after the summary, print the UI URL and the environment "
        "that points the CLIs at it (Ctrl-C stops it)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_demo(quick=args.quick, as_json=args.json, keep_running=args.keep_running)


if __name__ == "__main__":
    sys.exit(main())
