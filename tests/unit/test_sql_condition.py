from __future__ import annotations

from typing import Any

import pytest

from deferrables import SqlConditionSensor
from triggers import SqlConditionTrigger
from triggers.identity import IdentityPolicy


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"success": lambda v: v}, "success"),
        ({"failure": len}, "failure"),
        ({"sql": " "}, "sql"),
        ({"conn_id": ""}, "conn_id"),
        ({"parameters": "abc"}, "parameters"),
        ({"failure_sql": ""}, "failure_sql"),
    ],
)
def test_bad_arguments_fail_at_parse_time_naming_them(kwargs: dict[str, Any], argument: str) -> None:
    arguments = {"task_id": "wait", "conn_id": "warehouse", "sql": "SELECT true", **kwargs}
    with pytest.raises(ValueError, match=argument):
        SqlConditionSensor(**arguments)


def test_identity_is_the_query_and_its_values_not_the_interval() -> None:
    policy = IdentityPolicy.with_extra([])
    classpath, a = SqlConditionTrigger("wh", "SELECT $1", parameters=[1], poll_interval=5).serialize()
    b = SqlConditionTrigger("wh", "SELECT $1", parameters=[1], poll_interval=500).serialize()[1]
    c = SqlConditionTrigger("wh", "SELECT $1", parameters=[2]).serialize()[1]
    assert policy.identity(classpath, a, 1) == policy.identity(classpath, b, 2)
    assert policy.identity(classpath, a, 1) != policy.identity(classpath, c, 3)


def test_start_from_trigger_carries_the_templated_query() -> None:
    sensor = SqlConditionSensor(
        task_id="wait",
        conn_id="wh",
        sql="SELECT CAST($1 AS text)::date <= now()",
        parameters=["{{ ds }}"],
        start_from_trigger=True,
    )
    args = sensor.start_trigger_args
    assert sensor.start_from_trigger and args is not None and args.trigger_kwargs is not None
    assert args.trigger_kwargs["parameters"] == ["{{ ds }}"]
    assert set(SqlConditionTrigger.template_fields) >= {"sql", "parameters"}
