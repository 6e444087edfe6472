"""The bridge's schema upgrades in place: a metadata database whose bridge tables an earlier release made
(each part's DDL in Python, run at its start) is migrated by this release's versioned migrations; its rows
are kept, and its schema ends up exactly as a new deployment's."""

from __future__ import annotations

import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session

from dataset_bridge import store
from devkit.devstack import AirflowConfig

ROOT = Path(__file__).resolve().parents[2]

# the releases whose bridge made its tables from Python: 0.1.0 (CHANGELOG.md), and the last commit before
# the bridge's migrations (its tables have every column 0.2.0's parts added)
EARLIER = {"0.1.0": "fe46614", "last-python-ddl": "fe47be0"}

# what the earlier release's three parts ran at their start, each its own DDL
EARLIER_START = """
import sys
from sqlalchemy import create_engine
from sqlalchemy.orm import Session
from dataset_bridge import inbox, outbox, task_success
with Session(create_engine(sys.argv[1])) as session:
    task_success.ensure_schema(session)
    outbox.ensure_schema(session)
    inbox._ensure_schema(session)
    session.commit()
"""

ROWS = """
INSERT INTO dataset_bridge.emitted (asset_id, idempotency_key, source) VALUES (1, 'k1', 'task');
INSERT INTO dataset_bridge.inbox (source, source_event_id, asset_event_id) VALUES ('a', 7, 70);
INSERT INTO dataset_bridge.outbox (target, asset_event_id, asset_uri, asset_name, event_timestamp)
    VALUES ('b', 9, 'x', 'x', now());
INSERT INTO dataset_bridge.relay_target (target) VALUES ('b');
INSERT INTO dataset_bridge.reconciled (asset_event_id, dag_id) VALUES (9, 'consumer');
"""

# every column, index, constraint and function of the schema but the migration table
DESCRIBE = """
SELECT 'column ' || table_name || '.' || column_name || ' ' || data_type || ' ' || is_nullable || ' '
       || coalesce(column_default, '')
FROM information_schema.columns WHERE table_schema = 'dataset_bridge' AND table_name <> 'migration'
UNION ALL
SELECT 'index ' || indexdef FROM pg_indexes WHERE schemaname = 'dataset_bridge' AND tablename <> 'migration'
UNION ALL
SELECT 'constraint ' || conrelid::regclass || ' ' || pg_get_constraintdef(c.oid)
FROM pg_constraint c JOIN pg_namespace n ON n.oid = c.connamespace
WHERE n.nspname = 'dataset_bridge' AND conrelid::regclass::text <> 'dataset_bridge.migration'
UNION ALL
SELECT 'function ' || p.proname || ' ' || pg_get_function_identity_arguments(p.oid) || ' ' || md5(p.prosrc)
FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = 'dataset_bridge'
ORDER BY 1
"""


def earlier_release(commit: str, folder: Path) -> Path:
    """The earlier release's source tree, from git (``git archive``)."""
    archive = folder / "source.tar"
    subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", "-o", str(archive), commit], check=True
    )
    source = folder / "source"
    with tarfile.open(archive) as tar:
        tar.extractall(source, filter="data")
    return source


def describe(dsn: str) -> list[str]:
    with Session(create_engine(dsn)) as session:
        return list(session.execute(text(DESCRIBE)).scalars())


def migrate(dsn: str) -> list[int]:
    with Session(create_engine(dsn)) as session:
        done = store.migrate(session)
        session.commit()
    return done


@pytest.mark.parametrize("release", sorted(EARLIER))
def test_a_database_an_earlier_release_made_upgrades_in_place(
    release: str, airflow_config: AirflowConfig, pg_db: str, tmp_path: Path
) -> None:
    dsn = airflow_config.database_dsn
    source = earlier_release(EARLIER[release], tmp_path)
    env = {**airflow_config.env(), "PYTHONPATH": str(source)}  # its code first, before this clone's
    made = subprocess.run(
        [sys.executable, "-c", EARLIER_START, dsn],
        cwd=source,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert made.returncode == 0, made.stderr[-4000:]
    with Session(create_engine(dsn)) as session:
        assert session.execute(text("SELECT to_regclass('dataset_bridge.migration')")).scalar() is None
        session.connection().exec_driver_sql(ROWS)
        session.commit()

    assert migrate(dsn) == [version for version, _name, _sql in store.migrations()]
    assert migrate(dsn) == []  # applied once
    assert migrate(pg_db) == [version for version, _name, _sql in store.migrations()]  # a new deployment
    assert describe(dsn) == describe(pg_db)
    with Session(create_engine(dsn)) as session:
        tables = ("emitted", "inbox", "outbox", "reconciled", "relay_target")
        kept = [session.execute(text(f"SELECT count(*) FROM dataset_bridge.{t}")).scalar() for t in tables]
    assert kept == [1, 1, 1, 1, 1]


def test_the_first_migration_changes_nothing_a_current_deployment_has(pg_db: str) -> None:
    """Run twice over a schema it made itself (as over one the parts made from Python), the first file
    is a no-op: every statement in it creates what is missing only."""
    assert migrate(pg_db) != []
    before = describe(pg_db)
    with Session(create_engine(pg_db)) as session:
        session.connection().exec_driver_sql(store.migrations()[0][2])
        session.commit()
    assert describe(pg_db) == before


def test_status_on_tables_made_before_the_reconcilers_function_brings_them_up_to_date(
    env: AirflowConfig,
) -> None:
    """`dataset-bridge status` reads what the reconciler holds back through a function of the schema:
    tables made before that function existed (and before the migrations) are migrated first, as the
    bridge's parts do at their start, not answered with "function does not exist"."""
    from dataset_bridge.service import BridgeSettings, status

    dsn = env.database_dsn
    migrate(dsn)
    with Session(create_engine(dsn)) as session:
        session.execute(
            text("DROP FUNCTION dataset_bridge.jsonb_error(text); DROP TABLE dataset_bridge.migration")
        )
        session.commit()
    reported = status(None, BridgeSettings())
    assert reported["initialized"] and reported["held_back"] == 0, reported
    with Session(create_engine(dsn)) as session:
        assert session.execute(text("SELECT to_regprocedure('dataset_bridge.jsonb_error(text)')")).scalar()
