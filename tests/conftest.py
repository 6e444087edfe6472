"""Shared fixtures: one PostgreSQL server per session, a migrated Airflow template, fresh clones per test.

The test process itself imports Airflow (for seeding), so Airflow's environment is fixed here, before
anything imports it: a private AIRFLOW_HOME and one Fernet key shared with every process a test starts.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import time
from collections.abc import Generator, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

_SESSION_HOME = Path(tempfile.mkdtemp(prefix="smart-triggerer-tests-"))
os.environ["AIRFLOW_HOME"] = str(_SESSION_HOME / "airflow")
os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
os.environ["AIRFLOW__CORE__UNIT_TEST_MODE"] = "False"
if not os.environ.get("AIRFLOW__CORE__FERNET_KEY"):
    from cryptography.fernet import Fernet

    os.environ["AIRFLOW__CORE__FERNET_KEY"] = Fernet.generate_key().decode()

from devkit.devstack import AirflowConfig, AirflowStack, migrate  # noqa: E402
from devkit.pgserver import postgres_dsn  # noqa: E402
from tests.helpers.databases import database, unique_name  # noqa: E402

_STARTED = time.monotonic()
_files_started: set[str] = set()
_config: list[pytest.Config] = []


def pytest_configure(config: pytest.Config) -> None:
    _config.append(config)


def _remove_session_home() -> None:
    shutil.rmtree(_SESSION_HOME, ignore_errors=True)


# Last of all: Airflow code run during teardown (or at exit) may create files under AIRFLOW_HOME again.
atexit.register(_remove_session_home)


def pytest_unconfigure(config: pytest.Config) -> None:
    _remove_session_home()


# The longest tests (seconds on a 2-core machine, November 2026), started first: pytest-xdist hands tests out
# in collection order as workers free up, so none of these is left to run alone at the end. Ordering only:
# a stale or missing entry costs time, never coverage.
LONGEST_FIRST = (
    "tests/e2e/test_rolling_upgrade.py::test_a_rolling_upgrade_and_a_rollback_lose_and_double_no_wait",  # 159
    "tests/e2e/test_chaos.py::test_short_chaos_run_loses_doubles_and_stalls_nothing",  # 113
    "tests/e2e/test_demo_e2e.py::test_quick_demo_resumes_every_task_and_prints_its_summary",  # 93
    "tests/e2e/test_smart_e2e.py::test_thirty_sensors_on_four_targets_share_four_groups",  # 93
    "tests/e2e/test_cross_deployment_e2e.py::"
    "test_events_cross_deployments_exactly_once_through_crashes_downtime_and_bad_requests",  # 81
    "tests/e2e/test_task_success_bridge_e2e.py::"
    "test_task_success_becomes_exactly_one_event_through_crashes_and_races",  # 69
    "tests/e2e/test_status_table_bridge_e2e.py::"
    "test_status_rows_make_one_event_each_and_the_and_consumer_runs_once",  # 63
    "tests/integration/test_takeover_at_scale.py::test_a_takeover_interrupted_halfway_still_loads_every_wait",
    "tests/integration/test_takeover_at_scale.py::"
    "test_a_takeover_of_thousands_of_waits_polls_every_one_within_lease_plus_5s",  # 59
    "tests/e2e/test_sql_http_e2e.py::test_sql_and_http_sensors_defer_and_resume",  # 53
    "tests/e2e/test_asset_event_e2e.py::test_mid_dag_wait_ends_on_the_asset_event",  # 52
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {nodeid: place for place, nodeid in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid, len(rank)))  # stable: the rest keep their order


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_logstart(nodeid: str, location: tuple[str, int | None, str]) -> None:
    """A line when a file's first test starts, with the suite's elapsed time: e2e files run for minutes.
    (With pytest-xdist this runs in the controller, as the workers report their tests starting.)"""
    path = nodeid.split("::", 1)[0]
    if path in _files_started:
        return
    _files_started.add(path)
    reporter = _config[0].pluginmanager.get_plugin("terminalreporter") if _config else None
    if reporter is not None:
        elapsed = time.monotonic() - _STARTED
        reporter.ensure_newline()
        minutes, seconds = divmod(round(elapsed), 60)  # whole seconds first: never "02:60"
        reporter.write_line(f"[{minutes:02d}:{seconds:02d}] {path}")


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report


def _failed(request: pytest.FixtureRequest) -> bool:
    report = getattr(request.node, "report_call", None)
    return report is None or report.failed


@pytest.fixture(scope="session")
def pg_server() -> Iterator[str]:
    """DSN of a PostgreSQL server: SMART_TRIGGERER_DSN, or a private embedded one."""
    with postgres_dsn() as dsn:
        yield dsn


@pytest.fixture
def pg_db(pg_server: str) -> Iterator[str]:
    """An empty database of its own, dropped after the test."""
    with database(pg_server, "st_plain") as dsn:
        yield dsn


@pytest.fixture(scope="session")
def airflow_template(pg_server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Name of a database migrated once per session by `airflow db migrate`, cloned by each test."""
    from tests.helpers.databases import create_database, drop_database

    name = unique_name("st_template")
    dsn = create_database(pg_server, name)
    home = tmp_path_factory.mktemp("template-home")
    try:
        migrate(
            AirflowConfig(
                home=home,
                database_dsn=dsn,
                dags_folder=home / "dags",
                fernet_key=os.environ["AIRFLOW__CORE__FERNET_KEY"],
            )
        )
        yield name
    finally:
        drop_database(pg_server, name)


@pytest.fixture
def airflow_db(pg_server: str, airflow_template: str) -> Iterator[str]:
    """DSN of a fresh, migrated Airflow metadata database (a template clone)."""
    with database(pg_server, "st_airflow", template=airflow_template) as dsn:
        yield dsn


@pytest.fixture
def airflow_config(airflow_db: str, tmp_path: Path) -> AirflowConfig:
    """A deployment on the fresh database: its own home and dags folder, the session's Fernet key."""
    home = tmp_path / "airflow"
    home.mkdir()
    return AirflowConfig(
        home=home,
        database_dsn=airflow_db,
        dags_folder=tmp_path / "dags",
        fernet_key=os.environ["AIRFLOW__CORE__FERNET_KEY"],
    )


@pytest.fixture
def airflow_stack(airflow_config: AirflowConfig, request: pytest.FixtureRequest) -> Iterator[AirflowStack]:
    """A stack object; the test writes its DAG files, then calls ``start_core()`` and adds triggerers.

    Every process it started is stopped at teardown; a failed test prints the components' log tails.
    """
    airflow_config.dags_folder.mkdir(parents=True, exist_ok=True)
    with _stopped_at_teardown(AirflowStack(airflow_config), request) as stack:
        yield stack


@contextmanager
def _stopped_at_teardown(stack: AirflowStack, request: pytest.FixtureRequest) -> Iterator[AirflowStack]:
    try:
        yield stack
    finally:
        if _failed(request):
            print(stack.log_tails())
            print(python_stacks(stack))
        stack.stop()


def python_stacks(stack: AirflowStack) -> str:
    """What every process of our own components is doing now (py-spy dump), for a failed test: a wait
    that never ends leaves no log line, a stack shows where it hangs."""
    import shutil
    import subprocess
    import sys

    spy = shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if spy is None:
        return "(py-spy is not installed: no stacks)"
    dumps = []
    for component in stack.components:
        if not component.name.startswith(("smart", "dataset-bridge", "relay")):
            continue
        for process in component.tree():
            try:
                result = subprocess.run(
                    [spy, "dump", "--pid", str(process.pid)],
                    capture_output=True,
                    text=True,
                    timeout=30,
                    check=False,
                )
                found = (result.stdout or result.stderr)[-6000:]
            except subprocess.TimeoutExpired:
                found = "(py-spy dump timed out)"
            dumps.append(f"----- stacks of {component.name} pid {process.pid} -----\n{found}")
    return "\n".join(dumps)


@pytest.fixture
def second_airflow_stack(
    pg_server: str, airflow_template: str, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[AirflowStack]:
    """A second deployment (its own metadata database, home, dags folder and ports) for cross-deployment
    tests; stopped at teardown, its log tails printed when the test failed."""
    with database(pg_server, "st_airflow_b", template=airflow_template) as dsn:
        home = tmp_path / "airflow_b"
        home.mkdir()
        config = AirflowConfig(
            home=home,
            database_dsn=dsn,
            dags_folder=tmp_path / "dags_b",
            fernet_key=os.environ["AIRFLOW__CORE__FERNET_KEY"],
        )
        config.dags_folder.mkdir()
        with _stopped_at_teardown(AirflowStack(config), request) as stack:
            yield stack
