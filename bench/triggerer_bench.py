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
- start, failover and handover over the whole population while it waits (before the flip), each timed
  by the first poll of every wait: a cold start until every wait polled once; a SIGKILL of one instance
  until the survivors own every waiting trigger row and until each of the victim's waits polled again,
  with the flags of some of its waits flipped during the takeover (their resume latency); a SIGTERM of
  another (after a replacement joined) until each of its waits polled again, and its process exit.

Prints a table with ratios and appends it to bench/RESULTS.md with --write.
"""

from __future__ import annotations

import argparse
import atexit
import bisect
import contextlib
import datetime as dt
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import psycopg2
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
_HOME = Path(tempfile.mkdtemp(prefix="smart-triggerer-bench-"))
atexit.register(shutil.rmtree, _HOME, ignore_errors=True)  # homes, DAG files and component logs of the run


def keep_logs(folder: str | None) -> None:
    """``--keep-logs``: the components' logs of every mode, copied before the run's home is removed."""
    if folder:
        for logs in _HOME.rglob("component-logs"):
            shutil.copytree(logs, Path(folder) / logs.relative_to(_HOME), dirs_exist_ok=True)


os.environ.setdefault("AIRFLOW_HOME", str(_HOME / "airflow"))
os.environ.setdefault("AIRFLOW__CORE__LOAD_EXAMPLES", "False")
if not os.environ.get("AIRFLOW__CORE__FERNET_KEY"):
    from cryptography.fernet import Fernet

    os.environ["AIRFLOW__CORE__FERNET_KEY"] = Fernet.generate_key().decode()

from bench.source import PollSource  # noqa: E402
from devkit.devstack import AirflowConfig, AirflowStack, Component, migrate  # noqa: E402
from devkit.pgserver import postgres_dsn  # noqa: E402
from tests.helpers.databases import create_database, drop_database, unique_name  # noqa: E402
from tests.helpers.seeding import seed_deferred  # noqa: E402
from tests.helpers.waiting import rows  # noqa: E402

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
    start_to_all_polling_s: float | None = None
    kill_to_reassigned_s: float | None = None
    kill_to_all_polling_s: float | None = None
    kill_waits: int = 0
    term_to_reassigned_s: float | None = None
    term_to_all_polling_s: float | None = None
    term_waits: int = 0
    # waits whose flag flipped during the SIGKILL takeover: flip -> task instance left DEFERRED
    takeover_resume: list[float] = field(default_factory=list)
    rss_mb_per_instance: float = 0.0
    steady_after: float = 0.0
    page_groups_ms: float | None = None
    page_overview_ms: float | None = None

    def pct(self, q: float, values: list[float] | None = None) -> float:
        values = self.resume if values is None else values
        if not values:
            return float("nan")
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class CpuBudget:
    """Where the machine's cores went from now until ``report``: all of them (busy core-seconds against
    what the cores could give), the first taker's supervisor and its runner (with more than two instances
    the other takers fall in the rest), the leaving instance (the sampler's last look at its processes,
    every 0.5 s: up to that much of its end missed), every process named ``postgres`` on the machine (a
    bench machine runs one server), the bench (its HTTP source included); the rest is anything else. A
    takeover that keeps every core busy is bound by the work it does, not by a wait: the wall time cannot
    go under that work over the cores."""

    def __init__(self, taker: Component, leaver: Component, sampler: TreeSampler) -> None:
        self.taker = taker
        self.sampler = sampler
        self.machine = psutil.cpu_times()
        self.started = time.monotonic()
        self.processes = _tree_times(taker)
        self.leaver = {pid: total for pid, (total, _) in _tree_times(leaver).items()}
        self.postgres = postgres_cpu()
        self.bench = _own_cpu()  # the bench's own (its HTTP source included): it shares the cores

    def report(self) -> str:
        wall = time.monotonic() - self.started
        bench_cpu = _own_cpu() - self.bench
        now = psutil.cpu_times()
        busy = _busy(now) - _busy(self.machine)
        spent = {}
        for pid, (total, system) in _tree_times(self.taker).items():
            total_before, system_before = self.processes.get(pid, (0.0, 0.0))
            spent[pid] = (total - total_before, system - system_before)
        supervisor = spent.pop(self.taker.pid, (0.0, 0.0))[0]
        runner = sum(total for total, _ in spent.values())
        # the kernel's part of the runner's (page faults of a growing heap count here, not in user time)
        runner_system = sum(system for _, system in spent.values())
        # the leaver may have exited: its processes' last CPU as the sampler saw them (every 0.5 s)
        leaver = sum(self.sampler.cpu.get(pid, cpu) - cpu for pid, cpu in self.leaver.items())
        postgres = postgres_cpu() - self.postgres
        rest = busy - supervisor - runner - leaver - postgres - bench_cpu
        # time the hypervisor gave the cores to someone else: wall time no work of ours fills
        steal = getattr(now, "steal", 0.0) - getattr(self.machine, "steal", 0.0)
        cores = psutil.cpu_count() or 1
        return (
            f"cores busy {busy:.1f} of {cores * wall:.1f} core-seconds ({busy / wall:.2f} of {cores} "
            f"cores; stolen by the host {steal:.1f}s): taker's supervisor {supervisor:.1f}s, its runner "
            f"{runner:.1f}s ({runner_system:.1f}s of it in the kernel), the leaver {leaver:.1f}s, "
            f"PostgreSQL {postgres:.1f}s, the bench {bench_cpu:.1f}s, the rest {rest:.1f}s"
        )


def _tree_times(component: Component) -> dict[int, tuple[float, float]]:
    """CPU seconds of each process of ``component``'s tree so far: (user and system, system)."""
    seen = {}
    for proc in component.tree():
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            times = proc.cpu_times()
            seen[proc.pid] = (times.user + times.system, times.system)
    return seen


def postgres_cpu() -> float:
    """CPU seconds of every PostgreSQL process so far: the live ones, and (through each postmaster's
    children times) the backends that ended: a backend that ends between two looks counts whole in the
    second and in part in the first, so the difference is what it spent between them."""
    total = 0.0
    for proc in psutil.process_iter(["name", "ppid"]):
        if proc.info["name"] != "postgres":
            continue
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            times = proc.cpu_times()
            total += times.user + times.system
            parent = psutil.Process(proc.info["ppid"]) if proc.info["ppid"] else None
            if parent is None or parent.name() != "postgres":  # a postmaster: its ended backends
                total += times.children_user + times.children_system
    return total


def _own_cpu() -> float:
    times = psutil.Process().cpu_times()
    return float(times.user + times.system)


def _busy(times: Any) -> float:
    """Seconds the cores ran something (guest time is inside user on Linux; steal is not ours)."""
    return float(times.user + times.nice + times.system + times.irq + times.softirq)


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


QUIET_STEADY = 1.5  # the instances use at most this times their steady CPU (pure waiting, its polls)
QUIET_CORES = 0.15  # or this many cores, whichever is more, over QUIET_SECONDS: they only wait
QUIET_SECONDS = 2.0


def quiet(sampler: TreeSampler, steady: Steady, what: str, timeout: float = 120.0) -> None:
    """Wait until the instances only wait (their last start's background work, its log files among it,
    is done): a failover or a handover measured right after another start measures both."""
    cores = max(QUIET_CORES, QUIET_STEADY * steady.cpu / 30.0)
    started = time.monotonic()
    last = sampler.cpu_seconds
    while True:
        time.sleep(QUIET_SECONDS)
        now = sampler.cpu_seconds
        if now - last < cores * QUIET_SECONDS:
            console.print(
                f"  {time.monotonic() - started:.0f}s until the instances were quiet before "
                f"{what} (under {cores:.2f} cores over {QUIET_SECONDS:g}s)"
            )
            return
        if time.monotonic() - started > timeout:
            busy = (now - last) / QUIET_SECONDS
            console.print(
                f"  the instances were still busy {timeout:.0f}s later ({busy:.2f} cores): "
                f"measuring {what} anyway"
            )
            return
        last = now


def wait_until(check: Callable[[], bool], timeout: float, what: str, interval: float = 0.1) -> float:
    started = time.monotonic()
    while not check():
        if time.monotonic() - started > timeout:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)
    return time.monotonic() - started


STATEMENT_COUNTER = ROOT / "bench" / "statement_counter"


def start_instance(stack: AirflowStack, mode: str, name: str, capacity: int) -> tuple[Component, int]:
    """Start one triggerer of ``mode`` and return it with the id of the job row it created."""
    return start_instances(stack, mode, [name], capacity)[0]


def start_instances(
    stack: AirflowStack, mode: str, names: list[str], capacity: int
) -> list[tuple[Component, int]]:
    """Start these triggerers of ``mode`` at once (a fleet's cold start, not one after the other) and return
    each with the id of the job row it created, told apart by the hostname it reports (bench/hostname.py)."""
    components = [launch_instance(stack, mode, name, capacity) for name in names]
    dsn = stack.config.database_dsn

    def jobs() -> dict[str, int]:
        return {
            host: job
            for job, host in rows(
                dsn,
                "SELECT id, hostname FROM job WHERE job_type = 'TriggererJob' AND end_date IS NULL "
                "AND hostname = ANY(%s)",
                names,
            )
        }

    wait_until(lambda: len(jobs()) == len(names), 90, f"job rows of {', '.join(names)}", interval=0.2)
    found = jobs()
    return [(component, found[name]) for component, name in zip(components, names, strict=True)]


def launch_instance(stack: AirflowStack, mode: str, name: str, capacity: int) -> Component:
    env = {
        "PYTHONPATH": f"{ROOT}{os.pathsep}{STATEMENT_COUNTER}",
        "BENCH_STATEMENTS_DIR": str(statements_dir(stack)),
        "AIRFLOW__CORE__HOSTNAME_CALLABLE": "bench.hostname.instance_name",
        "BENCH_INSTANCE": name,
    }
    if mode == "stock":
        argv = [stack.config.airflow_bin(), "triggerer", "--skip-serve-logs", "--capacity", str(capacity)]
        component = Component(name, argv, stack.log_dir / f"{name}.log")
        component.start({**stack.config.env(), **env}, cwd=stack.config.home)
        stack.components.append(component)
        return component
    return stack.start_smart_triggerer(name, capacity=capacity, env=env)


def statements_dir(stack: AirflowStack) -> Path:
    folder = stack.config.home / "statements"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def seed(
    config: AirflowConfig, source: PollSource, waiters: int, unique: int, *, prefix: str, interval: float
) -> list[int]:
    seeded = seed_deferred(
        config.database_dsn,
        config.dags_folder,
        count=waiters,
        classpath=POLL_TRIGGER,
        kwargs_for=lambda i: {"url": source.url, "key": f"{prefix}{i % unique}", "poll_interval": interval},
        dag_id=f"bench_{prefix}",
    )
    make_task_log_folders(config, seeded.dag_id, seeded.run_id, waiters)
    return seeded.trigger_ids


def make_task_log_folders(config: AirflowConfig, dag_id: str, run_id: str, count: int) -> None:
    """Each waiter's task log folder (Airflow's default ``log_filename_template``), as the worker that ran
    the task up to its deferral leaves it: the triggerer writes its own log file beside the worker's. The
    bench seeds deferred rows directly, and without the folders each triggerer (stock and smart alike)
    made 50,000 folders, one path step at a time, in its first minute."""
    base = config.home / "logs" / f"dag_id={dag_id}" / f"run_id={run_id}" / "task_id=wait"
    for map_index in range(count):
        (base / f"map_index={map_index}").mkdir(parents=True, exist_ok=True)


def record_resumes(
    result: Result,
    source: PollSource,
    dsn: str,
    flipped_at: float,
    *,
    unique: int,
    interval: float,
    skip: set[int],
) -> None:
    """Each waiter's resume latency, and its split at the first "ready" answer for its key (waiter ``i``
    waits on key ``k{i % unique}``, see ``seed``)."""
    values = rows(
        dsn,
        "SELECT map_index, extract(epoch FROM scheduled_dttm) FROM task_instance "
        "WHERE dag_id = 'bench_k' AND state <> 'deferred'",
    )
    for map_index, scheduled in values:
        if map_index in skip:  # resumed by a flip during a takeover
            continue
        result.resume.append(float(scheduled) - flipped_at)
        ready_at = source.first_ready.get(f"k{map_index % unique}")
        if ready_at is not None:
            result.ready_poll.append(ready_at - flipped_at)
            result.after_poll.append(float(scheduled) - ready_at)
    for key, ready_at in source.first_ready.items():
        if key in source.before_flip and key.startswith("k") and key not in source.ready_keys:
            result.poll_late.append(ready_at - source.before_flip[key] - interval)


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
    found = rows(
        dsn,
        "SELECT xact_commit + xact_rollback, tup_returned FROM pg_stat_database "
        "WHERE datname = current_database()",
    )[0]
    return int(found[0]), int(found[1])


def start_profiles(
    component: Component, seconds: float, folder: Path, mode: str
) -> list[subprocess.Popen[bytes]]:
    """py-spy on one instance's supervisor and runner for ``seconds`` (collapsed stacks)."""
    folder.mkdir(parents=True, exist_ok=True)
    spy = Path(sys.executable).with_name("py-spy")
    started = []
    for role, proc in zip(("supervisor", "runner"), component.tree()[:2], strict=False):
        out = folder / f"{mode}-{role}.txt"
        started.append(
            subprocess.Popen(
                [
                    str(spy),
                    "record",
                    "--pid",
                    str(proc.pid),
                    "--duration",
                    str(int(seconds)),
                    "--rate",
                    "50",
                    "--format",
                    "raw",
                    "--nonblocking",
                    "--output",
                    str(out),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
    return started


def finish_profiles(spies: list[subprocess.Popen[bytes]], folder: str | None, label: str) -> None:
    """Wait for the py-spy recorders, then print where the CPU went."""
    for spy in spies:
        spy.wait(120)
    for role in ("supervisor", "runner") if folder else ():
        console.print(summarize_profile(Path(folder) / f"{label}-{role}.txt"))


def profile_start(component: Component, args: argparse.Namespace, mode: str) -> list[subprocess.Popen[bytes]]:
    """py-spy the first instance's supervisor and runner from the runner's start (``--profile-start``)."""
    if not args.profile_start:
        return []
    wait_until(lambda: len(component.tree()) >= 2, 60, "the runner subprocess", interval=0.05)
    return start_profiles(component, max(600.0, args.waiters / 50), Path(args.profile_start), f"{mode}-start")


def stop_profiles(spies: list[subprocess.Popen[bytes]], folder: str | None, label: str) -> None:
    """End py-spy recorders early (they write what they recorded) and print where the CPU went."""
    for spy in spies:
        spy.send_signal(signal.SIGINT)
    finish_profiles(spies, folder, label)


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

    return "\n".join(
        [
            f"{path.name}: {total} samples on CPU",
            "  self:",
            *ranked(own),
            "  ours (inclusive):",
            *ranked(ours),
        ]
    )


def measure_steady(
    sampler: TreeSampler, source: PollSource, dsn: str, folder: Path, seconds: float
) -> Steady:
    """Pure waiting: nothing changes in the database and no condition flips."""
    cpu0, stmt0, db0, polls0 = sampler.split(), statement_totals(folder), database_totals(dsn), source.polls
    started = time.monotonic()
    time.sleep(seconds)
    cpu1, stmt1, db1, polls1 = sampler.split(), statement_totals(folder), database_totals(dsn), source.polls
    per30 = 30.0 / (time.monotonic() - started)
    steady = Steady(
        seconds=seconds,
        polls=(polls1 - polls0) * per30,
        cpu_supervisors=(cpu1[0] - cpu0[0]) * per30,
        cpu_runners=(cpu1[1] - cpu0[1]) * per30,
        pss_mb=sampler.pss() / 2**20,
        statements=(stmt1[0] - stmt0[0]) * per30,
        rows_returned=(stmt1[1] - stmt0[1]) * per30,
        # minus the two transactions of our own reads of the counters
        db_transactions=(db1[0] - db0[0] - 2) * per30,
        db_rows_scanned=(db1[1] - db0[1]) * per30,
    )
    console.print(
        f"  steady, per 30 s: cpu supervisors {steady.cpu_supervisors:.2f}s runners "
        f"{steady.cpu_runners:.2f}s; pss {steady.pss_mb:.0f}MB; {steady.statements:.0f} statements "
        f"returning {steady.rows_returned:.0f} rows; db: {steady.db_transactions:.0f} "
        f"transactions, {steady.db_rows_scanned:.0f} rows scanned"
    )
    return steady


def instance_settings(args: argparse.Namespace) -> dict[str, str]:
    """The Airflow settings of every instance of the run (stock and smart)."""
    extra = {
        "AIRFLOW__SMART_TRIGGERER__RESUME_HOLD_SECONDS": "0",
        "AIRFLOW__TRIGGERER__JOB_HEARTBEAT_SEC": "5",
    }
    if args.max_new_per_loop:
        extra["AIRFLOW__SMART_TRIGGERER__MAX_NEW_PER_LOOP"] = str(args.max_new_per_loop)
    return extra


def bench_config(
    label: str, server_dsn: str, template: str, extra: dict[str, str]
) -> tuple[str, AirflowConfig]:
    """A metadata database cloned from the run's template and an Airflow home of its own for ``label``:
    (the database's name, to drop it at the end; the configuration)."""
    name = unique_name(f"st_bench_{label}")
    dsn = create_database(server_dsn, name, template)
    home = _HOME / label
    config = AirflowConfig(
        home=home / "airflow",
        database_dsn=dsn,
        dags_folder=home / "dags",
        fernet_key=os.environ["AIRFLOW__CORE__FERNET_KEY"],
        extra=extra,
    )
    config.home.mkdir(parents=True, exist_ok=True)
    return name, config


def run_mode(mode: str, args: argparse.Namespace, server_dsn: str, template: str) -> Result:
    result = Result(mode=mode, waiters=args.waiters)
    unique = round(args.waiters * (1 - args.duplicates))
    result.unique = unique
    name, config = bench_config(mode, server_dsn, template, instance_settings(args))
    dsn = config.database_dsn
    source = PollSource()
    source.start()
    stack = AirflowStack(config)
    try:
        console.print(f"[bold]{mode}[/]: seeding {args.waiters} waiters on {unique} identities")
        trigger_ids = seed(config, source, args.waiters, unique, prefix="k", interval=args.interval)
        waits = Waits(mode, trigger_ids, unique, args)
        started_at = time.time()
        instances = start_instances(stack, mode, [f"{mode}-{n}" for n in range(args.instances)], args.waiters)
        start_spies = profile_start(instances[0][0], args, mode)
        with TreeSampler([c for c, _ in instances]) as sampler:
            t0 = time.monotonic()
            wait_started(source, dsn, [j for _, j in instances], waits)
            stop_profiles(start_spies, args.profile_start, f"{mode}-start")
            result.start_to_all_polling_s = waits.all_polling(source, started_at, trigger_ids, "cold start")
            result.steady_after = time.monotonic() - t0
            console.print(
                f"  cold start: every wait polling {result.start_to_all_polling_s:.1f}s after the "
                f"instances started; measuring {args.steady_seconds:g}s of pure waiting"
            )
            phases = [("start", sampler.split())]
            time.sleep(2 * args.interval)  # let start-up bursts pass
            spies = (
                start_profiles(instances[0][0], args.steady_seconds, Path(args.profile), mode)
                if args.profile
                else []
            )
            result.steady = measure_steady(sampler, source, dsn, statements_dir(stack), args.steady_seconds)
            result.rss_mb_per_instance = (
                max(sum(p.memory_info().rss for p in c.tree()) for c, _ in instances) / 2**20
            )
            finish_profiles(spies, args.profile, mode)
            result.polls_per_interval = result.steady.polls * args.interval / 30
            phases.append(("steady", sampler.split()))
            if mode == "smart":
                record_page(result)
            bench = Bench(stack, mode, source, waits, sampler, args)
            live = measure_takeovers(result, bench, instances)
            phases.append(("takeovers", sampler.split()))
            measure_burst(result, bench, live[0][0])
            phases.append(("resume", sampler.split()))
        print_phases(phases)
        result.cpu_seconds = sampler.cpu_seconds
        result.peak_rss_mb = sampler.peak_rss / 2**20
        print_resume(result)
    finally:
        stack.stop()
        close_probe(dsn)
        with contextlib.suppress(Exception):
            drop_database(server_dsn, name)
    return result


class Waits:
    """The seeded waits and how a bench tells that one polls: waiter ``i`` (trigger ``trigger_ids[i]``)
    waits on key ``k{i % unique}``. A smart group's coroutine polls for every waiter of its key, so a wait
    polls when its key does; stock runs one coroutine per waiter: a wait polls when its own trigger does."""

    def __init__(self, mode: str, trigger_ids: list[int], unique: int, args: argparse.Namespace) -> None:
        self.mode = mode
        self.index = {trigger_id: i for i, trigger_id in enumerate(trigger_ids)}
        self.unique = unique
        self.timeout = max(600.0, len(trigger_ids) / 50)
        self.flipped_indexes: set[int] = set()
        self.args = args

    def key(self, trigger_id: int) -> str:
        return f"k{self.index[trigger_id] % self.unique}"

    def polls_as(self, trigger_id: int) -> str | int:
        """What the source sees when this wait polls: its key (a smart group's coroutine polls for every
        waiter of its key) or, stock, its own trigger id."""
        return self.key(trigger_id) if self.mode == "smart" else trigger_id

    def all_polling(
        self, source: PollSource, since: float, trigger_ids: list[int], what: str | None = None
    ) -> float:
        """Seconds from ``since`` (wall clock) until each of these waits had polled (waits for it); with
        ``what``, prints when each quarter of them first polled (the curve, not only its end). Reads only
        the polls new since its last look: the bench must not load the cores it measures."""
        deadline = time.monotonic() + self.timeout
        wanted = {self.polls_as(t) for t in trigger_ids}
        first: dict[str | int, float] = {}
        log = source.poll_log  # appended in time order by the source's thread
        cursor = bisect.bisect_left(log, since, key=lambda entry: entry[0])
        while True:
            end = len(log)
            for index in range(cursor, end):
                at, key, trigger_id = log[index]
                seen: str | int = key if self.mode == "smart" else trigger_id
                if seen in wanted and seen not in first:
                    first[seen] = at
            cursor = end
            if len(first) == len(wanted):
                return self._curve([first[self.polls_as(t)] - since for t in trigger_ids], what)
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{len(wanted) - len(first)} of {len(wanted)} waits did not poll within "
                    f"{self.timeout:.0f}s"
                )
            time.sleep(0.5)

    @staticmethod
    def _curve(offsets: list[float], what: str | None) -> float:
        """The last first poll; with ``what``, when each share of the waits had polled, printed (the first
        tenths too: when the runner got its first coroutines)."""
        offsets = sorted(offsets) or [0.0]
        if what:
            shares = (5, 10, 25, 50, 75, 90)
            at = [offsets[min(len(offsets) - 1, len(offsets) * q // 100)] for q in shares]
            quarters = ", ".join(f"{q}% {s:.1f}s" for q, s in zip(shares, at, strict=True))
            console.print(f"  {what}, first polls after: {quarters}, 100% {offsets[-1]:.1f}s")
        return offsets[-1]


def settled(count: Callable[[], int], timeout: float, what: str, seconds: float = 3.0) -> int:
    """Wait until ``count()`` is the same for ``seconds`` (a joining instance has taken its share)."""
    deadline = time.monotonic() + timeout
    last, since = count(), time.monotonic()
    while time.monotonic() - since < seconds:
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what} to settle")
        time.sleep(0.5)
        now = count()
        if now != last:
            last, since = now, time.monotonic()
    return last


def waiting_on(dsn: str, job_ids: list[int]) -> list[int]:
    """Trigger ids of the deferred bench waiters that these triggerer jobs run now."""
    return [
        r[0]
        for r in rows(
            dsn,
            "SELECT t.id FROM trigger t JOIN task_instance ti "
            "ON ti.trigger_id = t.id WHERE ti.dag_id = 'bench_k' "
            "AND ti.state = 'deferred' AND t.triggerer_id = ANY(%s)",
            job_ids,
        )
    ]


class Unowned:
    """The deferred bench waiters whose trigger none of ``job_ids`` owns, counted by the server every 0.2-0.5
    s of a takeover or a start: the bench must not itself load the 2 cores it measures. Counting all 50,000
    in each look (a join of task instances and triggers, 150 ms) took PostgreSQL a third of a core. While
    many are unowned, a look counts the trigger rows no live job owns (the trigger table alone; a trigger
    row whose task no longer waits counts too, so the count is never lower than the waiters'); from
    ``ASK_BY_ID_UP_TO`` down, it asks only about the waiters the last look found unowned, by id, and a
    look that finds none left counts them all once more before it says so (a row seen owned may have
    been released since)."""

    def __init__(self, dsn: str, job_ids: list[int]) -> None:
        self.dsn, self.job_ids = dsn, job_ids
        self.left: list[int] | None = None  # None: many, counted from the trigger table

    def count(self) -> int:
        if self.left is None or len(self.left) > ASK_BY_ID_UP_TO:
            rows_left = unowned_trigger_rows(self.dsn, self.job_ids)
            if rows_left > ASK_BY_ID_UP_TO:
                self.left = None
                return rows_left
            self.left = unowned_waiters(self.dsn, self.job_ids, None)
        else:
            self.left = unowned_waiters(self.dsn, self.job_ids, self.left)
            if not self.left:
                self.left = unowned_waiters(self.dsn, self.job_ids, None)
        return len(self.left)


# from this many unowned waiters down, looks ask about them by id (5 ms for 1,000)
ASK_BY_ID_UP_TO = 2000


def unowned_trigger_rows(dsn: str, job_ids: list[int]) -> int:
    """Trigger rows none of these jobs owns (the bench's deployment has only its waiters' triggers)."""
    with probe_connection(dsn).cursor() as cur:
        cur.execute(
            "SELECT count(*) FROM trigger WHERE triggerer_id IS NULL OR triggerer_id <> ALL(%s)", (job_ids,)
        )
        return int(cur.fetchone()[0])


def unowned_waiters(dsn: str, job_ids: list[int], among: list[int] | None) -> list[int]:
    """Trigger ids of deferred bench waiters none of these jobs owns (only those ``among``, when given)."""
    if among is None:
        query = (
            "SELECT t.id FROM task_instance ti JOIN trigger t ON t.id = ti.trigger_id "
            "WHERE ti.dag_id = 'bench_k' AND ti.state = 'deferred' "
            "AND (t.triggerer_id IS NULL OR t.triggerer_id <> ALL(%s))"
        )
        params: tuple[Any, ...] = (job_ids,)
    else:
        # from each id through the primary key and ti_trigger_id (OFFSET 0: never merged into a join the
        # planner, with the bench's tables unanalysed, would drive from all 50,000 task instances)
        query = (
            "SELECT asked.id FROM unnest(%s::integer[]) AS asked(id) "
            "CROSS JOIN LATERAL (SELECT t.triggerer_id FROM trigger t WHERE t.id = asked.id OFFSET 0) t "
            "CROSS JOIN LATERAL (SELECT ti.dag_id, ti.state FROM task_instance ti "
            "WHERE ti.trigger_id = asked.id OFFSET 0) ti "
            "WHERE ti.dag_id = 'bench_k' AND ti.state = 'deferred' "
            "AND (t.triggerer_id IS NULL OR t.triggerer_id <> ALL(%s))"
        )
        params = (among, job_ids)
    with probe_connection(dsn).cursor() as cur:
        cur.execute(query, params)
        return [row[0] for row in cur.fetchall()]


def probe_connection(dsn: str) -> Any:
    """The looks' connection, kept open: a connection per look starts a PostgreSQL backend each time."""
    conn = _probe_connections.get(dsn)
    if conn is None or conn.closed:
        # no JIT: it compiled the 5 ms look for 15-250 ms
        conn = _probe_connections[dsn] = psycopg2.connect(dsn, options="-c jit=off")
        conn.autocommit = True  # each look sees what is committed now
    return conn


_probe_connections: dict[str, Any] = {}


def close_probe(dsn: str) -> None:
    """``unowned_waiters``' connection, before its database is dropped."""
    conn = _probe_connections.pop(dsn, None)
    if conn is not None:
        conn.close()


def deferred_waits(dsn: str) -> list[int]:
    return [
        r[0]
        for r in rows(
            dsn, "SELECT trigger_id FROM task_instance WHERE dag_id = 'bench_k' AND state = 'deferred'"
        )
    ]


@dataclass
class Takeover:
    """One instance signalled while every wait waits, timed by the first poll of each of its waits."""

    waits: int  # waits the victim ran
    reassigned_s: float  # until the survivors own every waiting trigger row
    all_polling_s: float  # until each of the victim's waits (still waiting) polled again
    exit_s: float | None  # until the victim's process exited
    flipped_at: float  # wall clock; 0.0 when nothing was flipped
    flipped_keys: set[str]


@dataclass
class Bench:
    """One mode's running bench: its stack, its source, its waits, the CPU sampler."""

    stack: AirflowStack
    mode: str
    source: PollSource
    waits: Waits
    sampler: TreeSampler
    args: argparse.Namespace


def measure_burst(result: Result, bench: Bench, profiled: Component) -> None:
    """Flip every key at once: each waiter's time to leave DEFERRED (those flipped before excluded)."""
    dsn, args = bench.stack.config.database_dsn, bench.args
    flipped_at = bench.source.flip("k")
    spies = (
        start_profiles(profiled, args.interval + 15, Path(args.profile_resume), f"{bench.mode}-resume")
        if args.profile_resume
        else []
    )
    wait_until(lambda: not deferred_waits(dsn), bench.waits.timeout, "every waiter resumed", interval=0.2)
    finish_profiles(spies, args.profile_resume, f"{bench.mode}-resume")
    record_resumes(
        result,
        bench.source,
        dsn,
        flipped_at,
        unique=bench.waits.unique,
        interval=args.interval,
        skip=bench.waits.flipped_indexes,
    )


def measure_takeovers(
    result: Result, bench: Bench, instances: list[tuple[Component, int]]
) -> list[tuple[Component, int]]:
    """SIGKILL the first instance while every wait waits (the flags of some of its waits flip a second
    later), start a replacement, then SIGTERM the second instance once the replacement polls its share."""
    stack, mode, source, waits, args = bench.stack, bench.mode, bench.source, bench.waits, bench.args
    dsn = stack.config.database_dsn
    victim, survivors = instances[0], instances[1:]
    quiet(bench.sampler, result.steady, "the SIGKILL")
    kill = take_over(bench, victim, survivors, signal.SIGKILL, flips=args.takeover_flips)
    result.kill_waits, result.kill_to_reassigned_s = kill.waits, kill.reassigned_s
    result.kill_to_all_polling_s = kill.all_polling_s
    wanted = {i for i in range(args.waiters) if f"k{i % waits.unique}" in kill.flipped_keys}
    waits.flipped_indexes = wanted
    wait_until(lambda: wanted <= set(resumed_at(dsn)), waits.timeout, "the waits flipped during the takeover")
    result.takeover_resume = [at - kill.flipped_at for i, at in resumed_at(dsn).items() if i in wanted]
    console.print(
        f"  flipped during the takeover: {len(wanted)} waits resumed "
        f"p50 {result.pct(0.5, result.takeover_resume):.2f}s "
        f"p99 {result.pct(0.99, result.takeover_resume):.2f}s after the flip"
    )
    started_at = time.time()
    extra = start_instance(stack, mode, f"{mode}-extra", args.waiters)
    bench.sampler.components.append(extra[0])
    live = [*survivors, extra]
    unowned = Unowned(dsn, [job for _, job in live])
    wait_until(
        lambda: unowned.count() == 0,
        waits.timeout,
        "every wait assigned after the replacement joined",
        interval=0.5,
    )
    settled(lambda: len(waiting_on(dsn, [extra[1]])), waits.timeout, "the replacement's share")
    waits.all_polling(source, started_at, waiting_on(dsn, [extra[1]]), "the replacement's share")
    quiet(bench.sampler, result.steady, "the SIGTERM")
    term = take_over(bench, survivors[0], [*survivors[1:], extra], signal.SIGTERM, flips=0)
    result.term_waits, result.term_to_reassigned_s = term.waits, term.reassigned_s
    result.term_to_all_polling_s, result.term_exit = term.all_polling_s, term.exit_s
    return [*survivors[1:], extra]


def take_over(
    bench: Bench,
    victim: tuple[Component, int],
    survivors: list[tuple[Component, int]],
    how: signal.Signals,
    *,
    flips: int,
) -> Takeover:
    dsn, source, waits = bench.stack.config.database_dsn, bench.source, bench.waits
    mine = waiting_on(dsn, [victim[1]])
    survivor_jobs = [job for _, job in survivors]
    keys = sorted({waits.key(t) for t in mine})
    flip_keys = set(random.Random(len(mine)).sample(keys, min(flips, len(keys))))
    exited: list[float] = []
    process = victim[0].process
    assert process is not None

    def note_exit() -> None:
        process.wait()
        exited.append(time.time())

    threading.Thread(target=note_exit, daemon=True).start()
    spies = (
        start_profiles(
            survivors[0][0],
            waits.timeout,
            Path(bench.args.profile_takeover),
            f"{bench.mode}-{how.name.lower()}",
        )
        if bench.args.profile_takeover
        else []
    )
    budget = CpuBudget(survivors[0][0], victim[0], bench.sampler)
    signalled = time.time()
    os.killpg(victim[0].pid, how)
    flipped_at = 0.0
    if flip_keys:
        time.sleep(1.0)
        flipped_at = source.flip_keys(flip_keys)
    unowned = Unowned(dsn, survivor_jobs)
    wait_until(
        lambda: unowned.count() == 0,
        waits.timeout,
        f"every wait owned by the survivors after {how.name}",
        interval=0.2,
    )
    reassigned = time.time() - signalled
    # waits the flip resumed meanwhile poll no more: those still waiting must poll again
    still = [t for t in mine if waits.key(t) not in flip_keys]
    polling = waits.all_polling(source, signalled, still, how.name)
    console.print(f"  {budget.report()}")
    stop_profiles(spies, bench.args.profile_takeover, f"{bench.mode}-{how.name.lower()}")
    wait_until(lambda: bool(exited), 60, f"the {how.name} victim's exit")
    took = Takeover(len(mine), reassigned, polling, exited[0] - signalled, flipped_at, flip_keys)
    console.print(
        f"  {how.name}: {took.waits} waits; every waiting trigger owned by the survivors after "
        f"{took.reassigned_s:.1f}s, each of the victim's waits polling again after "
        f"{took.all_polling_s:.1f}s; process exited after {took.exit_s:.1f}s"
    )
    return took


def resumed_at(dsn: str) -> dict[int, float]:
    """map index -> when its task instance left DEFERRED (scheduled_dttm, wall clock)."""
    return {
        int(i): float(at)
        for i, at in rows(
            dsn,
            "SELECT map_index, extract(epoch FROM scheduled_dttm) FROM task_instance "
            "WHERE dag_id = 'bench_k' AND state <> 'deferred'",
        )
    }


def wait_started(source: PollSource, dsn: str, jobs: list[int], waits: Waits) -> None:
    """Until every waiter is assigned and every wait polled once (stock: each waiter's own coroutine)."""
    trigger_ids = list(waits.index)
    unowned = Unowned(dsn, jobs)
    wait_until(lambda: unowned.count() == 0, waits.timeout, "all waiters assigned", interval=0.5)
    waits.all_polling(source, 0.0, trigger_ids)


def polls_in(source: PollSource, seconds: float) -> int:
    """Polls the source answers in the next ``seconds`` (waits that long)."""
    before = source.polls
    time.sleep(seconds)
    return source.polls - before


def print_resume(result: Result) -> None:
    def spread(values: list[float] | None = None) -> str:
        return f"p50 {result.pct(0.5, values):.2f}s p99 {result.pct(0.99, values):.2f}s"

    console.print(
        f"  resumed all: {spread()} max {max(result.resume):.2f}s; cpu {result.cpu_seconds:.1f}s "
        f"rss {result.peak_rss_mb:.0f}MB"
    )
    console.print(
        f"  flip to the ready poll: {spread(result.ready_poll)}; ready poll to resumed: "
        f"{spread(result.after_poll)}; ready poll later than last poll + interval: "
        f"{spread(result.poll_late)}"
    )


def print_phases(phases: list[tuple[str, tuple[float, float]]]) -> None:
    """CPU of each phase: the sampler's cumulative (supervisors, runners) split at its end."""
    last = (0.0, 0.0)
    for phase, (top, below) in phases:
        console.print(f"  cpu {phase}: supervisors {top - last[0]:.1f}s, runners {below - last[1]:.1f}s")
        last = (top, below)


def record_page(result: Result) -> None:
    result.page_groups_ms, result.page_overview_ms = time_page({"bench_k"})
    console.print(
        f"  page at {result.waiters} waiters: groups (first 50) {result.page_groups_ms:.0f} ms, "
        f"overview {result.page_overview_ms:.0f} ms"
    )


def time_page(dag_ids: set[str]) -> tuple[float, float]:
    """Median milliseconds of the Smart Triggerer page's two API bodies over 5 calls each (the queries and
    their JSON, without HTTP): the biggest groups page and the overview."""
    from smart_triggerer.web import page

    def median_ms(call: Callable[[], object]) -> float:
        took = []
        for _ in range(5):
            started = time.perf_counter()
            call()
            took.append((time.perf_counter() - started) * 1000)
        return statistics.median(took)

    viewer = page.Viewer(frozenset(dag_ids), views_triggers=True)
    return (
        median_ms(lambda: page.groups_page(viewer, 50, 0)),
        median_ms(lambda: page.overview(may_read_assets=True)),
    )


def ratio(smart: float, stock: float) -> str:
    return f"{smart / stock:.2f}x" if stock else "n/a"


def report(results: dict[str, Result], args: argparse.Namespace) -> str:
    stock, smart = results.get("stock"), results.get("smart")
    table = Table(
        title=f"{args.waiters} waiters, {args.duplicates:.0%} duplicates, poll interval "
        f"{args.interval:g}s, {args.instances} instances each"
    )
    table.add_column("metric")
    for mode in results:
        table.add_column(mode)
    if stock and smart:
        table.add_column("smart / stock")
    lines = [
        "| metric | " + " | ".join(results) + (" | smart / stock |" if stock and smart else " |"),
        "|---|" + "---|" * (len(results) + (1 if stock and smart else 0)),
    ]

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
    add(
        "resume: ready poll late (after last poll + interval), p99 (s)",
        lambda r: r.pct(0.99, r.poll_late),
        "{:.2f}",
    )
    add("resume: ready poll to resumed, p50 (s)", lambda r: r.pct(0.5, r.after_poll), "{:.2f}")
    add("resume: ready poll to resumed, p99 (s)", lambda r: r.pct(0.99, r.after_poll), "{:.2f}")
    add(
        "cold start: every wait polling (s), start_to_all_polling_s",
        lambda r: r.start_to_all_polling_s,
        "{:.1f}",
    )
    add("SIGKILL: the victim's waits", lambda r: r.kill_waits, "{:.0f}")
    add(
        "SIGKILL: every wait owned again (s), kill_to_reassigned_s",
        lambda r: r.kill_to_reassigned_s,
        "{:.1f}",
    )
    add(
        "SIGKILL: every wait polling again (s), kill_to_all_polling_s",
        lambda r: r.kill_to_all_polling_s,
        "{:.1f}",
    )
    add(
        "SIGKILL: flipped during the takeover, resume p50 (s)",
        lambda r: r.pct(0.5, r.takeover_resume),
        "{:.2f}",
    )
    add(
        "SIGKILL: flipped during the takeover, resume p99 (s)",
        lambda r: r.pct(0.99, r.takeover_resume),
        "{:.2f}",
    )
    add("SIGTERM: the victim's waits", lambda r: r.term_waits, "{:.0f}")
    add("SIGTERM: every wait owned again (s)", lambda r: r.term_to_reassigned_s, "{:.1f}")
    add(
        "SIGTERM: every wait polling again (s), term_to_all_polling_s",
        lambda r: r.term_to_all_polling_s,
        "{:.1f}",
    )
    add("process exit after SIGTERM (s)", lambda r: r.term_exit, "{:.1f}")
    add("memory RSS per instance while waiting (MB)", lambda r: r.rss_mb_per_instance, "{:.0f}")
    add("time to steady state (s)", lambda r: r.steady_after, "{:.1f}")
    add("page: groups API, first 50 (ms)", lambda r: r.page_groups_ms, "{:.0f}")
    add("page: overview API (ms)", lambda r: r.page_overview_ms, "{:.0f}")
    console.print(table)
    return "\n".join(lines)


@contextlib.contextmanager
def migrated_template(prefix: str, keep_logs_in: str | None) -> Iterator[tuple[str, str]]:
    """A PostgreSQL server and a metadata database migrated once for the run, which each mode clones;
    dropped at the end, after the components' logs were copied (``--keep-logs``)."""
    with postgres_dsn() as server_dsn:
        template = unique_name(prefix)
        dsn = create_database(server_dsn, template)
        try:
            console.print("migrating a template metadata database")
            migrate(
                AirflowConfig(
                    home=_HOME / "template",
                    database_dsn=dsn,
                    dags_folder=_HOME / "dags",
                    fernet_key=os.environ["AIRFLOW__CORE__FERNET_KEY"],
                )
            )
            yield server_dsn, template
        finally:
            keep_logs(keep_logs_in)
            drop_database(server_dsn, template)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--waiters", type=int, default=5000)
    parser.add_argument("--duplicates", type=float, default=0.4)
    parser.add_argument("--interval", type=float, default=5.0)
    parser.add_argument("--instances", type=int, default=2)
    parser.add_argument(
        "--takeover-flips",
        type=int,
        default=100,
        help="keys of the SIGKILL victim's waits flipped a second into the takeover",
    )
    parser.add_argument("--steady-seconds", type=float, default=30.0, help="pure waiting measured")
    parser.add_argument(
        "--profile",
        metavar="DIR",
        help="py-spy the first instance's supervisor and runner while waiting (needs root)",
    )
    parser.add_argument(
        "--profile-resume",
        metavar="DIR",
        help="py-spy one instance's supervisor and runner from the flip for interval + 15 s",
    )
    parser.add_argument(
        "--profile-start",
        metavar="DIR",
        help="py-spy the first instance's supervisor and runner until every wait polls",
    )
    parser.add_argument(
        "--profile-takeover",
        metavar="DIR",
        help="py-spy the SIGKILL survivor's supervisor and runner until all waits poll again",
    )
    parser.add_argument("--modes", default="stock,smart")
    parser.add_argument(
        "--max-new-per-loop",
        type=int,
        default=0,
        help="[smart_triggerer] max_new_per_loop of the smart instances (0: its default)",
    )
    parser.add_argument("--keep-logs", metavar="DIR", help="copy the instances' logs here at the end")
    parser.add_argument("--write", action="store_true", help="append the table to bench/RESULTS.md")
    parser.add_argument("--json", action="store_true", help="print each mode's figures as JSON at the end")
    parser.add_argument(
        "--no-calibration",
        action="store_true",
        help="skip measuring the machine's speed first (bench/runner_bench.py)",
    )
    args = parser.parse_args()
    # SIGTERM stops the run like Ctrl-C: the triggerers, the source and the databases are cleaned up
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    results: dict[str, Result] = {}
    broke: dict[str, str] = {}
    speed = None if args.no_calibration else machine_speed()
    with migrated_template("st_bench_template", args.keep_logs) as (server_dsn, template):
        for mode in args.modes.split(","):
            try:
                results[mode] = run_mode(mode, args, server_dsn, template)
            except TimeoutError as err:  # where a mode breaks at this size is a result too
                console.print(f"[red]{mode} did not get through: {err}[/]")
                broke[mode] = str(err)
    markdown = report(results, args) if results else ""
    markdown += "".join(f"\n\n{mode} did not get through: {why}" for mode, why in broke.items())
    if args.write:
        append_result("Triggerer", "bench.triggerer_bench", markdown)
    if args.json:
        print(
            json.dumps(
                {mode: figures(r) for mode, r in results.items()}
                | {"broke": broke, "machine_us_per_coroutine": speed},
                indent=1,
            )
        )
    return 0


def machine_speed() -> int | None:
    """This machine's speed before the run, in the unit bench/RESULTS.md quotes: the runner's CPU for each
    new coroutine up to its first poll (``bench/runner_bench.py``, 2,000 coroutines, ours). The same kind of
    machine moved between about 140 and 780 us within days, and failover and start times at 50,000 waiters
    move with it: a figure is read against the speed it was taken at."""
    argv = [sys.executable, "-m", "bench.runner_bench", "--coroutines", "2000", "--rounds", "1", "--json"]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        console.print(
            f"[yellow]the machine's speed was not measured (exit {done.returncode}): "
            f"{done.stderr.strip()[-300:]}[/]"
        )
        return None
    speed = int(json.loads(lines[-1])["smart"])
    console.print(
        f"machine speed: {speed} us of runner CPU per new coroutine (bench/runner_bench.py; lower is faster)"
    )
    return speed


def figures(result: Result) -> dict[str, Any]:
    """The run's figures under the names the issue tracker and the docs use."""
    return {
        "waiters": result.waiters,
        "unique": result.unique,
        "polls_per_interval": round(result.polls_per_interval),
        "start_to_all_polling_s": result.start_to_all_polling_s,
        "kill_waits": result.kill_waits,
        "kill_to_reassigned_s": result.kill_to_reassigned_s,
        "kill_to_all_polling_s": result.kill_to_all_polling_s,
        "takeover_flip_resume_p50_s": result.pct(0.5, result.takeover_resume),
        "takeover_flip_resume_p99_s": result.pct(0.99, result.takeover_resume),
        "term_waits": result.term_waits,
        "term_to_reassigned_s": result.term_to_reassigned_s,
        "term_to_all_polling_s": result.term_to_all_polling_s,
        "term_exit_s": result.term_exit,
        "resume_p50_s": result.pct(0.5),
        "resume_p99_s": result.pct(0.99),
        "rss_mb_per_instance": round(result.rss_mb_per_instance),
        "waiting_cpu_s_per_30s": result.steady.cpu,
    }


def append_result(title: str, module: str, body: str) -> None:
    """Append a dated section with the exact command and its result to bench/RESULTS.md."""
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    command = f"python -m {module} " + " ".join(sys.argv[1:])
    with (ROOT / "bench" / "RESULTS.md").open("a") as out:
        out.write(f"\n## {title}: {stamp}\n\n`{command}`\n\n{body}\n")


if __name__ == "__main__":
    sys.exit(main())
