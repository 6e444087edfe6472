"""Bad bridge input fails at parse time with a message naming the argument or the mapping entry."""

from __future__ import annotations

import pytest

from dataset_bridge import TableStatusTrigger
from dataset_bridge.task_success import MappingError, TaskMapping, success_key


def test_status_trigger_round_trips_and_shares_one_stream_per_status_table() -> None:
    a = TableStatusTrigger(conn_id="warehouse", table_name="dds.h_user")
    b = TableStatusTrigger(conn_id="warehouse", table_name="dds.s_user")
    classpath, kwargs = a.serialize()
    assert classpath == "dataset_bridge.status_table.TableStatusTrigger"
    assert TableStatusTrigger(**kwargs).serialize() == (classpath, kwargs)
    assert a.shared_stream_key() == b.shared_stream_key()
    other = TableStatusTrigger(conn_id="warehouse", table_name="dds.h_user", status_table="meta.other")
    assert other.shared_stream_key() != a.shared_stream_key()


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"conn_id": "", "table_name": "t"}, "conn_id"),
        ({"conn_id": "w", "table_name": ""}, "table_name"),
        ({"conn_id": "w", "table_name": "t", "status_table": "meta.x; drop table y"}, "status_table"),
        ({"conn_id": "w", "table_name": "t", "id_column": "id desc"}, "id_column"),
        ({"conn_id": "w", "table_name": "t", "start_from": "yesterday"}, "start_from"),
        ({"conn_id": "w", "table_name": "t", "poll_interval": 0}, "poll_interval"),
        ({"conn_id": "w", "table_name": "t", "notify_channel": "a-b"}, "notify_channel"),
    ],
)
def test_status_trigger_rejects_bad_arguments_naming_them(kwargs: dict[str, object], argument: str) -> None:
    with pytest.raises(ValueError, match=argument):
        TableStatusTrigger(**kwargs)  # type: ignore[arg-type]


def test_mapping_parses_names_and_uris() -> None:
    mapping = TaskMapping.parse({"etl.load_users": ["warehouse://dds/h_user", "users"], "etl.load_x": ["x"]})
    assert mapping.entries == {
        ("etl", "load_users"): ("warehouse://dds/h_user", "users"),
        ("etl", "load_x"): ("x",),
    }
    assert mapping.names() == ["etl.load_users", "etl.load_x"]


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({}, "expected a mapping"),
        (["etl.load"], "expected a mapping"),
        ({"etl_load": ["a"]}, "'etl_load' is not 'dag_id.task_id'"),
        ({"etl.load": []}, "'etl.load' must map to a non-empty list"),
        ({"etl.load": [""]}, "'etl.load' must map to a non-empty list"),
        # a comma-separated string would silently be one asset named "a, b"
        (
            {"etl.load": "a, b"},
            r"'etl.load' must map to a non-empty list .*got str 'a, b' \(write \['a, b'\]\)",
        ),
        ({"etl.load": {"uri": "a"}}, "'etl.load' must map to a non-empty list .*got dict"),
    ],
)
def test_mapping_errors_name_the_entry(raw: object, message: str) -> None:
    with pytest.raises(MappingError, match=message):
        TaskMapping.parse(raw, source="bridge.yaml")


def test_mapping_file_errors_name_the_file(tmp_path: object) -> None:
    with pytest.raises(MappingError, match=r"missing\.yaml"):
        TaskMapping.load(f"{tmp_path}/missing.yaml")


def test_success_key_names_every_part_of_a_try() -> None:
    assert success_key("etl", "load", "manual__1", -1, 2) == "task/etl/load/manual__1/-1/2"


def test_status_prints_a_readable_table_not_python_values(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from dataset_bridge.cli import render_status

    monkeypatch.setenv("COLUMNS", "200")

    render_status(
        {
            "initialized": True,
            "emitted": {},
            "horizons": {},
            "requeued": 0,
            "reconciled": {},
            "recent_decisions": [],
            "backlog": None,
            "held_back": 0,
            "watcher_events": None,
            "watermarks": [],
        }
    )
    out = capsys.readouterr().out
    assert "{}" not in out and "None" not in out
    assert "successes waiting to be bridged" in out and "(pass --mapping)" in out
    assert "reconciler: re-queued / cleared / unconsumable" in out and "0 / 0 / 0" in out
    render_status(
        {
            "initialized": True,
            "emitted": {"task_success": 3},
            "horizons": {},
            "reconciled": {"requeued": 2, "cleared": 1},
            "recent_decisions": [],
            "backlog": 4,
            "held_back": 1,
            "watcher_events": 7,
            "watermarks": [],
        }
    )
    out = capsys.readouterr().out
    assert "2 / 1 / 0" in out and "task_success" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--batch", "1001"], "--batch: must be 1-1000, got 1001"),
        (["--batch", "0"], "--batch: must be 1-1000, got 0"),
        (["--concurrency", "0"], "--concurrency: must be 1-64, got 0"),
        (["--concurrency", "x"], "--concurrency: must be a whole number, got 'x'"),
    ],
)
def test_relay_options_that_would_dead_letter_or_hang_are_refused(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from dataset_bridge.cli import build_parser

    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["relay", "--routes", "routes.yaml", *argv])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err
