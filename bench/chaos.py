"""Jepsen-style chaos run of the smart triggerer: faults for minutes, then a proof from the database.

    .venv/bin/python -m bench.chaos --minutes 20 --waiters 2000 --instances 3 --write
    .venv/bin/python -m bench.chaos --quick --seed 7          # the short profile the test suite runs

A private PostgreSQL (always: it is restarted and its clock stepped during the run; libfaketime is
installed with apt-get when missing), a migrated Airflow metadata database with an audit trigger, a
two-team fleet (``[core] multi_team``): ``--instances`` smart triggerers of no team and two of each team
(``--team-name``), each through a TCP proxy of its own, its sessions named after it, each uploading its
trigger logs to a remote store of its own; the dataset bridge's outbox and relay to an inbox stub; seeded
deferred waiters (40% duplicates, push and pull status-table waits, SQL flags, HTTP keys, identical waits
of both teams and of no team whose event says which team's environment ran it, consume-once waits whose
source hands each message out once, some with a trigger_timeout due during the run) and status-table
asset watchers. For ``--minutes`` a seeded schedule of faults runs while conditions flip and status rows
arrive: SIGKILL, SIGSTOP past the lease, SIGTERM, a fourth instance joining and leaving, PostgreSQL
restarts, an instance frozen for good inside a transaction (then killed and replaced), a network
partition between an instance and PostgreSQL, a DB error right after a lease renewal, a forward step of
the database's clock, a trigger runner stopped alone past ``runner_stall_seconds`` (a wedged event loop:
its instance must hand every shard over), an instance's remote log store hanging for a few leases (its
leases must go on renewing), consume-once messages queued and one instance SIGTERMed as they are taken,
one poison event and one asset event whose extra holds a ``\u0000``. Then the checker proves from the
databases that every waiter resumed exactly once with its own event (a team's wait with its own team's
mark, a consume-once wait with its own message, each message taken once) or timed out no earlier than
due (the poison group: failed once with the cause), nothing else failed, every SUCCESS row
made exactly one asset event and the relay delivered it (the ``\u0000`` one dead-lettered alone), and no
wait stalled past ``lease + poll interval + 3 s`` (the clock's steps and PostgreSQL's downtime taken
out; ``runner_stall_seconds`` more across a wedged runner). Exit status 1 when any check fails. The
shared implementation is ``tests/helpers/chaos/``.
"""

from __future__ import annotations

import argparse
import atexit
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
_HOME = Path(tempfile.mkdtemp(prefix="smart-triggerer-chaos-home-"))
atexit.register(shutil.rmtree, _HOME, ignore_errors=True)  # also when imported without a run
os.environ.setdefault("AIRFLOW_HOME", str(_HOME / "airflow"))
os.environ.setdefault("AIRFLOW__CORE__LOAD_EXAMPLES", "False")
# the harness itself seeds through Airflow's ORM: keep its info logs out of the progress output
os.environ.setdefault("AIRFLOW__LOGGING__LOGGING_LEVEL", "WARNING")
if not os.environ.get("AIRFLOW__CORE__FERNET_KEY"):
    from cryptography.fernet import Fernet

    os.environ["AIRFLOW__CORE__FERNET_KEY"] = Fernet.generate_key().decode()

from bench.triggerer_bench import append_result  # noqa: E402
from tests.helpers.chaos import Profile, Report, run_chaos  # noqa: E402

console = Console()


def profile_from(args: argparse.Namespace) -> Profile:
    """The full profile, or ``--quick``; explicit options override either."""
    profile = Profile.quick(args.seed) if args.quick else Profile(seed=args.seed)
    overrides = {
        k: v
        for k, v in (("minutes", args.minutes), ("waiters", args.waiters), ("instances", args.instances))
        if v is not None
    }
    return Profile(**{**profile.__dict__, **overrides})


def render(report: Report) -> str:
    """Print the figures as a table; return them as markdown for RESULTS.md."""
    table = Table(title="smart triggerer under chaos: " + ("all checks passed" if report.ok else "FAILED"))
    table.add_column("figure")
    table.add_column("value")
    lines = ["| figure | value |", "|---|---|"]
    for label, value in report.figures:
        table.add_row(label, value)
        lines.append(f"| {label} | {value} |")
    console.print(table)
    verdict = "all checks passed" if report.ok else f"**{len(report.violations)} violations**"
    lines += ["", f"Result: {verdict}."]
    lines += [f"- {v}" for v in report.violations[:20]]
    return "\n".join(lines)


def progress(line: str) -> None:
    console.print(line, markup=False, highlight=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=None, help="replay a run (default: a fresh random seed)")
    parser.add_argument("--minutes", type=float, default=None, help="length of the chaos phase (20)")
    parser.add_argument("--waiters", type=int, default=None, help="seeded deferred waiters (2000)")
    parser.add_argument("--instances", type=int, default=None, help="smart triggerer instances (3)")
    parser.add_argument("--quick", action="store_true", help="the short profile: 2.25 minutes, 300 waiters")
    parser.add_argument(
        "--keep-logs",
        type=Path,
        default=None,
        help="copy the instances' logs to this directory before the temp dir is removed",
    )
    parser.add_argument("--write", action="store_true", help="append the table to bench/RESULTS.md")
    args = parser.parse_args()
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1, 2**31)
    console.print(f"[bold]chaos run, seed {args.seed}[/] (replay with --seed {args.seed})")
    try:
        report = run_chaos(profile_from(args), log=progress, keep_logs=args.keep_logs)
    finally:
        shutil.rmtree(_HOME, ignore_errors=True)
    markdown = render(report)
    if not report.ok:
        print(report.text(limit=100))
    elif report.notes:
        print("\n".join(f"note: {n}" for n in report.notes))
    if args.write:
        append_result("Chaos", "bench.chaos", markdown)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
