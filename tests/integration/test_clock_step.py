"""Member timeouts on the database clock, through a step of that clock (expiry is judged on
the database clock only). A PostgreSQL server whose clock jumps forward while it runs (libfaketime, as in
the chaos run): the deadlines the supervisor keeps between loads must follow it within a loop, not fire
as late as the step is long (a 20-minute chaos run timed a member out 14 s after it was due)."""

from __future__ import annotations

import datetime as dt
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from devkit.devstack import AirflowConfig, migrate
from devkit.system import ensure_libfaketime
from tests.helpers.airflow_orm import use_airflow_db
from tests.helpers.databases import create_database
from tests.helpers.fake_clock import FakeClockPostgres
from tests.helpers.seeding import seed_deferred
from tests.helpers.waiting import rows
from tests.integration.test_supervisor_faults import AT_TIME, load, make_supervisor


@pytest.fixture
def stepping_db(tmp_path: Path) -> Iterator[tuple[FakeClockPostgres, AirflowConfig]]:
    server = FakeClockPostgres(tmp_path / "pgdata", library=ensure_libfaketime())
    server.start()
    try:
        config = AirflowConfig(
            home=tmp_path / "airflow",
            database_dsn=create_database(server.dsn, "clock"),
            dags_folder=tmp_path / "dags",
            fernet_key=os.environ["AIRFLOW__CORE__FERNET_KEY"],
        )
        migrate(config)
        use_airflow_db(config.database_dsn)
        yield server, config
    finally:
        server.stop()


def test_members_time_out_on_the_database_clock_after_it_steps_forward(
    stepping_db: tuple[FakeClockPostgres, AirflowConfig],
) -> None:
    server, config = stepping_db
    dsn = config.database_dsn
    moment = (dt.datetime.now(dt.UTC) + dt.timedelta(hours=2)).isoformat()
    seeded = seed_deferred(
        dsn,
        config.dags_folder,
        count=2,
        classpath=AT_TIME,
        kwargs_for=lambda i: {"moment": moment},
        trigger_timeout=dt.timedelta(seconds=60),
    )
    supervisor = make_supervisor()
    load(supervisor)
    assert set(seeded.trigger_ids) <= set(supervisor.member_info)
    server.step(90.0)  # the database's clock: every deadline now lies 30 s in its past
    supervisor._db_step("load", supervisor.load_triggers)  # one loop: renews, reads the clock, times out
    failed = rows(
        dsn,
        "SELECT next_kwargs::text FROM task_instance WHERE dag_id = %s "
        "AND state = 'scheduled' AND next_method = '__fail__'",
        seeded.dag_id,
    )
    print(f"\ntimed out after one loop: {len(failed)} of 2; last error: {supervisor.last_error}")
    assert len(failed) == 2 and all("Trigger timeout" in text for (text,) in failed)
