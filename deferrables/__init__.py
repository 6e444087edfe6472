"""Deferrable sensors for DAG authors: they hand their wait to an async trigger at once."""

from deferrables.table_load import TableLoadSensor

__all__ = ["TableLoadSensor"]
