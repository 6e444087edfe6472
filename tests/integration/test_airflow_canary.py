"""Canary: every statement of ours that reads Airflow's tables still compiles against Airflow's schema.

Each named query of smart_triggerer/db/sql/queries.sql is PREPAREd (parsed and analysed, not run) on a freshly
migrated metadata database: a column or table an Airflow release renamed or dropped fails here with
PostgreSQL's message naming it ("column t.queue does not exist"), before any deployment meets it.
"""

from __future__ import annotations

import re

import psycopg2
import pytest

from devkit.devstack import AirflowConfig
from smart_triggerer.db.store import queries

# what an Airflow schema change gives; other errors (a parameter whose type PREPARE cannot infer) are not it
SCHEMA_ERRORS = {"42703": "undefined column", "42P01": "undefined table", "42883": "undefined function"}
STATEMENT = re.compile(r"^\s*(SELECT|WITH|UPDATE|INSERT|DELETE)\b", re.IGNORECASE)
PARAMETER = re.compile(r"(?<!:):([A-Za-z_][A-Za-z0-9_]*)")


def positional(query: str) -> str:
    """``:name`` parameters as ``$n`` (the same name, the same number); ``::type`` casts stay."""
    numbers: dict[str, int] = {}
    return PARAMETER.sub(lambda m: f"${numbers.setdefault(m.group(1), len(numbers) + 1)}", query)


def schema_errors(dsn: str) -> dict[str, str]:
    """Query name -> PostgreSQL's message, for each statement that does not compile for a schema reason."""
    failed: dict[str, str] = {}
    with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
        for number, (name, query) in enumerate(queries().items()):
            if not STATEMENT.match(query):
                continue
            cur.execute("SAVEPOINT canary")
            try:
                cur.execute(f"PREPARE canary_{number} AS {positional(query)}")
            except psycopg2.Error as err:
                if err.pgcode in SCHEMA_ERRORS:
                    failed[name] = f"{SCHEMA_ERRORS[err.pgcode]}: {err.pgerror.splitlines()[0]}"
            cur.execute("ROLLBACK TO SAVEPOINT canary")
        conn.rollback()
    conn.close()
    return failed


@pytest.fixture
def migrated(airflow_config: AirflowConfig) -> str:
    """Airflow's schema and ours (as `smart-triggerer run` migrates it at start)."""
    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session

    from devkit.pgserver import sqlalchemy_url
    from smart_triggerer.db.store import Store

    engine = create_engine(sqlalchemy_url(airflow_config.database_dsn))
    with Session(engine) as session, session.begin():
        Store(session).migrate(shards=4)
    engine.dispose()
    return airflow_config.database_dsn


def test_every_query_compiles_against_airflows_schema(migrated: str) -> None:
    assert len(queries()) > 40
    assert schema_errors(migrated) == {}


def test_the_canary_names_a_column_airflow_renamed(migrated: str) -> None:
    with psycopg2.connect(migrated) as conn, conn.cursor() as cur:
        cur.execute("ALTER TABLE trigger RENAME COLUMN queue TO trigger_queue")
    conn.close()
    failed = schema_errors(migrated)
    assert failed, "a renamed column went unnoticed"
    assert all("queue" in message for message in failed.values()), failed
