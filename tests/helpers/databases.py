"""Throwaway databases on the test server: a migrated Airflow template, cloned per test."""

from __future__ import annotations

import itertools
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg2
from psycopg2 import sql

from triggerer.pgserver import with_database

_counter = itertools.count()


def unique_name(prefix: str) -> str:
    # pid + random: several test sessions (and CI) may share one server.
    return f"{prefix}_{os.getpid()}_{secrets.token_hex(3)}_{next(_counter)}"


def execute_admin(server_dsn: str, statement: sql.Composable) -> None:
    conn = psycopg2.connect(with_database(server_dsn, "postgres"))
    try:
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute(statement)
    finally:
        conn.close()


def create_database(server_dsn: str, name: str, template: str | None = None) -> str:
    statement = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
    if template:
        statement = sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
            sql.Identifier(name), sql.Identifier(template)
        )
    execute_admin(server_dsn, statement)
    return with_database(server_dsn, name)


def drop_database(server_dsn: str, name: str) -> None:
    execute_admin(server_dsn, sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


@contextmanager
def database(server_dsn: str, prefix: str, template: str | None = None) -> Iterator[str]:
    name = unique_name(prefix)
    dsn = create_database(server_dsn, name, template)
    try:
        yield dsn
    finally:
        drop_database(server_dsn, name)
