"""Errors a user can fix: exactly one line on stderr saying what and how, and a distinct exit code."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from devkit.devstack import AirflowConfig
from devkit.pgserver import create_database, drop_database, free_port, plain_dsn, sqlalchemy_url
from smart_triggerer.db.preflight import supported_airflow
from smart_triggerer.errors import ExitCode
from tests.helpers.waiting import rows

BIN = Path(sys.executable).parent
SMART = str(BIN / "smart-triggerer")
BRIDGE = str(BIN / "dataset-bridge")


def run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=120, env=env, check=False, start_new_session=True
    )


def one_line(result: subprocess.CompletedProcess[str], code: int, *words: str) -> str:
    """The whole of stderr is one line naming the command, with every word, and the exit code is ``code``."""
    lines = result.stderr.strip().splitlines()
    errors = [line for line in result.stderr.splitlines() if "Error" in line][-3:]
    assert result.returncode == code, (result.returncode, errors, result.stderr[-1000:])
    assert len(lines) == 1, result.stderr[-3000:]
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def config(airflow_config: AirflowConfig) -> AirflowConfig:
    """A deployment with a migrated metadata database; each test breaks one thing in its environment."""
    return airflow_config


def env_with(config: AirflowConfig, **settings: str) -> dict[str, str]:
    env = config.env()
    env.update(settings)
    return env


def unreachable(config: AirflowConfig) -> dict[str, str]:
    # a port nothing listens on: connection refused at once
    return env_with(
        config, AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=f"postgresql://postgres@127.0.0.1:{free_port()}/x"
    )


@pytest.mark.parametrize(
    "argv", [[SMART, "status"], [SMART, "run", "--skip-serve-logs"], [BRIDGE, "status"], [BRIDGE, "run"]]
)
def test_an_unreachable_database_is_one_line(config: AirflowConfig, argv: list[str]) -> None:
    line = one_line(
        run(argv, unreachable(config)),
        ExitCode.DATABASE_UNREACHABLE,
        "cannot reach the database",
        "Connection refused",
        "sql_alchemy_conn",
    )
    assert line.startswith(Path(argv[0]).name + ": error: ")


def test_verbose_adds_the_traceback(config: AirflowConfig) -> None:
    result = run([SMART, "status", "--verbose"], unreachable(config))
    assert result.returncode == ExitCode.DATABASE_UNREACHABLE
    assert "Traceback (most recent call last)" in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("smart-triggerer: error: cannot reach")


@pytest.mark.parametrize(
    ("key", "value", "words"),
    [
        ("SHARDS", "abc", ("shards must be an integer", "'abc'", "AIRFLOW__SMART_TRIGGERER__SHARDS")),
        ("DEDUP", "maybe", ("dedup must be true or false", "'maybe'")),
        ("HEALTH_HOST", "0.0.0.0", ("health_token", "AIRFLOW__SMART_TRIGGERER__HEALTH_TOKEN")),
    ],
)
def test_an_invalid_setting_is_one_line(
    config: AirflowConfig, key: str, value: str, words: tuple[str, ...]
) -> None:
    env = env_with(
        config, **{f"AIRFLOW__SMART_TRIGGERER__{key}": value, "AIRFLOW__SMART_TRIGGERER__HEALTH_PORT": "0"}
    )
    one_line(run([SMART, "run", "--skip-serve-logs"], env), ExitCode.CONFIG, *words)


@pytest.mark.parametrize("argv", [[SMART, "run", "--skip-serve-logs"], [BRIDGE, "run"]])
def test_a_sqlite_metadata_database_is_refused(
    config: AirflowConfig, tmp_path: Path, argv: list[str]
) -> None:
    env = env_with(config, AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=f"sqlite:///{tmp_path}/airflow.db")
    one_line(run(argv, env), ExitCode.DATABASE_UNSUPPORTED, "is sqlite", "need PostgreSQL", "postgresql://")
    assert not (tmp_path / "airflow.db").exists() or (tmp_path / "airflow.db").stat().st_size == 0


def test_a_changed_shard_count_is_one_line_with_the_fix(config: AirflowConfig) -> None:
    from airflow.utils.session import create_session

    from smart_triggerer.db.store import Store
    from tests.helpers.airflow_orm import use_airflow_db

    use_airflow_db(config.database_dsn)
    with create_session() as session:
        Store(session).migrate(32)
    env = env_with(config, AIRFLOW__SMART_TRIGGERER__SHARDS="16")
    one_line(
        run([SMART, "run", "--skip-serve-logs"], env),
        ExitCode.SHARD_COUNT,
        "shards is 16",
        "created with 32",
        "AIRFLOW__SMART_TRIGGERER__SHARDS=32",
    )


@pytest.fixture
def unmigrated(config: AirflowConfig) -> Iterator[str]:
    """An empty database on the same server: ``airflow db migrate`` never ran on it."""
    name = f"unmigrated_{free_port()}"
    dsn = create_database(config.database_dsn, name)
    yield sqlalchemy_url(dsn)
    drop_database(config.database_dsn, name)


@pytest.mark.parametrize(
    "argv", [[SMART, "run", "--skip-serve-logs"], [SMART, "status"], [BRIDGE, "run"], [BRIDGE, "status"]]
)
def test_a_database_airflow_never_migrated_is_one_line(
    config: AirflowConfig, unmigrated: str, argv: list[str]
) -> None:
    env = env_with(config, AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=unmigrated)
    one_line(run(argv, env), ExitCode.AIRFLOW_NOT_MIGRATED, "has no Airflow tables", "airflow db migrate")
    tables = rows(
        plain_dsn(unmigrated),
        "SELECT count(*) FROM pg_tables WHERE schemaname NOT IN ('pg_catalog', 'information_schema')",
    )
    assert tables == [(0,)], "nothing was created in a database that is not Airflow's yet"


def test_a_mapping_value_that_is_not_a_list_is_refused_when_read(
    config: AirflowConfig, tmp_path: Path
) -> None:
    mapping = tmp_path / "bridge.yaml"
    mapping.write_text("etl.load_users: warehouse://dds/h_user, warehouse://dds/s_user\n")
    one_line(
        run([BRIDGE, "run", "--mapping", str(mapping)], config.env()),
        ExitCode.CONFIG,
        str(mapping),
        "'etl.load_users' must map to a non-empty list",
        "got str",
        "write [",
    )


def test_a_routes_file_error_is_one_line(config: AirflowConfig, tmp_path: Path) -> None:
    routes = tmp_path / "routes.yaml"
    routes.write_text("source: a\ntargets:\n  b: {url: ftp://b, secret_env: B, assets: [x]}\n")
    one_line(
        run([BRIDGE, "relay", "--routes", str(routes)], config.env()),
        ExitCode.CONFIG,
        "url must be an http(s) URL",
    )


def test_a_missing_database_privilege_is_one_line(config: AirflowConfig) -> None:
    from devkit.pgserver import reader_dsn, sqlalchemy_url

    # a role that can read Airflow's tables but neither write them nor create our schema
    reader = sqlalchemy_url(reader_dsn(config.database_dsn))
    env = env_with(config, AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=reader)
    one_line(
        run([SMART, "run", "--skip-serve-logs"], env),
        ExitCode.DATABASE_PRIVILEGE,
        "the database role lacks a privilege (permission denied",
        "docs/operations/install.md",
    )


def test_a_health_port_in_use_is_one_line(config: AirflowConfig) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        one_line(
            run([SMART, "run", "--skip-serve-logs", "--health-port", str(port)], config.env()),
            ExitCode.CONFIG,
            f"cannot serve the health endpoint on 127.0.0.1:{port}",
            "--health-port",
        )


@pytest.mark.parametrize("argv", [[SMART, "status"], [SMART, "run", "--skip-serve-logs"], [BRIDGE, "status"]])
@pytest.mark.parametrize(
    "url", ["postgres//oops", "postgresql://airflow:s3cret@db:notaport/airflow", "postgresql:/x"]
)
def test_a_malformed_database_url_is_one_line_without_the_password(
    config: AirflowConfig, argv: list[str], url: str
) -> None:
    env = env_with(config, AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=url)
    line = one_line(
        run(argv, env),
        ExitCode.CONFIG,
        "cannot parse [database] sql_alchemy_conn",
        "postgresql://user:password@host:5432/airflow",
    )
    assert "s3cret" not in line


@pytest.mark.parametrize(
    ("argv", "suggestion"),
    [
        ([SMART, "run", "--capcity", "3"], "unrecognized arguments: --capcity 3 (did you mean --capacity?)"),
        ([SMART, "status", "--jsn"], "(did you mean --json?)"),
        ([SMART, "rn"], "invalid choice: 'rn'"),
        ([BRIDGE, "relay-stauts"], "did you mean 'relay-status'?"),
    ],
)
def test_a_misspelled_flag_or_command_suggests_the_right_one(argv: list[str], suggestion: str) -> None:
    result = run(argv, {"PATH": str(BIN)})
    assert result.returncode == ExitCode.CONFIG
    last = result.stderr.strip().splitlines()[-1]
    assert suggestion in last, result.stderr
    if argv[1] == "rn":
        assert last.endswith("did you mean 'run'?")


def test_an_airflow_outside_the_tested_range_is_refused(config: AirflowConfig, tmp_path: Path) -> None:
    """As if Airflow were upgraded under us (or we were installed with --no-deps): the supervisor builds
    on the internals of the releases it is tested with, so it does not start on another."""
    shim = tmp_path / "another_airflow"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text("import airflow\nairflow.__version__ = '3.4.0'\n")
    env = env_with(config, PYTHONPATH=str(shim))
    one_line(
        run([SMART, "run", "--skip-serve-logs"], env),
        ExitCode.AIRFLOW_UNSUPPORTED,
        "Apache Airflow 3.4.0 is installed",
        f"apache-airflow{supported_airflow()}",
    )
