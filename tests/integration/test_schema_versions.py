"""A schema newer than the release: a newer release's migrations that older instances can run on
are ignored by them; one marked ``-- breaks-older-instances`` makes an older instance refuse to start
(one line, exit code 8) and a running one stop gracefully with that code."""

from __future__ import annotations

import math
from typing import Any

import pytest
import structlog.testing

from devkit.devstack import AirflowConfig, AirflowStack
from smart_triggerer.errors import ExitCode
from tests.helpers.airflow_orm import use_airflow_db
from tests.helpers.waiting import lease_owners, wait_for
from tests.integration.test_cli_errors import SMART, one_line, run
from tests.integration.test_supervisor_faults import make_supervisor

SHARDS = 4  # as test_supervisor_faults.make_supervisor configures it


def known() -> int:
    from smart_triggerer.db.store import migrations

    return max(version for version, _name, _sql in migrations())


def newer_release(dsn: str, *, breaks_older: bool) -> int:
    """What a newer release's start leaves behind: its migration recorded, and (when it breaks older
    instances) the oldest release that may run raised to it. Returns its version."""
    from airflow.utils.session import create_session
    from sqlalchemy import text

    from smart_triggerer.db.store import Store

    use_airflow_db(dsn)
    version = known() + 1
    with create_session() as session:
        store = Store(session)
        store.migrate(SHARDS)
        session.execute(
            text("INSERT INTO smart_triggerer.migration (version, name) VALUES (:v, 'from_a_newer_release')"),
            {"v": version},
        )
        if breaks_older:
            store._run("raise_setting", key="oldest_reader", value=str(version))
    return version


def test_a_newer_compatible_migration_is_ignored(airflow_config: AirflowConfig) -> None:
    from airflow.utils.session import create_session

    from smart_triggerer.db.store import Store

    newer_release(airflow_config.database_dsn, breaks_older=False)
    with create_session() as session:
        assert Store(session).migrate(SHARDS) == []  # nothing to apply, nothing refused


def test_an_older_release_refuses_a_schema_it_cannot_run_on(airflow_config: AirflowConfig) -> None:
    version = newer_release(airflow_config.database_dsn, breaks_older=True)
    env = {**airflow_config.env(), "AIRFLOW__SMART_TRIGGERER__SHARDS": str(SHARDS)}
    one_line(
        run([SMART, "run", "--skip-serve-logs"], env),
        ExitCode.SCHEMA_TOO_NEW,
        f"needs instances that know its version {version}",
        f"knows up to version {known()}",
    )


def test_a_running_instance_stops_with_code_8_when_a_newer_one_breaks_the_schema(
    airflow_config: AirflowConfig,
) -> None:
    use_airflow_db(airflow_config.database_dsn)
    supervisor: Any = make_supervisor()
    supervisor.housekeeping.last_schema_check = -math.inf
    supervisor.housekeeping.run()
    assert not supervisor.stop  # its own schema: it runs on
    newer_release(airflow_config.database_dsn, breaks_older=True)
    supervisor.housekeeping.last_schema_check = -math.inf
    with structlog.testing.capture_logs() as logs:
        supervisor.housekeeping.run()
    # the documented number too (mypy's strict equality does not see that an IntEnum member equals it)
    assert supervisor.stop and supervisor.stop_code == ExitCode.SCHEMA_TOO_NEW == 8  # type: ignore[comparison-overlap]
    assert any(e["event"].startswith("stopping: the schema is newer") for e in logs)


@pytest.mark.parametrize("line", ["-- breaks-older-instances"])
def test_a_migration_marked_as_breaking_raises_the_oldest_reader(
    airflow_config: AirflowConfig, monkeypatch: pytest.MonkeyPatch, line: str
) -> None:
    """Applying a migration with the marker line records it: older instances stop from then on."""
    from airflow.utils.session import create_session

    from smart_triggerer.db import store as store_module
    from smart_triggerer.db.store import SchemaTooNew, Store

    use_airflow_db(airflow_config.database_dsn)
    shipped = store_module.migrations()
    version = known() + 1
    monkeypatch.setattr(
        store_module,
        "migrations",
        lambda: [
            *shipped,
            (version, "breaking", f"{line}\nCREATE TABLE smart_triggerer.next_shape (id int);"),
        ],
    )
    with create_session() as session:
        assert Store(session).migrate(SHARDS)[-1] == version
        assert Store(session).oldest_reader() == version
    monkeypatch.setattr(store_module, "migrations", lambda: shipped)  # the release before it
    with pytest.raises(SchemaTooNew), create_session() as session:
        Store(session).migrate(SHARDS)


def test_a_running_instance_process_exits_8_and_hands_its_shards_back(airflow_stack: AirflowStack) -> None:
    """The real process, as an operator sees it: one line, exit code 8 within the check interval, and its
    leases released on the way out (not left to expire), so the newer instances take its shards at once."""
    dsn = airflow_stack.config.database_dsn
    instance = airflow_stack.start_smart_triggerer(
        "older", env={"AIRFLOW__SMART_TRIGGERER__SHARDS": str(SHARDS)}
    )
    instance.wait_for_log("smart triggerer started", timeout=120)
    wait_for(
        lambda: lease_owners(dsn),
        lambda owners: len(owners) == SHARDS and None not in owners.values(),
        60,
        "the instance to own every shard",
    )
    newer_release(dsn, breaks_older=True)
    code = wait_for(
        lambda: instance.process.poll() if instance.process else None,
        lambda c: c is not None,
        60,
        "the older instance to stop",
    )
    assert code == ExitCode.SCHEMA_TOO_NEW == 8, instance.log_tail(4000)  # type: ignore[comparison-overlap]
    assert set(lease_owners(dsn).values()) == {None}, "leases left to expire instead of released"
    assert instance.log_tail(200_000).count("stopping: the schema is newer") == 1
