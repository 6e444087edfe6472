"""Smart triggerer vs stock ``airflow triggerer`` on the same seeded workload, in one run.

    .venv/bin/python -m bench.triggerer_bench --waiters 5000 --duplicates 0.4 --interval 5 --instances 2

For each mode: a fresh metadata database, N deferred task instances polling an HTTP source (that counts
every poll, server side), ``--instances`` triggerers (both without the trigger log server). Measured:

- steady state (``--steady-seconds`` of pure waiting, after start-up settled): polls, CPU of the
  supervisors and of the runner subprocesses, memory PSS of the process trees, metadata-DB statements
  and the rows they returned (counted in each triggerer process by ``bench/statement_counter``), and
  the database's own transactions and rows scanned (``pg_stat_database``), all per 30 s;
- the burst: time from the condition flip to each task instance leaving DEFERRED (its
  ``scheduled_dttm``), CPU seconds and peak RSS from start to the last resume;
- failover after SIGKILL and after SIGTERM of one instance (until every waiting trigger row belongs to
  the survivor), and how long the SIGTERMed process took to exit.

Prints a table with ratios and appends it to bench/RESULTS.md with --write.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import datetime as dt
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
_HOME = Path(tempfile.mkdtemp(prefix="smart-triggerer-bench-"))
atexit.register(shutil.rmtree, _HOME, ignore_errors=True)  # homes, DAG files and component logs of the run
os.environ.setdefault("AIRFLOW_HOME", str(_HOME / "airflow"))
os.environ.setdefault("AIRFLOW__CORE__LOAD_EXAMPLES", "False")
if not os.environ.get("AIRFLOW__CORE__FERNET_KEY"):
    from cryptography.fernet import Fernet

    os.environ["AIRFLOW__CORE__FERNET_KEY"] = Fernet.generate_key().decode()

from bench.source import PollSource  # noqa: E402
from tests.helpers.databases import create_database, drop_database, unique_name  # noqa: E402
from tests.helpers.seeding import seed_deferred  # noqa: E402
from tests.helpers.waiting import rows  # noqa: E402
from triggerer.devstack import AirflowConfig, AirflowStack, Component, migrate  # noqa: E402
from triggerer.pgserver import postgres_dsn  # noqa: E402

console = Console()
POLL_TRIGGER = "bench.triggers.PollTrigger"


@dataclass
class Steady:
    """Per 30 s of pure waiting."""

    seconds: float = 0.0
    polls: float = 0.0
    cpu_supervisors: float = 0.0
    cpu_runners: float = 0.0
    pss_mb: float = 0.0
    statements: float = 0.0
    rows_returned: float = 0.0
    db_transactions: float = 0.0
    db_rows_scanned: float = 0.0

    @property
    def cpu(self) -> float:
        return self.cpu_supervisors + self.cpu_runners


@dataclass
class Result:
    mode: str
    steady: Steady = field(default_factory=Steady)
    term_exit: float | None = None
    polls_per_interval: float = 0.0
    unique: int = 0
    waiters: int = 0
    cpu_seconds: float = 0.0
    peak_rss_mb: float = 0.0
    resume: list[float] = field(default_factory=list)
    # each resume split in two: flip -> the source's first "ready" answer for its key (the trigger's own
    # poll phase), and that answer -> the task instance left DEFERRED (the triggerer's work)
    ready_poll: list[float] = field(default_factory=list)
    after_poll: list[float] = field(default_factory=list)
    # how late each key's ready poll came: after its last poll before the flip plus the poll interval
    poll_late: list[float] = field(default_factory=list)
    failover_kill: float | None = None
    failover_term: float | None = None
    steady_after: float = 0.0
    page_groups_ms: float | None = None
    page_overview_ms: float | None = None

    def pct(self, q: float, values: list[float] | None = None) -> float:
        values = self.resume if values is None else values
        if not values:
            return float("nan")
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class TreeSampler:
    """Samples CPU and RSS of the triggerer process trees every 0.5 s."""

    def __init__(self, components: list[Component]) -> None:
        self.components = components
        self.cpu: dict[int, float] = {}
        self.peak_rss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            rss = 0
            for component in self.components:
                for proc in component.tree():
                    with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                        times = proc.cpu_times()
                        self.cpu[proc.pid] = times.user + times.system
                        rss += proc.memory_info().rss
            self.peak_rss = max(self.peak_rss, rss)
            self._stop.wait(0.5)

    def __enter__(self) -> TreeSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    @property
    def cpu_seconds(self) -> float:
        return sum(self.cpu.values())

    def pss(self) -> int:
        """Proportional set size of every process in the trees now (shared pages counted once)."""
        total = 0
        for component in self.components:
            for proc in component.tree():
                with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                    total += proc.memory_full_info().pss
        return total

    def split(self) -> tuple[float, float]:
        """CPU seconds so far of the supervisors (the roots) and of everything below them."""
        roots = {c.pid for c in self.components}
        top = sum(v for pid, v in self.cpu.items() if pid in roots)
        return top, self.cpu_seconds - top


def wait_until(check: Callable[[], bool], timeout: float, what: str, interval: float = 0.1) -> float:
    started = time.monotonic()
    while not check():
        if time.monotonic() - started > timeout:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)
    return time.monotonic() - started


def triggerer_jobs(dsn: str) -> list[int]:
    return [r[0] for r in rows(dsn, "SELECT id FROM job WHERE job_type = 'TriggererJob' AND end_date IS NULL "
                                    "ORDER BY id")]


def assigned_to(dsn: str, job_ids: list[int], trigger_ids: list[int]) -> int:
    return int(rows(dsn, "SELECT count(*) FROM trigger WHERE id = ANY(%s) AND triggerer_id = ANY(%s)",
                    trigger_ids, job_ids)[0][0])


STATEMENT_COUNTER = ROOT / "bench" / "statement_counter"


def start_instance(stack: AirflowStack, mode: str, name: str, capacity: int) -> tuple[Component, int]:
    """Start one triggerer of ``mode`` and return it with the id of the job row it created."""
    dsn = stack.config.database_dsn
    known = set(triggerer_jobs(dsn))
    env = {"PYTHONPATH": f"{ROOT}{os.pathsep}{STATEMENT_COUNTER}",
           "BENCH_STATEMENTS_DIR": str(statements_dir(stack))}
    if mode == "stock":
        argv = [stack.config.airflow_bin(), "triggerer", "--skip-serve-logs", "--capacity", str(capacity)]
        component = Component(name, argv, stack.log_dir / f"{name}.log")
        component.start({**stack.config.env(), **env}, cwd=stack.config.home)
        stack.components.append(component)
    else:
        component = stack.start_smart_triggerer(name, capacity=capacity, env=env)
    wait_until(lambda: bool(set(triggerer_jobs(dsn)) - known), 90, f"{name} job row", interval=0.2)
    return component, (set(triggerer_jobs(dsn)) - known).pop()


def statements_dir(stack: AirflowStack) -> Path:
    folder = stack.config.home / "statements"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def seed(config: AirflowConfig, source: PollSource, waiters: int, unique: int, *, prefix: str,
         interval: float) -> list[int]:
    seeded = seed_deferred(
        config.database_dsn, config.dags_folder, count=waiters, classpath=POLL_TRIGGER,
        kwargs_for=lambda i: {"url": source.url, "key": f"{prefix}{i % unique}", "poll_interval": interval},
        dag_id=f"bench_{prefix}",
    )
    return seeded.trigger_ids


def record_resumes(result: Result, source: PollSource, dsn: str, flipped_at: float, *, unique: int,
                   interval: float) -> None:
    """Each waiter's resume latency, and its split at the first "ready" answer for its key (waiter ``i``
    waits on key ``k{i % unique}``, see ``seed``)."""
    values = rows(dsn, "SELECT map_index, extract(epoch FROM scheduled_dttm) FROM task_instance "
                       "WHERE dag_id = 'bench_k' AND state <> 'deferred'")
    for map_index, scheduled in values:
        result.resume.append(float(scheduled) - flipped_at)
        ready_at = source.first_ready.get(f"k{map_index % unique}")
        if ready_at is not None:
            result.ready_poll.append(ready_at - flipped_at)
            result.after_poll.append(float(scheduled) - ready_at)
    for key, ready_at in source.first_ready.items():
        if key in source.before_flip and key.startswith("k"):
            result.poll_late.append(ready_at - source.before_flip[key] - interval)


def measure_failover(stack: AirflowStack, instances: list[tuple[Component, int]], trigger_ids: list[int],
                     how: signal.Signals) -> tuple[float, float | None]:
    """Seconds until the survivors own every waiting trigger, and until the victim's process exited."""
    victim = instances[0][0]
    survivors = [job for _, job in instances[1:]]
    dsn = stack.config.database_dsn
    wait_until(lambda: assigned_to(dsn, [j for _, j in instances], trigger_ids) == len(trigger_ids), 300,
               "failover batch assigned")
    exited: list[float] = []
    process = victim.process
    assert process is not None
    waiter = threading.Thread(target=lambda: (process.wait(), exited.append(time.monotonic())), daemon=True)
    started = time.monotonic()
    waiter.start()
    os.killpg(victim.pid, how)
    took = wait_until(lambda: assigned_to(dsn, survivors, trigger_ids) == len(trigger_ids), 180,
                      f"takeover after {how.name}")
    waiter.join(60)
    exit_after = exited[0] - started if exited else None
    console.print(f"  {how.name}: every waiting trigger owned by the survivor after {took:.1f}s; process "
                  f"exited after {'-' if exit_after is None else f'{exit_after:.1f}s'}")
    return time.monotonic() - started, exit_after


def statement_totals(folder: Path) -> tuple[int, int]:
    """Statements and returned rows so far, over every instrumented process (bench/statement_counter)."""
    statements = rows_returned = 0
    for path in folder.glob("[0-9]*"):
        with contextlib.suppress(OSError, ValueError):
            a, b = path.read_text().split()
            statements, rows_returned = statements + int(a), rows_returned + int(b)
    return statements, rows_returned


def database_totals(dsn: str) -> tuple[int, int]:
    """Transactions and rows scanned (tup_returned) of this database so far, by the server's counters."""
    found = rows(dsn, "SELECT xact_commit + xact_rollback, tup_returned FROM pg_stat_database "
                      "WHERE datname = current_database()")[0]
    return int(found[0]), int(found[1])


def start_profiles(component: Component, seconds: float, folder: Path,
                   mode: str) -> list[subprocess.Popen[bytes]]:
    """py-spy on one instance's supervisor and runner for ``seconds`` (collapsed stacks)."""
    folder.mkdir(parents=True, exist_ok=True)
    spy = Path(sys.executable).with_name("py-spy")
    started = []
    for role, proc in zip(("supervisor", "runner"), component.tree()[:2], strict=False):
        out = folder / f"{mode}-{role}.txt"
        started.append(subprocess.Popen(
            [str(spy), "record", "--pid", str(proc.pid), "--duration", str(int(seconds)), "--rate", "50",
             "--format", "raw", "--nonblocking", "--output", str(out)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return started


def finish_profiles(spies: list[subprocess.Popen[bytes]], folder: str | None, label: str) -> None:
    """Wait for the py-spy recorders, then print where the CPU went."""
    for spy in spies:
        spy.wait(120)
    for role in ("supervisor", "runner") if folder else ():
        console.print(summarize_profile(Path(folder) / f"{label}-{role}.txt"))


def summarize_profile(path: Path, top: int = 10) -> str:
    """Where the CPU went, from py-spy's collapsed stacks: the functions on CPU (self time), and the
    event-loop callbacks and our own functions that led there (inclusive)."""
    if not path.exists():
        return f"{path.name}: no profile"
    own: dict[str, int] = {}
    ours: dict[str, int] = {}
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        samples, frames = int(count), stack.split(";")
        total += samples
        own[frames[-1]] = own.get(frames[-1], 0) + samples
        for frame in set(frames[1:]):
            if frame.split(" (")[-1].startswith(("triggerer/", "triggers/", "bench/")):
                ours[frame] = ours.get(frame, 0) + samples

    def ranked(counts: dict[str, int]) -> list[str]:
        best = sorted(counts.items(), key=lambda item: -item[1])[:top]
        return [f"    {100 * n / max(total, 1):5.1f}%  {frame}" for frame, n in best]

    return "\n".join([f"{path.name}: {total} samples on CPU", "  self:", *ranked(own),
                      "  ours (inclusive):", *ranked(ours)])


def measure_steady(sampler: TreeSampler, source: PollSource, dsn: str, folder: Path,
                   seconds: float) -> Steady:
    """Pure waiting: nothing changes in the database and no condition flips."""
    cpu0, stmt0, db0, polls0 = sampler.split(), statement_totals(folder), database_totals(dsn), source.polls
    started = time.monotonic()
    time.sleep(seconds)
    cpu1, stmt1, db1, polls1 = sampler.split(), statement_totals(folder), database_totals(dsn), source.polls
    per30 = 30.0 / (time.monotonic() - started)
    steady = Steady(
        seconds=seconds, polls=(polls1 - polls0) * per30,
        cpu_supervisors=(cpu1[0] - cpu0[0]) * per30, cpu_runners=(cpu1[1] - cpu0[1]) * per30,
        pss_mb=sampler.pss() / 2**20,
        statements=(stmt1[0] - stmt0[0]) * per30, rows_returned=(stmt1[1] - stmt0[1]) * per30,
        # minus the two transactions of our own reads of the counters
        db_transactions=(db1[0] - db0[0] - 2) * per30, db_rows_scanned=(db1[1] - db0[1]) * per30,
    )
    console.print(f"  steady, per 30 s: cpu supervisors {steady.cpu_supervisors:.2f}s runners "
                  f"{steady.cpu_runners:.2f}s; pss {steady.pss_mb:.0f}MB; {steady.statements:.0f} statements "
                  f"returning {steady.rows_returned:.0f} rows; db: {steady.db_transactions:.0f} "
                  f"transactions, {steady.db_rows_scanned:.0f} rows scanned")
    return steady


def run_mode(mode: str, args: argparse.Namespace, server_dsn: str, template: str) -> Result:
    result = Result(mode=mode, waiters=args.waiters)
    unique = round(args.waiters * (1 - args.duplicates))
    result.unique = unique
    name = unique_name(f"st_bench_{mode}")
    dsn = create_database(server_dsn, name, template)
    home = _HOME / mode
    config = AirflowConfig(home=home / "airflow", database_dsn=dsn, dags_folder=home / "dags",
                           fernet_key=os.environ["AIRFLOW__CORE__FERNET_KEY"],
                           extra={"AIRFLOW__SMART_TRIGGERER__RESUME_HOLD_SECONDS": "0",
                                  "AIRFLOW__TRIGGERER__JOB_HEARTBEAT_SEC": "5"})
    config.home.mkdir(parents=True, exist_ok=True)
    source = PollSource()
    source.start()
    stack = AirflowStack(config)
    try:
        console.print(f"[bold]{mode}[/]: seeding {args.waiters} waiters on {unique} identities")
        trigger_ids = seed(config, source, args.waiters, unique, prefix="k", interval=args.interval)
        instances = [start_instance(stack, mode, f"{mode}-{n}", args.waiters) for n in range(args.instances)]
        with TreeSampler([c for c, _ in instances]) as sampler:
            t0 = time.monotonic()
            wait_started(source, dsn, [j for _, j in instances], trigger_ids, args, unique=unique,
                         coroutines=unique if mode == "smart" else args.waiters)
            result.steady_after = time.monotonic() - t0
            phases = [("start", sampler.split())]
            console.print(f"  steady after {result.steady_after:.1f}s; measuring {args.steady_seconds:g}s of "
                          "pure waiting")
            time.sleep(2 * args.interval)  # let start-up bursts pass
            spies = (start_profiles(instances[0][0], args.steady_seconds, Path(args.profile), mode)
                     if args.profile else [])
            result.steady = measure_steady(sampler, source, dsn, statements_dir(stack), args.steady_seconds)
            finish_profiles(spies, args.profile, mode)
            result.polls_per_interval = result.steady.polls * args.interval / 30
            phases.append(("steady", sampler.split()))
            if mode == "smart":
                record_page(result)
            flipped_at = source.flip("k")
            resume_spies = (start_profiles(instances[0][0], args.interval + 15, Path(args.profile_resume),
                                           f"{mode}-resume") if args.profile_resume else [])
            wait_until(lambda: rows(dsn, "SELECT count(*) FROM task_instance WHERE dag_id = 'bench_k' "
                                         "AND state = 'deferred'")[0][0] == 0, 600, "every waiter resumed",
                       interval=0.2)
            record_resumes(result, source, dsn, flipped_at, unique=unique, interval=args.interval)
            finish_profiles(resume_spies, args.profile_resume, f"{mode}-resume")
            time.sleep(1)
            phases.append(("resume", sampler.split()))
        print_phases(phases)
        result.cpu_seconds = sampler.cpu_seconds
        result.peak_rss_mb = sampler.peak_rss / 2**20
        print_resume(result)
        batch = seed(config, source, args.failover_waiters, args.failover_waiters // 2, prefix="f",
                     interval=args.interval)
        result.failover_term, result.term_exit = measure_failover(stack, instances, batch, signal.SIGTERM)
        # A fresh partner for the survivor, given time to take its share, then the survivor crashes.
        extra = start_instance(stack, mode, f"{mode}-extra", args.waiters)
        time.sleep(3 * args.interval)
        result.failover_kill, _ = measure_failover(stack, [instances[1], extra], batch, signal.SIGKILL)
    finally:
        stack.stop()
        with contextlib.suppress(Exception):
            drop_database(server_dsn, name)
    return result


def wait_started(source: PollSource, dsn: str, jobs: list[int], trigger_ids: list[int],
                 args: argparse.Namespace, *, unique: int, coroutines: int) -> None:
    """Until every waiter is assigned, every identity polled and every coroutine polling: stock runs one
    per waiter, and its last ones may start long after each identity was polled once (its start-up would
    then count as waiting). Starting a coroutine costs Airflow a few queries: at 50,000 waiters, minutes."""
    limit = max(600, args.waiters / 50)
    wait_until(lambda: assigned_to(dsn, jobs, trigger_ids) == len(trigger_ids), limit, "all waiters assigned",
               interval=0.5)
    wait_until(lambda: len(source.per_key) >= unique, limit, "every identity polled", interval=0.5)
    wait_until(lambda: polls_in(source, args.interval) >= 0.97 * coroutines, limit, "every coroutine polling",
               interval=0)


def polls_in(source: PollSource, seconds: float) -> int:
    """Polls the source answers in the next ``seconds`` (waits that long)."""
    before = source.polls
    time.sleep(seconds)
    return source.polls - before


def print_resume(result: Result) -> None:
    def spread(values: list[float] | None = None) -> str:
        return f"p50 {result.pct(0.5, values):.2f}s p99 {result.pct(0.99, values):.2f}s"

    console.print(f"  resumed all: {spread()} max {max(result.resume):.2f}s; cpu {result.cpu_seconds:.1f}s "
                  f"rss {result.peak_rss_mb:.0f}MB")
    console.print(f"  flip to the ready poll: {spread(result.ready_poll)}; ready poll to resumed: "
                  f"{spread(result.after_poll)}; ready poll later than last poll + interval: "
                  f"{spread(result.poll_late)}")


def print_phases(phases: list[tuple[str, tuple[float, float]]]) -> None:
    """CPU of each phase: the sampler's cumulative (supervisors, runners) split at its end."""
    last = (0.0, 0.0)
    for phase, (top, below) in phases:
        console.print(f"  cpu {phase}: supervisors {top - last[0]:.1f}s, runners {below - last[1]:.1f}s")
        last = (top, below)


def record_page(result: Result) -> None:
    result.page_groups_ms, result.page_overview_ms = time_page({"bench_k"})
    console.print(f"  page at {result.waiters} waiters: groups (first 50) {result.page_groups_ms:.0f} ms, "
                  f"overview {result.page_overview_ms:.0f} ms")


def time_page(dag_ids: set[str]) -> tuple[float, float]:
    """Median milliseconds of the Smart Triggerer page's two API bodies over 5 calls each (the queries and
    their JSON, without HTTP): the biggest groups page and the overview."""
    from triggerer import page

    def median_ms(call: Callable[[], object]) -> float:
        took = []
        for _ in range(5):
            started = time.perf_counter()
            call()
            took.append((time.perf_counter() - started) * 1000)
        return statistics.median(took)

    viewer = page.Viewer(frozenset(dag_ids), views_triggers=True)
    return (median_ms(lambda: page.groups_page(viewer, 50, 0)),
            median_ms(lambda: page.overview(may_read_assets=True)))


def ratio(smart: float, stock: float) -> str:
    return f"{smart / stock:.2f}x" if stock else "n/a"


def report(results: dict[str, Result], args: argparse.Namespace) -> str:
    stock, smart = results.get("stock"), results.get("smart")
    table = Table(title=f"{args.waiters} waiters, {args.duplicates:.0%} duplicates, poll interval "
                        f"{args.interval:g}s, {args.instances} instances each")
    table.add_column("metric")
    for mode in results:
        table.add_column(mode)
    if stock and smart:
        table.add_column("smart / stock")
    lines = ["| metric | " + " | ".join(results) + (" | smart / stock |" if stock and smart else " |"),
             "|---|" + "---|" * (len(results) + (1 if stock and smart else 0))]

    def add(label: str, get: Callable[[Result], float | None], fmt: str) -> None:
        values = [get(r) for r in results.values()]
        cells = [fmt.format(v) if v is not None else "-" for v in values]
        if stock and smart:
            a, b = get(smart), get(stock)
            cells.append(ratio(a, b) if a is not None and b is not None else "-")
        table.add_row(label, *cells)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    add("unique identities", lambda r: r.unique, "{:.0f}")
    add("polls per interval (server side)", lambda r: r.polls_per_interval, "{:.0f}")
    add("polls / unique identities", lambda r: r.polls_per_interval / r.unique, "{:.2f}")
    add("waiting: CPU s per 30 s, all", lambda r: r.steady.cpu, "{:.2f}")
    add("waiting: CPU s per 30 s, supervisors", lambda r: r.steady.cpu_supervisors, "{:.2f}")
    add("waiting: CPU s per 30 s, runners", lambda r: r.steady.cpu_runners, "{:.2f}")
    add("waiting: memory PSS (MB)", lambda r: r.steady.pss_mb, "{:.0f}")
    add("waiting: DB statements per 30 s", lambda r: r.steady.statements, "{:.0f}")
    add("waiting: rows returned per 30 s", lambda r: r.steady.rows_returned, "{:.0f}")
    add("waiting: DB transactions per 30 s", lambda r: r.steady.db_transactions, "{:.0f}")
    add("waiting: DB rows scanned per 30 s", lambda r: r.steady.db_rows_scanned, "{:.0f}")
    add("triggerer CPU seconds, start to last resume", lambda r: r.cpu_seconds, "{:.1f}")
    add("peak RSS of triggerer trees (MB)", lambda r: r.peak_rss_mb, "{:.0f}")
    add("resume p50 (s)", lambda r: r.pct(0.5), "{:.2f}")
    add("resume p99 (s)", lambda r: r.pct(0.99), "{:.2f}")
    add("resume max (s)", lambda r: max(r.resume) if r.resume else None, "{:.2f}")
    add("resume: flip to ready poll, p99 (s)", lambda r: r.pct(0.99, r.ready_poll), "{:.2f}")
    add("resume: ready poll late (after last poll + interval), p99 (s)", lambda r: r.pct(0.99, r.poll_late),
        "{:.2f}")
    add("resume: ready poll to resumed, p50 (s)", lambda r: r.pct(0.5, r.after_poll), "{:.2f}")
    add("resume: ready poll to resumed, p99 (s)", lambda r: r.pct(0.99, r.after_poll), "{:.2f}")
    add("failover after SIGKILL (s)", lambda r: r.failover_kill, "{:.1f}")
    add("handover after SIGTERM (s)", lambda r: r.failover_term, "{:.1f}")
    add("process exit after SIGTERM (s)", lambda r: r.term_exit, "{:.1f}")
    add("time to steady state (s)", lambda r: r.steady_after, "{:.1f}")
    add("page: groups API, first 50 (ms)", lambda r: r.page_groups_ms, "{:.0f}")
    add("page: overview API (ms)", lambda r: r.page_overview_ms, "{:.0f}")
    console.print(table)
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--waiters", type=int, default=5000)
    parser.add_argument("--duplicates", type=float, default=0.4)
    parser.add_argument("--interval", type=float, default=5.0)
    parser.add_argument("--instances", type=int, default=2)
    parser.add_argument("--failover-waiters", type=int, default=500)
    parser.add_argument("--steady-seconds", type=float, default=30.0, help="pure waiting measured")
    parser.add_argument("--profile", metavar="DIR",
                        help="py-spy the first instance's supervisor and runner while waiting (needs root)")
    parser.add_argument("--profile-resume", metavar="DIR",
                        help="py-spy one instance's supervisor and runner from the flip for interval + 15 s")
    parser.add_argument("--modes", default="stock,smart")
    parser.add_argument("--write", action="store_true", help="append the table to bench/RESULTS.md")
    args = parser.parse_args()
    # SIGTERM stops the run like Ctrl-C: the triggerers, the source and the databases are cleaned up
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    results: dict[str, Result] = {}
    broke: dict[str, str] = {}
    with postgres_dsn() as server_dsn:
        template = unique_name("st_bench_template")
        dsn = create_database(server_dsn, template)
        try:
            console.print("migrating a template metadata database")
            migrate(AirflowConfig(home=_HOME / "template", database_dsn=dsn, dags_folder=_HOME / "dags",
                                  fernet_key=os.environ["AIRFLOW__CORE__FERNET_KEY"]))
            for mode in args.modes.split(","):
                try:
                    results[mode] = run_mode(mode, args, server_dsn, template)
                except TimeoutError as err:  # where a mode breaks at this size is a result too
                    console.print(f"[red]{mode} did not get through: {err}[/]")
                    broke[mode] = str(err)
        finally:
            drop_database(server_dsn, template)
    markdown = report(results, args) if results else ""
    markdown += "".join(f"\n\n{mode} did not get through: {why}" for mode, why in broke.items())
    if args.write:
        append_result("Triggerer", "bench.triggerer_bench", markdown)
    return 0


def append_result(title: str, module: str, body: str) -> None:
    """Append a dated section with the exact command and its result to bench/RESULTS.md."""
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    command = f"python -m {module} " + " ".join(sys.argv[1:])
    with (ROOT / "bench" / "RESULTS.md").open("a") as out:
        out.write(f"\n## {title}: {stamp}\n\n`{command}`\n\n{body}\n")


if __name__ == "__main__":
    sys.exit(main())
