"""What every part of the chaos run shares: classpaths, table names, fault kinds, log marks."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]  # the repository
TABLE, FLAG, HTTP, POISON = "table", "flag", "http", "poison"
CLASSPATHS = {
    TABLE: "triggers.table_load.TableLoadTrigger",
    FLAG: "triggers.sql_condition.SqlConditionTrigger",
    HTTP: "bench.triggers.PollTrigger",
    POISON: "tests.helpers.chaos_triggers.SourcePollTrigger",
}
STATUS_TABLE = "meta.detail_process_table_status"
LOAD_CHANNEL, FLAG_CHANNEL, ASSET_CHANNEL = "table_loads", "flags", "status_rows"
FLAG_SQL = "SELECT value FROM chaos.flags WHERE name = $1"
FAULT_KINDS = ("sigkill", "sigstop", "sigterm", "join", "leave", "pg_restart", "freeze", "partition",
               "db_error", "clock_step", "poison", "nul_extra", "lag", "wedge")
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
