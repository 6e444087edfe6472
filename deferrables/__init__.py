"""Deferrable sensors for DAG authors: they hand their wait to an async trigger at once."""

from deferrables.asset_event import AssetEventSensor
from deferrables.external_dag import ExternalDagSensor
from deferrables.http import HttpConditionSensor
from deferrables.sql_condition import SqlConditionSensor
from deferrables.table_load import TableLoadSensor

__all__ = [
    "AssetEventSensor",
    "ExternalDagSensor",
    "HttpConditionSensor",
    "SqlConditionSensor",
    "TableLoadSensor",
]
