"""What every part of the chaos run shares: classpaths, table names, fault kinds, log marks."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]  # the repository
TABLE, FLAG, HTTP, POISON, TEAM, CONSUME = "table", "flag", "http", "poison", "team", "consume"
CLASSPATHS = {
    TABLE: "triggers.table_load.TableLoadTrigger",
    FLAG: "triggers.sql_condition.SqlConditionTrigger",
    HTTP: "bench.triggers.PollTrigger",
    POISON: "tests.helpers.chaos_triggers.SourcePollTrigger",
    TEAM: "tests.helpers.chaos_triggers.TeamSourcePollTrigger",  # its event says which team's env ran it
    CONSUME: "tests.helpers.chaos_triggers.QueueTakeTrigger",  # takes a message its source hands out once
}
TEAM_MARK_ENV = "TEAM_MARK"  # set in a team instance's environment: the team's name
QUEUE_TABLE, TAKEN_TABLE = "chaos.queue", "chaos.queue_taken"
STATUS_TABLE = "meta.detail_process_table_status"
LOAD_CHANNEL, FLAG_CHANNEL, ASSET_CHANNEL = "table_loads", "flags", "status_rows"
FLAG_SQL = "SELECT value FROM chaos.flags WHERE name = $1"
FAULT_KINDS = (
    "sigkill",
    "sigstop",
    "sigterm",
    "join",
    "leave",
    "pg_restart",
    "freeze",
    "partition",
    "db_error",
    "clock_step",
    "poison",
    "nul_extra",
    "lag",
    "wedge",
    "log_hang",
    "consume",
)
ONCE = ("poison", "nul_extra")  # faults of the workload: once per run
POISON_MEMBERS = 2  # tasks that share the poison event (one group)
NUL_KEY, NUL_ASSET = "nul-extra", "chaos://extra/nul"
# what jsonb refuses: the poison event's payload and the watcher event's extra carry it
NUL_NOTE = "a NUL \x00 byte"
REJECTED_MARK = "could not be stored"  # the cause the supervisor fails a poison event's tasks with
SINK, SINK_SECRET_ENV, BRIDGE_SOURCE = "sink", "CHAOS_SINK_SECRET", "chaos"
ASSET_DAG = "chaos_assets"
STARTED_MARK = "smart triggerer started"
Log = Callable[[str], None]


def team_of(process: str) -> str | None:
    """The team of an instance slot or process (``alpha-2``, ``alpha-2.3``); None for ``smart-N``."""
    prefix = process.split("-", 1)[0]
    return None if prefix == "smart" else prefix
