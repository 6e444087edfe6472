"""The runner's CPU for each coroutine it creates, up to the coroutine's first poll: Airflow's create loop
against ours, in one process, alternately, on the same workloads.

    .venv/bin/python -m bench.runner_bench --coroutines 5000 --rounds 3

What a takeover or a start of thousands costs the runner for each new coroutine, without the supervisor,
the database or a second instance on the CPU beside it (the triggerer bench measures those together, with
a spread of seconds on 2 cores). Each round creates ``--coroutines`` coroutines of the bench's HTTP
trigger (``bench.triggers.PollTrigger``, a task each) in a ``SmartTriggerRunner`` on uvloop, once with
Airflow's ``TriggerRunner.create_triggers`` and its kwargs decoding (with our collector settings around
it, as ours has), once with ours, and counts the
runner thread's CPU (``time.thread_time``) until the HTTP source (a process of its own) has answered
every first poll. Airflow's loop gives every coroutine greenback's portal, as stock Airflow does; ours
gives none to a trigger that says it makes no sync SDK call (``calls_sync_sdk = False``, as the bench's
trigger does; docs/design.md, runner: Greenback's portal). The rest of a coroutine's start (Airflow's
``run_trigger``, its first
request through aiohttp) is the same code in both.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any

from cryptography.fernet import Fernet

# before Airflow is imported: a private home, and a key for the kwargs it encrypts
if "AIRFLOW_HOME" not in os.environ:  # a private one, removed at exit
    os.environ["AIRFLOW_HOME"] = tempfile.mkdtemp(prefix="smart-triggerer-runner-bench-")
    atexit.register(shutil.rmtree, os.environ["AIRFLOW_HOME"], ignore_errors=True)
os.environ.setdefault("AIRFLOW__CORE__FERNET_KEY", Fernet.generate_key().decode())
os.environ.setdefault("AIRFLOW__CORE__LOAD_EXAMPLES", "False")

from airflow.executors.workloads.trigger import RunTrigger
from airflow.jobs.triggerer_job_runner import TriggerRunner
from airflow.models.trigger import Trigger
from rich.console import Console
from rich.table import Table

from bench.triggers import PollTrigger
from smart_triggerer.runner.trigger_runner import (
    SmartTriggerRunner,
    batch_log_channel,
    prepare_runner_process,
)
from tests.helpers.task_instances import task_instance_dto
from triggers.http import shared_request

console = Console()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ("airflow", "smart")


def workloads(url: str, count: int, round_no: int) -> list[RunTrigger]:
    """``count`` task triggers of the bench's HTTP trigger, keys of their own in each round."""
    made = []
    for n in range(count):
        ti = task_instance_dto(
            id=str(uuid.uuid4()),
            dag_id="bench_runner",
            run_id=f"run_{round_no}",
            task_id=f"wait_{n}",
            dag_version_id=str(uuid.uuid4()),
        )
        # as a deferral stores them: our identity marker included
        _, kwargs = PollTrigger(url, f"r{round_no}-{n}", poll_interval=3600.0).serialize()
        made.append(
            RunTrigger(
                id=n + 1,
                classpath="bench.triggers.PollTrigger",
                encrypted_kwargs=Trigger.encrypt_kwargs(kwargs),
                ti=ti,
            )
        )
    return made


SOURCE = """
import sys, threading
from bench.source import PollSource
source = PollSource()
source.start()
print(source.port, flush=True)
sys.stdin.read()  # until the bench closes it
"""


def start_source() -> tuple[subprocess.Popen[str], str]:
    """The HTTP source in a process of its own: its work is not counted as the runner's."""
    process = subprocess.Popen(
        [sys.executable, "-c", SOURCE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    assert process.stdout is not None
    port = process.stdout.readline().strip()
    if not port.isdigit():
        process.kill()
        raise RuntimeError("the HTTP source did not start")
    return process, f"http://127.0.0.1:{port}"


async def polls(url: str) -> int:
    async with shared_request("GET", f"{url}/polls") as response:
        return int((await response.json())["polls"])


async def one_round(mode: str, url: str, batch: list[RunTrigger]) -> tuple[float, float]:
    """(runner CPU seconds, wall seconds) from the first create to the last first poll answered."""
    runner = SmartTriggerRunner()
    runner.job_id = 1
    runner.log_channel = batch_log_channel()
    runner.get_trigger_by_classpath("bench.triggers.PollTrigger")  # imported before: not what is measured
    polled = await polls(url)
    runner.to_create.extend(batch)
    cpu, wall = time.thread_time(), time.monotonic()
    if mode == "airflow":
        with runner.freezer.start(len(batch)):  # the collector settings of ours, to compare the loops alone
            await TriggerRunner.create_triggers(runner)
    else:
        await runner.create_triggers()
    while await polls(url) - polled < len(batch):
        await asyncio.sleep(0.02)
    runner._send_log_lines()
    measured = time.thread_time() - cpu, time.monotonic() - wall
    for details in runner.triggers.values():
        details["task"].cancel()
    await asyncio.gather(*(d["task"] for d in runner.triggers.values()), return_exceptions=True)
    return measured


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--coroutines", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each mode, alternating")
    parser.add_argument(
        "--json",
        action="store_true",
        help="print each mode's median microseconds a coroutine as JSON at the end",
    )
    args = parser.parse_args(argv)
    import uvloop

    as_the_runner_starts()
    source, url = start_source()
    cpu: dict[str, list[float]] = {mode: [] for mode in MODES}
    wall: dict[str, list[float]] = {mode: [] for mode in MODES}
    for round_no in range(args.rounds):
        for mode in MODES if round_no % 2 == 0 else reversed(MODES):
            batch = workloads(url, args.coroutines, round_no * len(MODES) + MODES.index(mode))
            spent, took = uvloop.run(one_round(mode, url, batch))
            cpu[mode].append(spent)
            wall[mode].append(took)
            console.print(
                f"  round {round_no + 1} {mode}: {spent / args.coroutines * 1e6:.0f} us of runner "
                f"CPU a coroutine, {took:.2f} s for {args.coroutines}"
            )
    source.communicate("")
    report(cpu, wall, args.coroutines)
    if args.json:
        print(
            json.dumps({mode: round(statistics.median(cpu[mode]) / args.coroutines * 1e6) for mode in MODES})
        )
    return 0


def as_the_runner_starts() -> None:
    """Log lines as the runner makes them, JSON for its supervisor in batches
    (smart_triggerer/runner/trigger_runner.py), into /dev/null: what they cost the runner is counted, and
    nothing is printed. Spans as the runner makes them (none, untraced), and its collector settings."""
    from airflow.sdk.log import configure_logging, reset_logging

    reset_logging()
    configure_logging(
        json_output=True,
        output=open(os.devnull, "wb", buffering=0),  # noqa: SIM115
        sending_to_supervisor=True,
    )
    prepare_runner_process()


def report(cpu: dict[str, list[float]], wall: dict[str, list[float]], count: int) -> None:
    per: dict[str, Any] = {mode: statistics.median(cpu[mode]) / count * 1e6 for mode in MODES}
    table = Table(title=f"runner CPU per new coroutine, up to its first poll ({count} a round, median)")
    for column in ("", "Airflow's create loop", "ours", "ratio"):
        table.add_column(column, justify="right")
    table.add_row(
        "CPU a coroutine (us)",
        f"{per['airflow']:.0f}",
        f"{per['smart']:.0f}",
        f"{per['smart'] / per['airflow']:.2f}",
    )
    table.add_row(
        "wall time a round (s)",
        f"{statistics.median(wall['airflow']):.2f}",
        f"{statistics.median(wall['smart']):.2f}",
        f"{statistics.median(wall['smart']) / statistics.median(wall['airflow']):.2f}",
    )
    console.print(table)


if __name__ == "__main__":
    sys.exit(main())
