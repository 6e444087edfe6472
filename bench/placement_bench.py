"""Placement that follows load: a fleet of smart triggerers at steady state, one slowed, a join, a leave.

    .venv/bin/python -m bench.placement_bench --json

Three instances (the last with twice the capacity of the others) run ``--waiters`` deferred task
instances over ``--unique`` distinct waits (the bench's HTTP poll trigger). Phases, each printed as
per-instance load over time (groups / capacity, shards, runner lag, whether it takes shards):

1. **steady**: once every group runs and no shard has moved for a while, ``max_over_share``: the largest
   groups / capacity-weighted fair share over the instances, sampled for ``--steady-seconds``;
2. **slowed**: one of the smaller instances' runner gets a CPU quota of ``--quota`` times what it used
   while waiting (a cgroup's ``cpu.cfs_quota_us`` where this host lets the bench make one, else the same
   throttling emulated by stopping the process once its quota for the period is spent);
   ``shed_seconds``: from the moment the instance found its runner lag (p99, last 10 s) over
   ``max_loop_lag_ms`` until it is back under it (``over_seconds``: from the quota until then, which
   depends on how hard the quota is). The quota is then lifted and the instance takes shards again
   after its hysteresis;
3. **join**: a fourth instance starts; ``moved_on_join`` shards changed owner, against the minimum (the
   shards the newcomer ends up with);
4. **leave**: the newcomer stops (SIGTERM); ``moved_on_leave`` against the minimum (the shards it held);
5. every wait's condition flips: ``lost`` waits not resumed, ``doubled`` resumes beyond one per task
   instance (the instances' resumed counters against the task instances).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench.source import PollSource
from bench.triggerer_bench import (
    _HOME,
    append_result,
    console,
    migrated_template,
    seed,
    start_instance,
    wait_until,
)
from devkit.devstack import AirflowConfig, AirflowStack, Component
from tests.helpers.chaos.databases import AUDIT_DDL, doubled_resumes, execute
from tests.helpers.databases import create_database, drop_database, unique_name
from tests.helpers.waiting import rows, settled_owners

SHARDS = 64


@dataclass
class Instance:
    name: str
    component: Component
    job_id: int
    capacity: int
    health: str


@dataclass
class Figures:
    waiters: int = 0
    unique: int = 0
    max_over_share: float = 0.0
    over_seconds: float | None = None  # from the quota until the instance found itself over its limit
    shed_seconds: float | None = None  # from then until it was back under it
    quota: str = ""
    moved_on_join: int = 0
    min_on_join: int = 0
    moved_on_leave: int = 0
    min_on_leave: int = 0
    lost: int = 0
    doubled: int = 0
    timeline: list[dict[str, Any]] = field(default_factory=list)


def owners(dsn: str) -> dict[int, int | None]:
    found = rows(
        dsn,
        "SELECT shard, CASE WHEN expires_at > clock_timestamp() THEN owner_job_id END "
        "FROM smart_triggerer.shard_lease WHERE queues = ''",
    )
    return {int(shard): owner for shard, owner in found}


def health(instance: Instance) -> dict[str, Any]:
    try:
        body: dict[str, Any] = httpx.get(f"{instance.health}/health", timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return {}
    return body


class Recorder:
    """Samples every instance's /health once a second into the timeline, and prints a line every 5 s."""

    def __init__(self, figures: Figures, fleet: list[Instance]) -> None:
        self.figures, self.fleet = figures, fleet
        self.phase = "start"
        self.started = time.monotonic()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Recorder:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.done.set()
        self.thread.join(10)

    def _run(self) -> None:
        printed = 0.0
        while not self.done.wait(1.0):
            at = round(time.monotonic() - self.started, 1)
            sample = {i.name: health(i) for i in list(self.fleet) if i.component.running()}
            self.figures.timeline.append(
                {
                    "t": at,
                    "phase": self.phase,
                    "instances": {
                        name: {
                            k: h.get(k)
                            for k in (
                                "groups",
                                "capacity",
                                "shards_owned",
                                "lag_recent_ms",
                                "lag_p99_ms",
                                "accepting",
                                "limit_groups",
                                "rss_mb",
                            )
                        }
                        for name, h in sample.items()
                    },
                }
            )
            if at - printed >= 5:
                printed = at
                console.print(
                    f"  t={at:6.1f}s {self.phase:7s} "
                    + "  ".join(
                        f"{name}: {h.get('groups', '?')}/{h.get('capacity', '?')} g, "
                        f"{h.get('shards_owned', '?')} sh, lag {h.get('lag_recent_ms', '?')} ms"
                        f"{'' if h.get('accepting', True) else ' SHEDDING'}"
                        for name, h in sample.items()
                    )
                )


def groups_running(fleet: list[Instance]) -> int:
    return sum(int(health(i).get("coroutines", 0)) for i in fleet if i.component.running())


def over_share(fleet: list[Instance]) -> float:
    """Largest groups / (total groups x capacity / total capacity) over the running instances."""
    loads = {i.name: (int(health(i).get("groups", 0)), i.capacity) for i in fleet if i.component.running()}
    total, capacity = sum(g for g, _ in loads.values()), sum(c for _, c in loads.values())
    return max(g / (total * c / capacity) for g, c in loads.values()) if total else 0.0


class CpuQuota:
    """Limit one process to ``share`` of one core: a cgroup v1 or v2 CPU quota where this host lets the
    bench make a cgroup, else the same throttling emulated (stopped for the rest of each 100 ms period
    once it used its share of it)."""

    PERIOD = 0.1

    def __init__(self, process: psutil.Process, share: float) -> None:
        self.process, self.share = process, share
        self.cgroup: Path | None = None
        self.done = threading.Event()
        self.thread: threading.Thread | None = None
        self.how = ""

    def __enter__(self) -> CpuQuota:
        for root, quota_file in (
            (Path("/sys/fs/cgroup/cpu"), "cpu.cfs_quota_us"),
            (Path("/sys/fs/cgroup"), "cpu.max"),
        ):
            with contextlib.suppress(OSError):
                group = root / f"smart-triggerer-bench-{os.getpid()}"
                group.mkdir()
                quota = int(self.share * self.PERIOD * 1e6)
                (group / quota_file).write_text(
                    str(quota) if quota_file == "cpu.cfs_quota_us" else f"{quota} {int(self.PERIOD * 1e6)}"
                )
                (group / "cgroup.procs").write_text(str(self.process.pid))
                self.cgroup, self.how = group, f"cgroup {quota_file} {quota} us per 100 ms"
                return self
            with contextlib.suppress(OSError):
                (root / f"smart-triggerer-bench-{os.getpid()}").rmdir()
        self.how = "emulated (SIGSTOP once the period's share is used)"
        self.thread = threading.Thread(target=self._emulate, daemon=True)
        self.thread.start()
        return self

    def _emulate(self) -> None:
        while not self.done.is_set():
            period_end = time.monotonic() + self.PERIOD
            used_before = sum(self.process.cpu_times()[:2])
            while time.monotonic() < period_end and not self.done.is_set():
                time.sleep(0.005)
                if sum(self.process.cpu_times()[:2]) - used_before >= self.share * self.PERIOD:
                    self.process.send_signal(signal.SIGSTOP)
                    time.sleep(max(period_end - time.monotonic(), 0))
                    self.process.send_signal(signal.SIGCONT)
                    break

    def __exit__(self, *_: object) -> None:
        self.done.set()
        if self.thread is not None:
            self.thread.join(5)
            self.process.send_signal(signal.SIGCONT)
        if self.cgroup is not None:
            parent = self.cgroup.parent
            with contextlib.suppress(OSError, psutil.Error):
                (parent / "cgroup.procs").write_text(str(self.process.pid))
            with contextlib.suppress(OSError):
                self.cgroup.rmdir()


def runner_of(instance: Instance) -> psutil.Process:
    tree = instance.component.tree()
    return tree[1]


def cpu_rate(process: psutil.Process, seconds: float) -> float:
    before = sum(process.cpu_times()[:2])
    time.sleep(seconds)
    return float(sum(process.cpu_times()[:2]) - before) / seconds


def start(stack: AirflowStack, name: str, capacity: int, fleet: list[Instance]) -> Instance:
    component, job_id = start_instance(stack, "smart", name, capacity)
    instance = Instance(name, component, job_id, capacity, component.health_url(60))
    fleet.append(instance)
    return instance


def run(args: argparse.Namespace, server_dsn: str, template: str) -> Figures:
    figures = Figures(waiters=args.waiters, unique=args.unique)
    name = unique_name("st_placement")
    dsn = create_database(server_dsn, name, template)
    home = _HOME / "placement"
    settings = {
        "AIRFLOW__SMART_TRIGGERER__RESUME_HOLD_SECONDS": "0",
        "AIRFLOW__SMART_TRIGGERER__SHARDS": str(SHARDS),
        "AIRFLOW__SMART_TRIGGERER__MAX_LOOP_LAG_MS": str(args.max_loop_lag_ms),
        "AIRFLOW__TRIGGERER__JOB_HEARTBEAT_SEC": "5",
    }
    config = AirflowConfig(
        home=home / "airflow",
        database_dsn=dsn,
        dags_folder=home / "dags",
        fernet_key=os.environ["AIRFLOW__CORE__FERNET_KEY"],
        extra=settings,
    )
    config.home.mkdir(parents=True, exist_ok=True)
    source = PollSource()
    source.start()
    stack = AirflowStack(config)
    fleet: list[Instance] = []
    try:
        console.print(f"seeding {args.waiters} waiters on {args.unique} identities")
        trigger_ids = seed(config, source, args.waiters, args.unique, prefix="k", interval=args.interval)
        # every write of a task instance leaving DEFERRED: a double resume shows there, not in a counter
        execute(dsn, AUDIT_DDL)
        small = args.capacity
        for n, capacity in enumerate((small, small, 2 * small)):
            start(stack, f"i{n}", capacity, fleet)
        with Recorder(figures, fleet) as recorder:
            wait_until(lambda: groups_running(fleet) == args.unique, 900, "every group running", interval=1)
            settled_owners(dsn, quiet=10, timeout=300)
            recorder.phase = "steady"
            figures.max_over_share = measure_over_share(fleet, args.steady_seconds)
            console.print(f"  steady: max_over_share {figures.max_over_share:.3f}")
            recorder.phase = "slowed"
            slow_phase(figures, fleet[1], args)
            # easing back raises its limit a step per 10 s: moves until then are not the join's
            wait_until(
                lambda: health(fleet[1]).get("limit_groups", 0) is None,
                600,
                f"{fleet[1].name} back to its capacity",
                interval=1,
            )
            settled_owners(dsn, quiet=10, timeout=300)
            recorder.phase = "join"
            figures.moved_on_join, figures.min_on_join = join(stack, dsn, fleet, small)
            recorder.phase = "leave"
            figures.moved_on_leave, figures.min_on_leave = leave(dsn, fleet)
            recorder.phase = "flip"
            figures.lost, figures.doubled = flip_all(source, dsn, fleet, len(trigger_ids))
    finally:
        stack.stop()
        with contextlib.suppress(Exception):
            drop_database(server_dsn, name)
    return figures


def measure_over_share(fleet: list[Instance], seconds: float) -> float:
    worst, deadline = 0.0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        worst = max(worst, over_share(fleet))
        time.sleep(1)
    return worst


def slow_phase(figures: Figures, slowed: Instance, args: argparse.Namespace) -> None:
    runner = runner_of(slowed)
    # a whole poll interval: the polls come in bursts, and 10 s could miss one or catch two
    used = cpu_rate(runner, max(10.0, args.interval))
    share = max(args.quota * used, 0.02)
    with CpuQuota(runner, share) as quota:
        # the floor (0.02 of a core, what a cgroup quota can enforce here) may be more than --quota asks
        figures.quota = (
            f"{share:.3f} of a core ({share / max(used, 1e-9):.2f} x the {used:.3f} it used "
            f"waiting), {quota.how}"
        )
        console.print(f"  slowing {slowed.name}: {figures.quota}")
        began = time.monotonic()
        # how soon the lag passes the limit depends on the quota (a backlog that grows by the CPU the
        # runner lacks); what placement answers for is the time from there back under it
        wait_until(
            lambda: health(slowed).get("accepting") is False, 300, f"{slowed.name} shedding", interval=0.2
        )
        over = time.monotonic()
        figures.over_seconds = over - began
        console.print(
            f"  {slowed.name} over its lag limit and shedding {figures.over_seconds:.1f}s after the quota"
        )
        wait_until(
            lambda: float(health(slowed).get("lag_recent_ms", 1e9)) < args.max_loop_lag_ms,
            300,
            f"{slowed.name} back under its lag limit",
            interval=0.2,
        )
        figures.shed_seconds = time.monotonic() - over
        console.print(f"  shed_seconds {figures.shed_seconds:.1f} (back under its lag limit, from shedding)")
    wait_until(lambda: health(slowed).get("accepting") is True, 300, f"{slowed.name} taking shards again")


def join(stack: AirflowStack, dsn: str, fleet: list[Instance], capacity: int) -> tuple[int, int]:
    before = owners(dsn)
    newcomer = start(stack, "joiner", capacity, fleet)
    after = settled_owners(dsn, quiet=10, timeout=300)
    moved = sum(1 for shard, owner in after.items() if before.get(shard) != owner)
    minimum = sum(1 for owner in after.values() if owner == newcomer.job_id)
    console.print(f"  join: {moved} shards moved, minimum {minimum}")
    return moved, minimum


def leave(dsn: str, fleet: list[Instance]) -> tuple[int, int]:
    leaver = fleet[-1]
    before = settled_owners(dsn, quiet=5, timeout=300)
    leaver.component.signal(signal.SIGTERM)
    assert leaver.component.process is not None
    leaver.component.process.wait(60)
    after = settled_owners(dsn, quiet=10, timeout=300)
    moved = sum(1 for shard, owner in after.items() if before.get(shard) != owner)
    minimum = sum(1 for owner in before.values() if owner == leaver.job_id)
    console.print(f"  leave: {moved} shards moved, minimum {minimum}")
    return moved, minimum


def flip_all(source: PollSource, dsn: str, fleet: list[Instance], waiters: int) -> tuple[int, int]:
    source.flip("k")
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and deferred(dsn) > 0:
        time.sleep(1)
    lost = deferred(dsn)
    wait_until(lambda: resumed_total(dsn) >= waiters - lost, 60, "the resumes counted", interval=1)
    resumed = resumed_total(dsn)
    doubled = doubled_resumes(dsn)
    console.print(
        f"  flip: {waiters - lost} of {waiters} resumed, counters say {resumed}, {len(doubled)} written twice"
    )
    return lost, len(doubled)


def resumed_total(dsn: str) -> int:
    """Every instance's resumed counter, the stopped one's included (kept in its row)."""
    return int(rows(dsn, "SELECT coalesce(sum(resumed_total), 0) FROM smart_triggerer.instance")[0][0])


def deferred(dsn: str) -> int:
    return int(rows(dsn, "SELECT count(*) FROM task_instance WHERE state = 'deferred'")[0][0])


def report(figures: Figures) -> str:
    shed = "-" if figures.shed_seconds is None else f"{figures.shed_seconds:.1f}"
    over = "-" if figures.over_seconds is None else f"{figures.over_seconds:.1f}"
    lines = [
        "| figure | value | goal |",
        "|---|---|---|",
        f"| waiters / distinct waits | {figures.waiters} / {figures.unique} | |",
        f"| max_over_share (steady) | {figures.max_over_share:.3f} | <= 1.25 |",
        f"| over the lag limit after the quota (s) | {over} | |",
        f"| shed_seconds: from then back under it | {shed} | <= 30 |",
        f"| moved_on_join / minimum | {figures.moved_on_join} / {figures.min_on_join} | minimum |",
        f"| moved_on_leave / minimum | {figures.moved_on_leave} / {figures.min_on_leave} | minimum |",
        f"| lost / doubled | {figures.lost} / {figures.doubled} | 0 / 0 |",
    ]
    return "\n".join(lines) + f"\n\nCPU quota of the slowed instance's runner: {figures.quota}."


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--waiters", type=int, default=30_000)
    parser.add_argument("--unique", type=int, default=10_000)
    parser.add_argument("--interval", type=float, default=30.0)
    parser.add_argument("--capacity", type=int, default=6_000, help="of the two smaller instances")
    parser.add_argument("--steady-seconds", type=float, default=30.0)
    parser.add_argument(
        "--quota",
        type=float,
        default=0.5,
        help="the slowed runner's CPU quota, as a share of what it used while waiting",
    )
    parser.add_argument("--max-loop-lag-ms", type=float, default=1000.0)
    parser.add_argument("--keep-logs", metavar="DIR")
    parser.add_argument("--write", action="store_true", help="append the table to bench/RESULTS.md")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with migrated_template("st_placement_template", args.keep_logs) as (server_dsn, template):
        figures = run(args, server_dsn, template)
    markdown = report(figures)
    console.print(markdown)
    if args.write:
        append_result("Placement", "bench.placement_bench", markdown)
    if args.json:
        summary = {k: v for k, v in figures.__dict__.items() if k != "timeline"}
        print(json.dumps(summary | {"timeline_samples": len(figures.timeline)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
