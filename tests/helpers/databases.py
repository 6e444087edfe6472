"""Throwaway databases on the test server: a migrated Airflow template, cloned per test."""

from __future__ import annotations

import itertools
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager

from devkit.pgserver import create_database, drop_database

__all__ = ["create_database", "database", "drop_database", "unique_name"]

_counter = itertools.count()


def unique_name(prefix: str) -> str:
    # pid + random: several test sessions (and CI) may share one server.
    return f"{prefix}_{os.getpid()}_{secrets.token_hex(3)}_{next(_counter)}"


@contextmanager
def database(server_dsn: str, prefix: str, template: str | None = None) -> Iterator[str]:
    name = unique_name(prefix)
    dsn = create_database(server_dsn, name, template)
    try:
        yield dsn
    finally:
        drop_database(server_dsn, name)
