"""Memory of an instance that takes a peer's shards over and gives them back, again and again.

A big start freezes what lives at its end (``smart_triggerer/runner/collector.py``): if what a takeover froze
stayed behind once the shards went back, each takeover would add to the instance's memory for good. Two smart
instances share the waits; the peer is stopped (SIGTERM: the survivor takes every shard) and started
again (the survivor hands half back), ``--takeovers`` times. After each round, once every wait polls
again, the survivor's memory is read (PSS and RSS of supervisor and runner). The goal: after the last
round within 10% of after the first.

    python -m bench.heap_ratchet_bench --waiters 5000 --takeovers 20 [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from dataclasses import dataclass, field

import psutil
from rich.console import Console
from rich.table import Table

from bench.source import PollSource
from bench.triggerer_bench import (
    Waits,
    bench_config,
    launch_instance,
    machine_speed,
    migrated_template,
    seed,
    settled,
)
from devkit.devstack import AirflowStack, Component
from devkit.pgserver import drop_database
from tests.helpers.waiting import rows

console = Console()
GOAL = 1.10  # the last round's memory over the first's


@dataclass
class Round:
    takeover_s: float  # from the peer's stop until every wait polled again (on the survivor)
    handback_s: float  # from the peer's start until every wait polled again (shared)
    pss_mb: float
    rss_mb: float


@dataclass
class Result:
    waiters: int
    unique: int
    rounds: list[Round] = field(default_factory=list)

    def ratio(self, attribute: str) -> float:
        first, last = getattr(self.rounds[0], attribute), getattr(self.rounds[-1], attribute)
        return round(last / first, 3) if first else float("nan")


def memory_mb(component: Component) -> tuple[float, float]:
    """(PSS, RSS) of the component's process tree, in MiB: PSS splits pages shared with the forked runner
    fairly; RSS counts them twice."""
    pss = rss = 0
    for process in component.tree():
        with contextlib.suppress(psutil.Error):
            info = process.memory_full_info()
            pss += info.pss
            rss += info.rss
    return pss / 2**20, rss / 2**20


def job_of(component: Component) -> int:
    return int(component.wait_for_log("smart triggerer started", 120).split("job_id=")[1].split()[0])


@dataclass
class Fleet:
    stack: AirflowStack
    survivor: tuple[Component, int]  # and its job id
    waits: Waits
    source: PollSource
    trigger_ids: list[int]


def one_round(fleet: Fleet, peer: Component, number: int) -> tuple[Component, Round]:
    """Stop the peer (SIGTERM), let the survivor run every wait, start a new peer, let it take its share
    back; then read the survivor's memory."""
    stack, survivor, waits, source, trigger_ids = (
        fleet.stack,
        fleet.survivor,
        fleet.waits,
        fleet.source,
        fleet.trigger_ids,
    )
    dsn = stack.config.database_dsn
    stopped_at = time.time()
    stack.retire(peer)
    takeover = waits.all_polling(source, stopped_at, trigger_ids)
    started_at = time.time()
    peer = launch_instance(stack, "smart", f"smart-peer-{number}", len(trigger_ids))
    peer.wait_for_log("took shards", timeout=120)
    settled(
        lambda: rows(dsn, "SELECT waiters FROM smart_triggerer.instance WHERE job_id = %s", survivor[1])[0][
            0
        ],
        180,
        "the survivor to hand half back",
    )
    waits.all_polling(source, time.time(), trigger_ids)
    handback = time.time() - started_at
    pss, rss = memory_mb(survivor[0])
    return peer, Round(takeover, handback, pss, rss)


def run(args: argparse.Namespace, server_dsn: str, template: str) -> Result:
    unique = round(args.waiters * (1 - args.duplicates))
    result = Result(args.waiters, unique)
    name, config = bench_config(
        "heap", server_dsn, template, {"AIRFLOW__SMART_TRIGGERER__LEASE_SECONDS": str(args.lease_seconds)}
    )
    source = PollSource()
    source.start()
    stack = AirflowStack(config)
    try:
        console.print(f"seeding {args.waiters} waiters on {unique} identities")
        trigger_ids = seed(config, source, args.waiters, unique, prefix="k", interval=args.interval)
        waits = Waits("smart", trigger_ids, unique, args)
        started = time.time()
        first = launch_instance(stack, "smart", "smart-survivor", args.waiters)
        survivor = (first, job_of(first))
        peer = launch_instance(stack, "smart", "smart-peer-0", args.waiters)
        console.print(
            f"  cold start: every wait polling after {waits.all_polling(source, started, trigger_ids):.1f}s"
        )
        fleet = Fleet(stack, survivor, waits, source, trigger_ids)
        for number in range(1, args.takeovers + 1):
            peer, done = one_round(fleet, peer, number)
            result.rounds.append(done)
            console.print(
                f"  round {number:2}: takeover {done.takeover_s:5.1f}s, hand-back "
                f"{done.handback_s:5.1f}s, survivor PSS {done.pss_mb:6.0f} MiB, "
                f"RSS {done.rss_mb:6.0f} MiB"
            )
    finally:
        stack.stop()
        with contextlib.suppress(Exception):
            drop_database(server_dsn, name)
    return result


def report(result: Result, speed: int | None) -> str:
    title = f"{result.waiters} waiters ({result.unique} distinct), {len(result.rounds)} takeovers"
    table = Table(title=title)
    for column in ("", "after round 1", f"after round {len(result.rounds)}", "ratio", "goal"):
        table.add_column(column)
    first, last = result.rounds[0], result.rounds[-1]
    table.add_row(
        "survivor PSS (MiB)",
        f"{first.pss_mb:.0f}",
        f"{last.pss_mb:.0f}",
        f"{result.ratio('pss_mb')}x",
        f"<= {GOAL}x",
    )
    table.add_row(
        "survivor RSS (MiB)", f"{first.rss_mb:.0f}", f"{last.rss_mb:.0f}", f"{result.ratio('rss_mb')}x", ""
    )
    console.print(table)
    peak = max(r.pss_mb for r in result.rounds)
    return (
        f"| survivor | after round 1 | after round {len(result.rounds)} | ratio | peak |\n"
        "|---|---|---|---|---|\n"
        f"| PSS (MiB) | {first.pss_mb:.0f} | {last.pss_mb:.0f} | {result.ratio('pss_mb')}x | "
        f"{peak:.0f} |\n"
        f"| RSS (MiB) | {first.rss_mb:.0f} | {last.rss_mb:.0f} | {result.ratio('rss_mb')}x | "
        f"{max(r.rss_mb for r in result.rounds):.0f} |\n\nmachine speed: {speed} us per coroutine"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--waiters", type=int, default=5000)
    parser.add_argument("--duplicates", type=float, default=0.4)
    parser.add_argument("--interval", type=float, default=5.0)
    parser.add_argument("--lease-seconds", type=float, default=8.0)
    parser.add_argument("--takeovers", type=int, default=20)
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object at the end")
    parser.add_argument("--no-calibration", action="store_true", help="skip measuring the machine's speed")
    args = parser.parse_args()
    speed = None if args.no_calibration else machine_speed()
    with migrated_template("st_bench_heap_template", None) as (server_dsn, template):
        result = run(args, server_dsn, template)
    report(result, speed)
    if args.json:
        print(
            json.dumps(
                {
                    "waiters": result.waiters,
                    "takeovers": len(result.rounds),
                    "pss_ratio_last_to_first": result.ratio("pss_mb"),
                    "rss_ratio_last_to_first": result.ratio("rss_mb"),
                    "pss_mb": [round(r.pss_mb) for r in result.rounds],
                    "takeover_s": [round(r.takeover_s, 1) for r in result.rounds],
                    "goal": GOAL,
                    "machine_us_per_coroutine": speed,
                }
            )
        )
    return 0 if result.ratio("pss_mb") <= GOAL else 1


if __name__ == "__main__":
    sys.exit(main())
