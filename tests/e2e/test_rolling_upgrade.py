"""A rolling upgrade from the previous release and a rollback to it, with waits in flight.

The previous release is built from its commit (``fe46614``, as the CHANGELOG names it) as a wheel, installed
into a folder of its own and put first on the ``PYTHONPATH`` of its instances: they run that release's code
and schema migrations beside this one's, on the same Airflow. The rollout replaces the two old instances one
at a time while loads land, the new release applying its migrations (placement, 0012) under them; the rollback
stops the new instances and starts an old one on the newer schema. Every sensor must resume once, each phase's
within a bound of its load landing, and none may fail.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import tarfile
import textwrap
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import asyncpg
import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from devkit.devstack import AirflowConfig, AirflowStack, Component
from tests.e2e.test_release_artifacts import run
from tests.helpers.chaos.databases import AUDIT_DDL
from tests.helpers.waiting import rows, wait_for

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
PREVIOUS_COMMIT = "fe46614"  # 0.1.0 (CHANGELOG.md)
PACKAGE = "airflow-smart-triggerer"
TABLES = 12  # 24 sensors, two per table (one group each)

DAG = f"""
import pendulum
from airflow.sdk import DAG
from deferrables import TableLoadSensor

with DAG(dag_id="upgrade", schedule=None, start_date=pendulum.datetime(2024, 1, 1), catchup=False):
    for n in range({TABLES}):
        for copy in ("a", "b"):
            TableLoadSensor(task_id=f"wait_t{{n}}_{{copy}}", conn_id="warehouse", required_tables=[f"t{{n}}"],
                            poke_interval=2, timeout=900)
"""

STATUS_DDL = """
CREATE SCHEMA meta;
CREATE TABLE meta.detail_process_table_status (
    id bigserial PRIMARY KEY, table_name text, status text, created_dttm timestamptz NOT NULL DEFAULT now()
);
"""

# a load's waits leave DEFERRED within a lease (8 s: a handover that went wrong waits for it) + a poke
# (2 s) + 10 s for a loaded CI machine's loop: a wait stalled beyond a lease fails the test
RELEASE_BOUND = 20
# and then succeed after a scheduler and worker turn: generous, far below the sensors' timeout
RESUME_BOUND = 90
JOB_ID = re.compile(r"smart triggerer started.*?\bjob_id=(\d+)")


def previous_commit() -> str:
    """The previous release's commit, as the CHANGELOG names it."""
    argv = ["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet", f"{PREVIOUS_COMMIT}^{{commit}}"]
    found = subprocess.run(argv, capture_output=True, text=True, check=False)
    if found.returncode != 0:
        raise AssertionError(
            f"{PREVIOUS_COMMIT} is not in this clone: the rolling upgrade test needs the "
            "previous release's history (a full clone, not a shallow one)"
        )
    return found.stdout.strip()


@pytest.fixture(scope="module")
def previous_build(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The previous release's wheel, built from its commit, installed (without dependencies: they are this
    environment's) into a folder that goes first on its instances' PYTHONPATH."""
    work = tmp_path_factory.mktemp("previous")
    archive = work / "source.tar"
    run(["git", "-C", ROOT, "archive", "--format=tar", "-o", archive, previous_commit()])
    source = work / "source"
    with tarfile.open(archive) as tar:
        tar.extractall(source, filter="data")
    run([sys.executable, "-m", "build", "--wheel", "--outdir", work / "dist", source])
    (wheel,) = (work / "dist").glob("*.whl")
    site = work / "site"
    run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", site, wheel])
    yield site


def supports_this_airflow(site: Path) -> tuple[bool, str]:
    supported = previous_airflow_range(site)
    installed = metadata.version("apache-airflow")
    return (
        SpecifierSet(supported, prereleases=True).contains(installed, prereleases=True),
        f"the previous release supports apache-airflow{supported}; this run has {installed}",
    )


@pytest.fixture(scope="module")
def previous_release(previous_build: Path) -> Path:
    """The previous release, where it supports the Airflow under test (CI's lowest-Airflow run may be
    below its range: there the test below checks that it refuses to start instead)."""
    supported, why = supports_this_airflow(previous_build)
    if not supported:
        pytest.skip(why)
    return previous_build


def previous_airflow_range(site: Path) -> str:
    """The ``apache-airflow`` requirement the previous release's wheel declares (its refusal range)."""
    (dist,) = (d for d in metadata.distributions(path=[str(site)]) if d.metadata["Name"] == PACKAGE)
    for requirement in map(Requirement, dist.requires or []):
        if requirement.name == "apache-airflow":
            return str(requirement.specifier)
    raise AssertionError(f"the previous release declares no apache-airflow requirement: {dist.requires}")


def _execute(dsn: str, statement: str, *args: object) -> None:
    async def go() -> None:
        conn = await asyncpg.connect(dsn)
        await conn.execute(statement, *args)
        await conn.close()

    asyncio.run(go())


def land(warehouse: str, tables: range) -> None:
    _execute(
        warehouse,
        "INSERT INTO meta.detail_process_table_status (table_name, status) "
        "SELECT unnest($1::text[]), 'SUCCESS'",
        [f"t{n}" for n in tables],
    )


def states(dsn: str) -> dict[str, tuple[str | None, int]]:
    return {
        task: (state, tries)
        for task, state, tries in rows(
            dsn, "SELECT task_id, state, try_number FROM task_instance WHERE dag_id = 'upgrade'"
        )
    }


def resumed(dsn: str, tables: range) -> None:
    """Every sensor of these tables leaves DEFERRED within RELEASE_BOUND of its load landing (the triggerer's
    part: nothing stalled beyond a lease), then ends in success, once (its first try, and one write out of
    DEFERRED in the audit trail)."""
    names = {f"wait_t{n}_{copy}" for n in tables for copy in ("a", "b")}
    wait_for(
        lambda: states(dsn),
        lambda s: all(s.get(t, (None, 0))[0] not in (None, "deferred") for t in names),
        RELEASE_BOUND,
        f"the sensors of tables {tables.start}-{tables.stop - 1} to leave DEFERRED",
    )
    found = wait_for(
        lambda: states(dsn),
        lambda s: all(s.get(t, (None, 0))[0] == "success" for t in names),
        RESUME_BOUND,
        f"the sensors of tables {tables.start}-{tables.stop - 1} to succeed",
    )
    assert all(found[t][1] == 1 for t in names), {t: found[t] for t in names}
    # what the database saw: each task instance written out of DEFERRED once (a double resume by an old
    # and a new instance would show here even when the second write was absorbed)
    left = dict(
        rows(
            dsn,
            "SELECT ti.task_id, count(*) FROM chaos.ti_audit a JOIN task_instance ti "
            "ON ti.id = a.ti_id WHERE a.op = 'resolved' AND ti.dag_id = 'upgrade' "
            "GROUP BY ti.task_id",
        )
    )
    assert all(left.get(t) == 1 for t in names), {t: left.get(t) for t in names}


def still_waiting(dsn: str, tables: range) -> None:
    names = {f"wait_t{n}_{copy}" for n in tables for copy in ("a", "b")}
    assert {states(dsn)[t][0] for t in names} == {"deferred"}


def job_of(component: Component) -> int:
    found = JOB_ID.search(component.log_tail(2_000_000))
    assert found is not None, f"{component.name} logged no start line"
    return int(found.group(1))


def previous_command(site: Path) -> Path:
    """The previous release's own ``smart-triggerer`` (its entry point names its own module: this
    environment's would run this release's code, whatever the PYTHONPATH)."""
    return site / "bin" / "smart-triggerer"


def old_instance(stack: AirflowStack, site: Path, name: str) -> Component:
    component = stack.start_smart_triggerer(
        name, env={"PYTHONPATH": str(site)}, command=previous_command(site)
    )
    component.wait_for_log("smart triggerer started", timeout=120)
    return component


def new_instance(stack: AirflowStack, name: str) -> Component:
    component = stack.start_smart_triggerer(name)
    component.wait_for_log("smart triggerer started", timeout=120)
    return component


def applied(dsn: str) -> int:
    return int(rows(dsn, "SELECT max(version) FROM smart_triggerer.migration")[0][0])


def owners(dsn: str) -> set[int]:
    """Jobs that own a live shard lease now."""
    return {
        r[0]
        for r in rows(
            dsn, "SELECT DISTINCT owner_job_id FROM smart_triggerer.shard_lease WHERE expires_at > now()"
        )
    }


# a scenario of many steps, each with its own limit: 200-290 s on a slow 2-core machine with the
# parallel phase's other tests, over the suite's default limit of five minutes
@pytest.mark.timeout(600)
def test_a_rolling_upgrade_and_a_rollback_lose_and_double_no_wait(
    airflow_stack: AirflowStack, pg_db: str, previous_release: Path
) -> None:
    config = airflow_stack.config
    dsn = config.database_dsn
    _execute(pg_db, STATUS_DDL)
    rows(dsn, AUDIT_DDL + "; SELECT 1")  # every write of a task instance leaving DEFERRED, audited
    config.extra["AIRFLOW_CONN_WAREHOUSE"] = pg_db
    (config.dags_folder / "upgrade.py").write_text(textwrap.dedent(DAG))
    out = subprocess.run(
        [previous_command(previous_release), "--version"],
        capture_output=True,
        text=True,
        check=False,
        env={**config.env(), "PYTHONPATH": str(previous_release)},
    )
    assert out.stdout.strip() == "smart-triggerer 0.1.0", out.stdout + out.stderr

    airflow_stack.start_core()
    old = [old_instance(airflow_stack, previous_release, f"old-{n}") for n in (1, 2)]
    previous_schema = applied(dsn)
    airflow_stack.wait_for_dags(["upgrade"])
    airflow_stack.unpause("upgrade")
    run_id = airflow_stack.trigger("upgrade")
    wait_for(
        lambda: states(dsn),
        lambda s: len(s) == 2 * TABLES and {v[0] for v in s.values()} == {"deferred"},
        180,
        "every sensor to defer",
    )
    land(pg_db, range(0, 3))
    resumed(dsn, range(0, 3))  # the old release alone

    # the rollout: a new instance joins (and migrates the schema under the old ones: a load lands just
    # before, its events fire while the new one starts), then each old one is replaced while loads land
    land(pg_db, range(3, 4))
    new = [new_instance(airflow_stack, "new-1")]
    assert applied(dsn) > previous_schema  # the new release's migrations (placement: 0012)
    land(pg_db, range(4, 5))
    resumed(dsn, range(3, 5))
    airflow_stack.retire(old[0])
    new.append(new_instance(airflow_stack, "new-2"))
    land(pg_db, range(5, 7))
    resumed(dsn, range(5, 7))
    airflow_stack.retire(old[1])
    land(pg_db, range(7, 9))
    resumed(dsn, range(7, 9))
    still_waiting(dsn, range(9, TABLES))

    # the rollback: the new instances stop; the previous release runs on the newer schema
    for component in new:
        airflow_stack.retire(component)
    rolled_back = old_instance(airflow_stack, previous_release, "old-3")
    wait_for(
        lambda: owners(dsn),
        lambda o: o == {job_of(rolled_back)},
        60,
        "the old release alone to own the shards",
    )
    land(pg_db, range(9, TABLES))
    resumed(dsn, range(9, TABLES))
    assert airflow_stack.wait_for_run("upgrade", run_id, timeout=120) == "success"
    assert rolled_back.running()
    log = rolled_back.log_tail(200_000)
    assert "Traceback" not in log, log[-3000:]


def test_the_previous_release_refuses_an_airflow_below_its_range(
    airflow_config: AirflowConfig, previous_build: Path
) -> None:
    """Where the Airflow under test is outside the previous release's declared range, that release's
    ``smart-triggerer run`` refuses it at start: one line and exit code 7, never a half-started instance."""
    supported, why = supports_this_airflow(previous_build)
    if supported:
        pytest.skip(f"{why}: the rolling upgrade above runs it instead")
    out = subprocess.run(
        [previous_command(previous_build), "run"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**airflow_config.env(), "PYTHONPATH": str(previous_build)},
    )
    assert out.returncode == 7, out.stdout[-2000:] + out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    refusal = f"Apache Airflow {metadata.version('apache-airflow')} is installed"
    assert len(lines) == 1 and refusal in lines[0], out.stderr
