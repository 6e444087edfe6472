from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from deferrables import TableLoadSensor
from triggers import TableLoadTrigger
from triggers.identity import IdentityPolicy
from triggers.table_load import StatusTable, evaluate

T0 = dt.datetime(2026, 11, 22, 10, 0, tzinfo=dt.UTC)


def row(table: str, status: str, minutes: int = 0) -> dict[str, Any]:
    return {"table_name": table, "status": status, "at": T0 + dt.timedelta(minutes=minutes)}


def test_all_latest_success_is_done() -> None:
    state = evaluate([row("a", "SUCCESS"), row("b", "SUCCESS")], ["a", "b"], None)
    assert state.status == "success" and state.loaded == ["a", "b"]


def test_mid_load_and_missing_tables_keep_waiting() -> None:
    state = evaluate([row("a", "START")], ["a", "b"], None)
    assert state.status == "waiting"
    assert state.loading == ["a"] and state.missing == ["b"]
    assert state.message() == "waiting for loading: a; not loaded: b"


def test_latest_failed_fails() -> None:
    state = evaluate([row("a", "SUCCESS"), row("b", "FAILED")], ["a", "b"], None)
    assert state.status == "failed" and state.failed == ["b"]
    assert "FAILED for b" in state.message()


def test_success_older_than_since_does_not_count() -> None:
    since = T0 + dt.timedelta(minutes=5)
    assert evaluate([row("a", "SUCCESS", 1)], ["a"], since).missing == ["a"]
    assert evaluate([row("a", "SUCCESS", 6)], ["a"], since).status == "success"


def test_only_loads_newer_than_since_count_whatever_their_status() -> None:
    """Issue 11.2: yesterday's unfixed FAILED load must not fail today's wait."""
    since = T0 + dt.timedelta(minutes=5)
    old_failure = evaluate([row("a", "FAILED", 1)], ["a"], since)
    assert old_failure.status == "waiting" and old_failure.missing == ["a"]
    assert evaluate([row("a", "START", 1)], ["a"], since).missing == ["a"]
    assert evaluate([row("a", "FAILED", 6)], ["a"], since).status == "failed"
    assert evaluate([row("a", "FAILED", 6)], ["a"], None).status == "failed"


def test_a_group_listens_on_every_channel_of_its_members() -> None:
    single = TableLoadTrigger("wh", ["a"], notify_channel="loads")
    merged = TableLoadTrigger("wh", ["a"], notify_channel=["loads", "etl", "loads"])
    assert single.serialize()[1]["notify_channel"] == "loads"
    assert merged.serialize()[1]["notify_channel"] == ["etl", "loads"]
    with pytest.raises(ValueError, match="notify_channel"):
        TableLoadTrigger("wh", ["a"], notify_channel=["ok", "bad; NOTIFY"])


@pytest.mark.parametrize(
    ("argument", "value"),
    [
        ("status_table", "meta.t; DROP TABLE x"),
        ("status_table", "a.b.c"),
        ("table_column", "name)"),
        ("status_column", ""),
        ("time_column", 'at"'),
    ],
)
def test_identifiers_are_validated_naming_the_argument(argument: str, value: str) -> None:
    with pytest.raises(ValueError, match=argument):
        StatusTable(**{argument: value})


def test_query_quotes_identifiers_and_parameterises_values() -> None:
    query = StatusTable("meta.status", "tbl", "st", "ts").query()
    assert '"meta"."status"' in query and "ANY($1::text[])" in query


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"conn_id": ""}, "conn_id"),
        ({"required_tables": []}, "required_tables"),
        ({"required_tables": "dds.h_user"}, "required_tables"),
        ({"status_table": "x;y"}, "status_table"),
        ({"notify_channel": "load done"}, "notify_channel"),
        ({"since": "yesterday"}, "since"),
        ({"start_from_trigger": True, "deferrable": False}, "start_from_trigger"),
    ],
)
def test_sensor_rejects_bad_arguments_at_parse_time(kwargs: dict[str, Any], argument: str) -> None:
    arguments = {"task_id": "wait", "conn_id": "warehouse", "required_tables": ["dds.h_user"], **kwargs}
    with pytest.raises(ValueError, match=argument):
        TableLoadSensor(**arguments)


def test_trigger_serializes_and_identity_ignores_order_and_poll_interval() -> None:
    a = TableLoadTrigger("wh", ["b", "a", "a"], poll_interval=30)
    b = TableLoadTrigger("wh", ["a", "b"], poll_interval=300, notify_channel="loads")
    classpath, kwargs = a.serialize()
    assert classpath == "triggers.table_load.TableLoadTrigger"
    assert kwargs["required_tables"] == ["a", "b"]
    assert TableLoadTrigger(**kwargs).serialize() == (classpath, kwargs)
    policy = IdentityPolicy.with_extra([])
    assert policy.identity(classpath, kwargs, 1) == policy.identity(classpath, b.serialize()[1], 2)
    other = TableLoadTrigger("wh", ["a", "c"]).serialize()[1]
    assert policy.identity(classpath, kwargs, 1) != policy.identity(classpath, other, 3)


def test_start_from_trigger_defers_from_the_scheduler_with_a_templated_since() -> None:
    sensor = TableLoadSensor(
        task_id="wait",
        conn_id="wh",
        required_tables=["b", "a"],
        since="{{ data_interval_end }}",
        start_from_trigger=True,
        timeout=60,
    )
    args = sensor.start_trigger_args
    assert sensor.start_from_trigger and args is not None
    assert args.trigger_cls == "triggers.table_load.TableLoadTrigger"
    assert args.trigger_kwargs is not None
    assert args.trigger_kwargs["since"] == "{{ data_interval_end }}"
    assert args.timeout is not None and args.timeout.total_seconds() == 60
    assert "since" in TableLoadTrigger.template_fields
