"""The console script and the Airflow provider hook, as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from devkit.devstack import AirflowConfig
from smart_triggerer import __version__

BIN = Path(sys.executable).parent


def run(argv: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, check=False)


def test_version_and_help() -> None:
    version = run([str(BIN / "smart-triggerer"), "--version"])
    assert version.returncode == 0 and version.stdout.strip() == f"smart-triggerer {__version__}"
    helped = run([str(BIN / "smart-triggerer"), "--help"])
    assert helped.returncode == 0
    commands = helped.stdout.split("Configuration")[0]
    assert "run" in commands and "status" in commands and "demo" not in commands  # the demo is the clone's
    assert "SMART_TRIGGERER_DSN is read only by the demo and the tests of a clone" in helped.stdout
    dev = run([sys.executable, str(Path(__file__).parents[2] / "dev.py"), "--help"])
    assert dev.returncode == 0
    for job in (
        "demo [--quick] [--json] [--keep-running]",
        "test [--airflow VERSION] [PYTEST ARGS...]",
        "--airflow lowest",
        "SMART_TRIGGERER_DSN",
    ):
        assert job in dev.stdout, dev.stdout


def test_bad_arguments_name_the_argument() -> None:
    result = run([str(BIN / "smart-triggerer"), "run", "--capacity", "0"])
    assert result.returncode == 2
    assert "--capacity" in result.stderr and "positive" in result.stderr


def test_airflow_lists_the_provider_and_runs_status_through_it(airflow_config: AirflowConfig) -> None:
    env = airflow_config.env()
    providers = run([airflow_config.airflow_bin(), "providers", "list"], env)
    assert "airflow-smart-triggerer" in providers.stdout, providers.stderr[-2000:]
    status = run([airflow_config.airflow_bin(), "smart-triggerer", "status", "--json"], env)
    assert status.returncode == 0, status.stderr[-2000:]
    result = json.loads(status.stdout.strip().splitlines()[-1])
    assert result["instances"] == [] and result["dedup_ratio"] is None
    # Airflow knows our settings' defaults (the provider declares them)
    listed = run(
        [airflow_config.airflow_bin(), "config", "list", "--section", "smart_triggerer", "--show-values"], env
    )
    for line in ("shards = 64", "lease_seconds = 8", "health_host = 127.0.0.1", "resume_hold_seconds = 10"):
        assert line in listed.stdout.splitlines(), listed.stdout


def test_a_changed_shard_count_is_refused_with_the_fix(airflow_config: AirflowConfig) -> None:
    from airflow.utils.session import create_session

    from smart_triggerer.db.store import ShardCountMismatch, Store, migrations
    from tests.helpers.airflow_orm import use_airflow_db

    use_airflow_db(airflow_config.database_dsn)
    with create_session() as session:
        assert Store(session).migrate(32) == [version for version, _name, _sql in migrations()]
    with create_session() as session:
        assert Store(session).migrate(32) == []
    fix = "AIRFLOW__SMART_TRIGGERER__SHARDS=32"
    with pytest.raises(ShardCountMismatch, match=fix), create_session() as session:
        Store(session).migrate(16)
