"""Async triggers (asyncpg, aiohttp) and the identity contract: what a trigger waits on."""

from triggers.external_dag import ExternalDagTrigger
from triggers.http import HttpConditionTrigger
from triggers.sql_condition import SqlConditionTrigger
from triggers.table_load import TableLoadTrigger

__all__ = ["ExternalDagTrigger", "HttpConditionTrigger", "SqlConditionTrigger", "TableLoadTrigger"]
